"""The performance page's figures, drawn at build time from the committed asv results.

Reads ``asv_benchmarks/results/<machine>/*.json`` (asv's result files) and, for each
machine, the latest run that measured each benchmark, and draws three figures into
``generated/performance/``:

* ``scaling.png``: our forward and VJP over torch's against the sequence length
  (``scaling.TorchScaling``), one pair of lines per machine and device (CPU float32; CUDA
  float16 where a GPU machine's results exist);
* ``accuracy.png``: our float32/float16/bfloat16 error over torch's, both against the
  float64 oracle, per case (``accuracy.AccuracyVersusTorch.track_error_ratio``);
* ``documents.png``: packed documents through a mask function and through segment ids over
  the unmasked call against the number of documents, with the share of pairs a document
  mask keeps, ``1 / n``, as the ideal (``scaling.DocumentSparsity``);
* ``packed.png``: packed documents (8 of 512, 16 of 256, 4 of 1024 in 4096) through each
  way of expressing them over the same documents as a batch, forward and VJP
  (``documents.PackedDocuments``);
* ``small.png``: our NumPy call over torch's CPU kernel at small and medium shapes, one set
  of bars per machine, with the share of the call that planning takes in the table
  (``small_shapes.SmallShapes``).

Each comes with a snippet ``generated/snippets/performance_<figure>.md``: the image, a
table of the numbers drawn and a caption naming the machine (CPU, cores), the libraries'
versions and the commit measured; or a sentence saying no results are committed yet. Every
ratio is ours / the peer's: lower is better.
"""

from __future__ import annotations

import ast
import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCALING = "scaling.TorchScaling.track_{}_ratio"
DOCUMENTS = "scaling.DocumentSparsity.track_{}_ratio"
PACKED = "documents.PackedDocuments.track_packed_over_batched"
SMALL = "small_shapes.SmallShapes.track_{}"
ACCURACY = "accuracy.AccuracyVersusTorch.track_error_ratio"
VERSIONS = "scaling.Versions.track_version"

#: The libraries named under a figure, in this order (others asv pinned follow).
LIBRARIES = ("numpy", "torch", "sdpa_array")


@dataclass
class Run:
    """One result file's description: where, when, with what."""

    machine: str
    cpu: str
    cores: str
    commit: str
    date: datetime.datetime
    python: str  # its version, or (a run in an existing environment) its executable
    versions: dict[str, str]

    def caption(self) -> str:
        """The machine, the libraries and the commit, in one sentence."""
        cores = f", {self.cores} CPUs" if self.cores else ""
        libraries = [f"{name} {self.versions[name]}" for name in LIBRARIES if name in self.versions]
        libraries += [
            f"{n} {v}" for n, v in sorted(self.versions.items()) if n not in LIBRARIES and v
        ]
        python = [f"Python {self.python}"] if self.python[:1].isdigit() else []
        return (
            f"machine `{self.machine}` ({self.cpu}{cores}); "
            + ", ".join(python + libraries)
            + f"; commit `{self.commit[:8]}` ({self.date.date()})"
        )


@dataclass
class Measured:
    """One benchmark's values on one machine, from its latest run: parameter tuple -> value
    (``None`` where it was skipped)."""

    run: Run
    values: dict[tuple[str, ...], float | None]


def _param(text: str) -> str:
    """asv's repr of a parameter value as plain text (``"'numpy'"`` -> ``numpy``)."""
    try:
        return str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return text


def _version(number: float) -> str:
    """A version recorded as ``major * 10000 + minor * 100 + patch``, as text."""
    n = int(number)
    return f"{n // 10000}.{n // 100 % 100}.{n % 100}"


