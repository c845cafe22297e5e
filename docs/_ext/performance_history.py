"""The performance history, drawn at build time from the committed asv results.

Reads ``asv_benchmarks/results/<machine>/*.json`` (asv's result files, one per commit and
environment) and draws every ``track_`` figure of the history selection
(``history.Ratios``) against the commits' dates, one line per machine, into
``generated/history/ratios.png``; ``generated/snippets/history_machines.md`` lists the
machines (CPU, flags, cores) and the commits measured. Everything is read from files in the
repository: the page renders offline.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

#: The asv benchmarks drawn: the history selection's tracked ratios.
PREFIX = "history.Ratios.track_"

#: Figures drawn, in this order, with their titles (the rest of the prefix's are drawn after).
TITLES = {
    "torch_forward": "NumPy forward / torch's CPU kernel",
    "gemm_bound": "forward / its two products alone",
    "plain_numpy_limit": "forward / a plain NumPy loop",
    "causal": "causal / non-causal forward",
    "causal_over_products": "causal speed-up: the products' own / ours",
    "vjp_torch": "VJP / torch's backward",
    "vjp_products": "VJP / its five products alone",
    "vjp_torch_causal": "causal VJP / torch's causal backward",
    "documents_mask_mod": "8 documents, mask_mod / as a batch",
    "documents_segment_ids": "8 documents, segment_ids / as a batch",
    "documents_varlen": "8 documents, varlen / as a batch",
    "max_scores": "forward with max scores / without",
    "torch_small_overhead": "torch via auto / direct, 1x8x128x64",
    "accuracy": "float32 error / torch's error",
}


@dataclass
class Machine:
    """One asv machine's description and its history: figure -> [(date, commit, value)]."""

    name: str
    cpu: str
    cores: str
    points: dict[str, list[tuple[datetime.datetime, str, float]]] = field(default_factory=dict)


def read_results(results: Path) -> list[Machine]:
    """Every machine under ``results`` with the tracked figures of its result files."""
    machines = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []:
        info = folder / "machine.json"
        described = json.loads(info.read_text()) if info.exists() else {}
        machine = Machine(folder.name, described.get("cpu", ""), described.get("num_cpu", ""))
        for path in sorted(folder.glob("*.json")):
            if path.name == "machine.json":
                continue
            data = json.loads(path.read_text())
            column = data.get("result_columns", ["result"]).index("result")
            date = datetime.datetime.fromtimestamp(data["date"] / 1000, tz=datetime.timezone.utc)
            for name, row in data.get("results", {}).items():
                value = row[column] if isinstance(row, list) else None
                if not name.startswith(PREFIX) or not value or value[0] is None:
                    continue
                figure = name[len(PREFIX) :]
                point = (date, data["commit_hash"][:8], float(value[0]))
                machine.points.setdefault(figure, []).append(point)
        if machine.points:
            machines.append(machine)
    return machines


def draw(machines: list[Machine], out: Path) -> bool:
    """The figures of ``machines`` as one PNG grid at ``out``; ``False`` when there is
    nothing to draw."""
    figures = _ordered(machines)
    if not figures:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    rows = -(-len(figures) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(12, 2.6 * rows), squeeze=False)
    for ax, figure in zip(axes.flat, figures, strict=False):
        for machine in machines:
            points = sorted(machine.points.get(figure, []))
            if points:
                ax.plot(
                    [p[0] for p in points], [p[2] for p in points], "o-", ms=3, label=machine.name
                )
        ax.axhline(1.0, color="0.6", lw=0.8, ls="--")
        ax.set_title(TITLES.get(figure, figure), fontsize=9)
        ax.tick_params(labelsize=7)
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_ylim(bottom=0)
    for ax in list(axes.flat)[len(figures) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        "Tracked ratios over the commits (lower is better; 1 = the peer or limit)", fontsize=10
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def machines_table(machines: list[Machine]) -> str:
    """A MyST table of the machines: name, CPU and flags, cores, commits measured."""
    if not machines:
        return "No results are committed yet: `nox -s bench-history` writes them.\n"
    rows = [
        "| machine | CPU and flags | cores | commits | first | last |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in machines:
        dated = sorted({(p[0], p[1]) for points in m.points.values() for p in points})
        first, last = dated[0][0].date(), dated[-1][0].date()
        rows.append(f"| `{m.name}` | {m.cpu} | {m.cores} | {len(dated)} | {first} | {last} |")
    return "\n".join(rows) + "\n"


def _ordered(machines: list[Machine]) -> list[str]:
    """The figures of ``machines``: :data:`TITLES`' order first, then the others by name."""
    figures = [f for f in TITLES if any(f in m.points for m in machines)]
    return figures + sorted({f for m in machines for f in m.points} - set(figures))


def latest_table(machines: list[Machine]) -> str:
    """A MyST table of each figure's value at each machine's latest measured commit (one
    column per machine, its commit in the header); empty without results."""
    if not machines:
        return ""
    latest = []
    for m in machines:
        when, commit = max((p[0], p[1]) for points in m.points.values() for p in points)
        values = {f: p[2] for f, points in m.points.items() for p in points if p[1] == commit}
        latest.append((m.name, commit, when.date(), values))
    head = "| figure | " + " | ".join(f"`{n}` at `{c}` ({d})" for n, c, d, _ in latest) + " |"
    rows = [head, "| --- |" + " --- |" * len(latest)]
    for figure in _ordered(machines):
        cells = [f"{v[figure]:.2f}" if figure in v else "–" for *_, v in latest]
        rows.append(f"| {TITLES.get(figure, figure)} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def write(results: Path, generated: Path) -> None:
    """Draw the history into ``generated/history/ratios.png`` and write the machines'
    table to ``generated/snippets/history_machines.md``."""
    machines = read_results(results)
    drawn = draw(machines, generated / "history" / "ratios.png")
    text = machines_table(machines)
    if machines:
        text += "\nThe latest figures of each machine:\n\n" + latest_table(machines)
    if drawn:
        text = (
            "```{image} /generated/history/ratios.png\n"
            ":alt: the tracked ratios over the commits\n```\n\n" + text
        )
    snippet = generated / "snippets" / "history_machines.md"
    snippet.parent.mkdir(parents=True, exist_ok=True)
    snippet.write_text(text)
