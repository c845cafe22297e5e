"""``python -m sdpa_array gpu-check --out DIR``: verify and measure every GPU path at once.

One command for a GPU machine lent for a few minutes, without nox or asv: it

* prints the device, its driver, the CUDA runtimes and the libraries' versions;
* runs the GPU test selections (torch on CUDA and CuPy, the Triton kernels compiled, JAX on
  a GPU, each where installed) as pytest subprocesses, each within its time budget, with
  ``-p no:benchmark -p no:cacheprovider``, a few pytest-xdist workers and a junit XML file;
* measures each figure of the GPU targets against its peer in the same process: the peer
  and ours interleaved, ``rounds`` rounds of ``reps`` queued calls each after a warm-up,
  synchronised before the clock stops; medians and the min-max of the per-round ratios;
* counts the kernel launches and host synchronisations of one call per path
  (``torch.profiler``);
* writes the figures as asv results (asv's results format, for a machine named after the
  GPU, under the benchmark names of ``asv_benchmarks/benchmarks/gpu.py`` where they exist)
  and a Markdown table.

Every section ends ``pass``, ``fail``, ``skip`` (with its reason) or ``cut`` (it ran out of
its budget and was stopped); a failure never stops the later sections. Everything lands in
four files under ``DIR``: ``summary.md`` (the tables), ``log.txt`` (everything printed),
``results.json`` (the same, machine-readable) and ``gpu-check.tar.gz`` (junit XML, each
section's log, the asv results folder). The exit status is 0 when no section failed or was
cut and every figure was measured, else 1.

``--cpu-rehearsal`` runs the same sections on the CPU (tiny shapes, torch on the CPU,
Triton's interpreter, a small test selection) in well under three minutes, so that the
command cannot break unnoticed between loans of a GPU; its figures show that the
measurement runs, not how fast anything is.

Examples
--------
``python -m sdpa_array gpu-check --out gpu-out`` (on an NVIDIA machine, from a checkout),
``python -m sdpa_array gpu-check --cpu-rehearsal --out /tmp/rehearsal``,
``python -m sdpa_array gpu-check --out gpu-out --commit $(git rev-parse HEAD)
--budget tests-torch-cuda=120``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from .figures import FIGURES, cases, paired_ratios, run_figures
from .launches import run_profile
from .results import figure_table, write_asv_results
from .sections import Report, Section, child_section, machine_name, read_jsonl, run_pytest, versions
from .setup import CPU_SETUP, GPU_SETUP, ROOT, Setup

__all__ = [
    "CPU_SETUP",
    "FIGURES",
    "GPU_SETUP",
    "Setup",
    "main",
    "paired_ratios",
    "write_asv_results",
]


def _commit(given: str | None) -> str:
    if given:
        return given
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and len(out.stdout.strip()) == 40:
            return out.stdout.strip()
    return "0" * 40


def parse_budgets(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, float]:
    budgets: dict[str, float] = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            parser.error(f"--budget takes SECTION=SECONDS, got {item!r}")
        if budgets[name] <= 0:
            parser.error(f"--budget {name}: the seconds must be positive, got {seconds}")
    return budgets


def main(argv: list[str] | None = None) -> int:
    """Run every section; see the module's docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m sdpa_array gpu-check",
        description="Verify and measure every GPU path: versions, GPU tests, figures "
        "against their peers (asv results, Markdown), launches and syncs per call.",
    )
    parser.add_argument("--out", required=True, help="folder for the (at most 4) result files")
    parser.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="the same sections on the CPU: tiny shapes, torch CPU, Triton's interpreter",
    )
    parser.add_argument("--commit", help="commit hash for the asv results (default: git's)")
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="SECTION=SECONDS",
        help="replace a section's time budget (sections: the test selections' names, "
        "figures, profile)",
    )
    parser.add_argument("--skip", action="append", default=[], help="sections not to run")
    parser.add_argument("--child", choices=("figures", "profile"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = CPU_SETUP if args.cpu_rehearsal else GPU_SETUP
    out = Path(args.out)
    if args.child:
        out.mkdir(parents=True, exist_ok=True)
        return (run_figures if args.child == "figures" else run_profile)(setup, out)
    budgets = parse_budgets(parser, args.budget)
    if not args.cpu_rehearsal and shutil.which("nvidia-smi") is None:
        print(
            "gpu-check: no NVIDIA GPU here (no nvidia-smi); --cpu-rehearsal runs the same "
            "sections on the CPU",
            file=sys.stderr,
        )
        return 2
    return run_all(setup, out, budgets, set(args.skip), _commit(args.commit))


def run_all(setup: Setup, out: Path, budgets: dict[str, float], skip: set[str], commit: str) -> int:
    """Every section in order, then the files; the exit status."""
    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "gpu-check"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    report = Report()
    mode = "CPU rehearsal" if setup.rehearsal else "GPU"
    report.say(f"# gpu-check ({mode}), commit {commit[:12]}")
    info = versions(setup)
    machine = machine_name(info, setup.rehearsal)
    report.say(
        f"machine {machine}: " + json.dumps({k: v for k, v in info.items() if k != "libraries"})
    )
    report.say("libraries: " + ", ".join(f"{k} {v}" for k, v in info["libraries"].items()))
    sections: list[Section] = []

    def end(section: Section) -> None:
        sections.append(section)
        report.say(
            f"== {section.name}: {section.status.upper()} ({section.seconds:.0f} s) "
            f"{section.detail}"
        )

    for selection in setup.selections:
        selection = dataclasses.replace(
            selection, budget=budgets.get(selection.name, selection.budget)
        )
        report.say(f"== {selection.name} (budget {selection.budget:.0f} s)")
        if selection.name in skip:
            end(Section(selection.name, "skip", 0.0, "--skip"))
            continue
        end(run_pytest(selection, setup, work, report))
    for kind, budget in (("figures", setup.figures_budget), ("profile", setup.profile_budget)):
        budget = budgets.get(kind, budget)
        report.say(f"== {kind} (budget {budget:.0f} s)")
        if kind in skip:
            end(Section(kind, "skip", 0.0, "--skip"))
            continue
        end(child_section(kind, setup, work, budget, report))
    figures = read_jsonl(work / "figures.jsonl")
    planned = cases(setup)
    if "figures" not in skip:
        for figure, backend_id, dtype, shape in planned[len(figures) :]:
            reason = "the figures section was cut before it" if figures is not None else ""
            figures.append(
                {"figure": figure, "backend": backend_id, "dtype": dtype, "shape": shape}
                | {"status": "cut", "reason": reason}
            )
    profile = read_jsonl(work / "profile.jsonl")
    asv_file = write_asv_results(figures, work / "asv" / "results", machine, info, commit)
    report.say(f"asv results: {asv_file.relative_to(work)}")
    summary = summarize(setup, info, machine, commit, sections, figures, profile)
    total = time.perf_counter() - began
    summary.append(f"\nTotal {total:.0f} s.")
    for line in summary:
        report.say(line)
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    (out / "log.txt").write_text("\n".join(report.lines) + "\n")
    document = {
        "machine": machine,
        "commit": commit,
        "versions": info,
        "sections": [dataclasses.asdict(s) for s in sections],
        "figures": figures,
        "profile": profile,
        "seconds": total,
    }
    (out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    with tarfile.open(out / "gpu-check.tar.gz", "w:gz") as archive:
        archive.add(work, arcname="gpu-check")
    shutil.rmtree(work)
    failed = [s for s in sections if s.status in ("fail", "cut")]
    unmeasured = [r for r in figures if r.get("status") in ("error", "cut")]
    return 1 if failed or unmeasured else 0


def summarize(
    setup: Setup,
    info: dict[str, Any],
    machine: str,
    commit: str,
    sections: list[Section],
    figures: list[dict[str, Any]],
    profile: list[dict[str, Any]],
) -> list[str]:
    """The Markdown summary: versions, sections, figures, profile."""
    mode = "CPU rehearsal (timings show that the measurement runs, not speed)"
    lines = [
        f"# gpu-check on {machine} ({mode if setup.rehearsal else 'GPU'})",
        "",
        f"commit {commit}; {info.get('device')}, driver {info.get('driver', '-')}, "
        f"torch CUDA {info.get('torch CUDA', '-')}, Python {info.get('python')}",
        "",
        "libraries: " + ", ".join(f"{k} {v}" for k, v in info["libraries"].items()),
        "",
        "## Sections",
        "",
        "| section | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.detail} |" for s in sections]
    lines += [
        "",
        f"## Figures ({setup.rounds} interleaved rounds of {setup.reps} queued calls after a "
        "warm-up; medians, min-max of the per-round ratios)",
        "",
        *figure_table(figures, setup.rehearsal),
        "",
        "## Kernel launches and host synchronisations of one call",
        "",
        "| path | shape | launches | host syncs | profiler events | wall ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in profile:
        if row.get("status") == "ok":
            lines.append(
                f"| {row['path']} | {row['shape']} | {row['launches']} | {row['syncs']} | "
                f"{row['events']} | {row['wall_ms']:.2f} |"
            )
        else:
            reason = str(row.get("reason", ""))[:120].replace("|", "/")
            lines.append(
                f"| {row['path']} | {row.get('shape', '')} | {row['status']}: {reason} | | | |"
            )
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