def _rows(data: dict[str, Any], name: str) -> dict[tuple[str, ...], float | None] | None:
    """The values of benchmark ``name`` in one result file, by parameter tuple."""
    row = data.get("results", {}).get(name)
    if not isinstance(row, list):
        return None
    columns = data.get("result_columns", ["result", "params"])
    values = row[columns.index("result")]
    params = row[columns.index("params")] if "params" in columns else []
    if values is None:
        return None
    keys: list[tuple[str, ...]] = [()]
    for axis in params:
        keys = [(*key, _param(p)) for key in keys for p in axis]
    return {
        key: (None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v))
        for key, v in zip(keys, values, strict=False)
    }


def _started(data: dict[str, Any], name: str) -> int:
    """When asv started benchmark ``name`` in this file (ms), for the latest run's choice."""
    columns = data.get("result_columns", [])
    row = data["results"][name]
    if "started_at" in columns and isinstance(row, list):
        return int(row[columns.index("started_at")] or 0)
    return int(data.get("date", 0))


def read(results: Path) -> dict[str, list[Measured]]:
    """Benchmark name -> its latest measurement on each machine under ``results``."""
    found: dict[str, list[Measured]] = {}
    folders = sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []
    for folder in folders:
        info = folder / "machine.json"
        described = json.loads(info.read_text()) if info.exists() else {}
        latest: dict[str, tuple[int, Measured]] = {}
        for path in sorted(folder.glob("*.json")):
            if path.name == "machine.json":
                continue
            data = json.loads(path.read_text())
            versions = {k: v for k, v in data.get("requirements", {}).items() if v}
            for (library,), number in (_rows(data, VERSIONS) or {}).items():
                if number is not None:
                    versions[library] = _version(number)
            params = data.get("params", {})
            run = Run(
                machine=folder.name,
                cpu=str(described.get("cpu") or params.get("cpu", "")),
                cores=str(described.get("num_cpu") or params.get("num_cpu", "")),
                commit=data["commit_hash"],
                date=datetime.datetime.fromtimestamp(data["date"] / 1000, tz=datetime.timezone.utc),
                python=str(data.get("python", "")),
                versions={k: v for k, v in versions.items() if k != "setuptools"},
            )
            for name in data.get("results", {}):
                values = _rows(data, name)
                if not values or all(v is None for v in values.values()):
                    continue
                started = _started(data, name)
                if name not in latest or started >= latest[name][0]:
                    latest[name] = (started, Measured(run, values))
        for name, (_, measured) in latest.items():
            found.setdefault(name, []).append(measured)
    return found


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)


def _captions(measured: list[Measured]) -> str:
    runs = {m.run.caption(): None for m in measured}
    return "Measured on " + "; and on ".join(runs) + "."


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def scaling(found: dict[str, list[Measured]], out: Path) -> str | None:
    """The scaling figure and its snippet's text; ``None`` without results."""
    forward = {m.run.machine: m for m in found.get(SCALING.format("forward"), [])}
    backward = {m.run.machine: m for m in found.get(SCALING.format("backward"), [])}
    machines = sorted(set(forward) | set(backward))
    if not machines:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    lengths = sorted(
        {int(key[1]) for m in [*forward.values(), *backward.values()] for key in m.values}
    )
    head = ["machine, device", "pass", *[f"L = {n}" for n in lengths]]
    rows = []
    for machine in machines:
        for label, series, style in (
            ("forward", forward.get(machine), "o-"),
            ("backward", backward.get(machine), "s--"),
        ):
            if series is None:
                continue
            for device in sorted({key[0] for key in series.values}):
                points = [(n, series.values.get((device, str(n)))) for n in lengths]
                drawn = [(n, v) for n, v in points if v is not None]
                if not drawn:
                    continue
                ax.plot(*zip(*drawn, strict=True), style, ms=4, label=f"{label}, {device}")
                rows.append([f"`{machine}`, {device}", label, *[_number(v) for _, v in points]])
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length L = S (B = 1, H = 8, E = 64)")
    ax.set_ylabel("our time / torch's")
    ax.set_title("Time against torch, lower is better (1 = as fast)", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, out)
    measured = [*forward.values(), *backward.values()]
    return _table(head, rows) + "\n" + _captions(measured)


def accuracy(found: dict[str, list[Measured]], out: Path) -> str | None:
    """The accuracy figure and its snippet's text; ``None`` without results."""
    measured = found.get(ACCURACY, [])
    if not measured:
        return None
    plt = _pyplot()
    # rows: backend and dtype; within a row, one marker per case and implementation
    groups: list[tuple[str, str]] = []
    for m in measured:
        for backend, dtype, _, _ in m.values:
            if (backend, dtype) not in groups and any(
                v is not None for k, v in m.values.items() if k[:2] == (backend, dtype)
            ):
                groups.append((backend, dtype))
    cases = list(dict.fromkeys(key[3] for m in measured for key in m.values))
    implementations = list(dict.fromkeys(key[2] for m in measured for key in m.values))
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(groups) * len(measured)))
    markers = "os^vD"
    table = []
    for i, m in enumerate(measured):
        for g, (backend, dtype) in enumerate(groups):
            y = g * len(measured) + i
            row = [f"{backend} {dtype}" + (f", `{m.run.machine}`" if len(measured) > 1 else "")]
            for c, case in enumerate(cases):
                values = [m.values.get((backend, dtype, impl, case)) for impl in implementations]
                shown = [v for v in values if v is not None]
                row.append(" / ".join(_number(v) for v in values))
                if shown:
                    ax.plot(
                        shown,
                        [y + (c - (len(cases) - 1) / 2) * 0.6 / len(cases)] * len(shown),
                        markers[c % len(markers)],
                        color=f"C{c}",
                        ms=5,
                        label=case if (g, i) == (0, 0) else None,
                    )
            table.append(row)
    labels = [
        f"{b} {d}" + (f" ({m.run.machine})" if len(measured) > 1 else "")
        for b, d in groups
        for m in measured
    ]
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xlim(left=0)
    ax.set_xlabel("our error / torch's error (both against the float64 oracle)")
    ax.set_title("Accuracy against torch's CPU kernel, lower is better", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    _save(fig, out)
    head = ["inputs", *[f"{case} ({' / '.join(implementations)})" for case in cases]]
    return _table(head, table) + "\n" + _captions(measured)


def documents(found: dict[str, list[Measured]], out: Path) -> str | None:
    """The document-sparsity figure and its snippet's text; ``None`` without results."""
    kinds = {
        "mask_mod": "`mask_mod=mods.document(doc, doc)`",
        "segment_ids": "`segment_ids=(doc, doc)`",
    }
    series = {kind: found.get(DOCUMENTS.format(kind), []) for kind in kinds}
    measured = [m for ms in series.values() for m in ms]
    if not measured:
        return None
    counts = sorted({int(key[0]) for m in measured for key in m.values})
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    rows = []
    for kind, ms in series.items():
        for m in ms:
            points = [(n, m.values.get((str(n),))) for n in counts]
            drawn = [(n, v) for n, v in points if v is not None]
            label = kind + (f" ({m.run.machine})" if len({x.run.machine for x in ms}) > 1 else "")
            ax.plot(*zip(*drawn, strict=True), "o-", ms=4, label=label)
            rows.append([kinds[kind], f"`{m.run.machine}`", *[_number(v) for _, v in points]])
    ax.plot(counts, [1 / n for n in counts], "k:", lw=1, label="ideal: 1 / documents")
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("documents packed in L = S = 2048 (B = 1, H = 8, E = 64)")
    ax.set_ylabel("time / the unmasked call's")
    ax.set_title("Document masks against sparsity, lower is better", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, out)
    ideal = ["ideal (1 / documents)", "", *[f"{1 / n:.2f}" for n in counts]]
    head = ["call", "machine", *[f"{n} doc." for n in counts]]
    return _table(head, [*rows, ideal]) + "\n" + _captions(measured)


def packed(found: dict[str, list[Measured]], out: Path) -> str | None:
    """The packed-documents figure and its snippet's text; ``None`` without results."""
    measured = found.get(PACKED, [])
    if not measured:
        return None
    m = measured[0]  # the first machine's (one figure per machine would crowd the page)
    layouts = list(dict.fromkeys(key[0] for key in m.values))
    ways = list(dict.fromkeys(key[2] for key in m.values))
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    rows = []
    width = 0.8 / max(len(ways), 1)
    for ax, direction in zip(axes, ("forward", "vjp"), strict=True):
        for i, way in enumerate(ways):
            values = [m.values.get((layout, direction, way)) for layout in layouts]
            xs = [j + i * width for j in range(len(layouts))]
            ax.bar(xs, [v or 0.0 for v in values], width, label=way)
            rows.append([direction, f"`{way}`", *[_number(v) for v in values]])
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        ax.axhline(1.3, color="C3", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layouts))], layouts)
        ax.set_xlabel("documents x tokens, packed in 4096")
        ax.set_title(direction, fontsize=10)
    axes[0].set_ylabel("time / the batched call's")
    axes[0].legend(fontsize=7)
    fig.suptitle("Packed documents against the same documents as a batch, lower is better",
                 fontsize=10)  # fmt: skip
    _save(fig, out)
    head = ["direction", "way", *layouts]
    return _table(head, rows) + "\n" + _captions([m])


def small(found: dict[str, list[Measured]], out: Path) -> str | None:
    """The small-shapes figure and its snippet's text; ``None`` without results."""
    measured = found.get(SMALL.format("over_torch"), [])
    if not measured:
        return None
    planning = {m.run.machine: m for m in found.get(SMALL.format("planning_share"), [])}
    shapes = list(dict.fromkeys(key[0] for m in measured for key in m.values))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(measured)
    rows = []
    for i, m in enumerate(measured):
        values = [m.values.get((shape,)) for shape in shapes]
        xs = [j + i * width for j in range(len(shapes))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=m.run.machine)
        rows.append([f"`{m.run.machine}`", "ours / torch", *[_number(v) for v in values]])
        share = planning.get(m.run.machine)
        if share is not None:
            shares = [share.values.get((shape,)) for shape in shapes]
            texts = ["" if v is None else f"{v:.1%}" for v in shares]
            rows.append([f"`{m.run.machine}`", "planning / call", *texts])
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.axhline(1.6, color="C3", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set_xlabel("B x H x L x E (L = S, NumPy float32)")
    ax.set_ylabel("time / torch's kernel's")
    ax.set_title("Small and medium shapes against torch's CPU kernel, lower is better",
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=7)
    _save(fig, out)
    head = ["machine", "figure", *shapes]
    return _table(head, rows) + "\n" + _captions(measured)


#: Figure name -> (drawing function, its alt text).
FIGURES = {
    "scaling": (scaling, "our time over torch's against the sequence length"),
    "accuracy": (accuracy, "our error over torch's error per case"),
    "documents": (documents, "document-mask time over the unmasked call's against sparsity"),
    "packed": (packed, "packed documents' time over the same documents as a batch"),
    "small": (small, "our time over torch's at small and medium shapes"),
}


def write(results: Path, generated: Path) -> None:
    """Draw every figure into ``generated/performance/`` and write its snippet to
    ``generated/snippets/performance_<figure>.md``."""
    found = read(results)
    for name, (draw, alt) in FIGURES.items():
        image = generated / "performance" / f"{name}.png"
        text = draw(found, image)
        if text is None:
            text = (
                "*No results of this figure's benchmarks are committed yet* (see "
                "{ref}`reproduce` below).\n"
            )
        else:
            text = f"```{{image}} /generated/performance/{name}.png\n:alt: {alt}\n```\n\n{text}\n"
        snippet = generated / "snippets" / f"performance_{name}.md"
        snippet.parent.mkdir(parents=True, exist_ok=True)
        if not snippet.exists() or snippet.read_text(encoding="utf-8") != text:
            snippet.write_text(text, encoding="utf-8")
