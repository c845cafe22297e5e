"""The results of ``gpu-check``: asv result files and the Markdown table of the figures."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from .figures import FIGURES, paired_ratios


#: figure -> (asv benchmark names, the value each records from a row).
def asv_values(row: dict[str, Any]) -> dict[str, tuple[tuple[str, ...], float]]:
    """The asv benchmarks a measured row fills: name -> (params, value). The names of
    ``asv_benchmarks/benchmarks/gpu.py`` where it has the figure (its ratios are speed
    ratios, peer time / our time), ``gpu.GPUCheck.*`` (time ratios, ours / peer) where not."""
    figure, backend, dtype, shape = (row[k] for k in ("figure", "backend", "dtype", "shape"))
    ours, peer = statistics.median(row["ours"]), statistics.median(row["peer"])
    values: dict[str, tuple[tuple[str, ...], float]] = {}
    flops = row.get("flops")
    if figure in ("forward", "triton_forward", "blocked"):
        impl = {"forward": "auto", "triton_forward": "triton", "blocked": "blocked"}[figure]
        params = (backend, impl, dtype, shape)
        if figure == "blocked":
            values["gpu.GPUForward.track_gemm_bound_fraction"] = (params, peer / ours)
        else:
            values["gpu.GPUForward.track_ratio_vs_torch_sdpa"] = (params, peer / ours)
        values["gpu.GPUForward.track_tflops"] = (params, flops / ours / 1e12)
    elif figure in ("vjp_given", "triton_vjp"):
        impl = "auto" if figure == "vjp_given" else "triton"
        plain = statistics.median(row["plain"])
        params = (backend, impl, dtype, shape)
        values["gpu.GPUVJP.track_ratio_vs_torch_sdpa"] = (params, peer / plain)
        values["gpu.GPUVJP.track_tflops"] = (params, flops / plain / 1e12)
        values["gpu.GPUCheck.track_vjp_given_out_lse_over_torch"] = (params, ours / peer)
    elif figure == "autograd":
        values["gpu.GPUCheck.track_autograd_backward_over_torch"] = (
            (backend, "auto", dtype, shape),
            ours / peer,
        )
    elif figure == "jax":
        values["gpu.JAXGPUForward.track_ratio_vs_jax_cudnn"] = (
            (backend, "auto", dtype, shape),
            peer / ours,
        )
    elif figure == "decode":
        values["gpu.GPUDecode.track_milliseconds"] = ((backend, dtype, shape), ours * 1e3)
        values["gpu.GPUCheck.track_decode_over_torch_sdpa"] = (
            (backend, "auto", dtype, shape),
            ours / peer,
        )
    elif figure == "accuracy":
        values["gpu.GPUCheck.track_fp16_error_over_torch_sdpa"] = (
            (backend, "auto", dtype, shape),
            ours / peer,
        )
    return values


def write_asv_results(
    rows: list[dict[str, Any]], folder: Path, machine: str, info: dict[str, Any], commit: str
) -> Path:
    """asv's results files (format version 2) under ``folder/<machine>/``: ``machine.json``
    and ``<commit[:8]>-<environment>.json``; benchmark versions are left ``null`` (asv then
    matches results to any version of the benchmark). Returns the results file."""
    libraries = info.get("libraries", {})
    requirements = {
        name: libraries[name]
        for name in ("numpy", "torch", "triton", "cupy-cuda13x", "cupy-cuda12x", "jax")
        if name in libraries
    }
    python = ".".join(platform.python_version_tuple()[:2])
    env_name = "existing-py" + python + "".join(f"-{n}{v}" for n, v in requirements.items())
    machine_info = {
        "arch": platform.machine(),
        "cpu": platform.processor() or platform.machine(),
        "machine": machine,
        "num_cpu": str(os.cpu_count()),
        "os": platform.platform(),
        "ram": "",
        "gpu": str(info.get("device", "")),
        "version": 1,
    }
    target = folder / machine
    target.mkdir(parents=True, exist_ok=True)
    (target / "machine.json").write_text(json.dumps(machine_info, indent=4) + "\n")
    collected: dict[str, dict[tuple[str, ...], float]] = {}
    for row in rows:
        if row.get("status") != "ok":
            continue
        for name, (params, value) in asv_values(row).items():
            collected.setdefault(name, {})[params] = value
    started = int(time.time() * 1000)
    results: dict[str, list[Any]] = {}
    for name, values in sorted(collected.items()):
        axes: list[list[str]] = [[] for _ in next(iter(values))]
        for params in values:
            for axis, param in zip(axes, params, strict=True):
                if param not in axis:
                    axis.append(param)
        grid = _product(axes)
        result = [values.get(params) for params in grid]
        results[name] = [result, [[repr(v) for v in axis] for axis in axes], None, started, 0.0]
    document = {
        "commit_hash": commit,
        "env_name": env_name,
        "date": started,
        "params": {**{k: v for k, v in machine_info.items() if k != "version"}, "python": python}
        | requirements,
        "python": python,
        "requirements": requirements,
        "env_vars": {},
        "result_columns": ["result", "params", "version", "started_at", "duration"],
        "results": results,
        "durations": {},
        "version": 2,
    }
    path = target / f"{commit[:8]}-{env_name}.json"
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    return path


def _product(axes: list[list[str]]) -> list[tuple[str, ...]]:
    grid: list[tuple[str, ...]] = [()]
    for axis in axes:
        grid = [(*g, v) for g in grid for v in axis]
    return grid


def figure_table(rows: list[dict[str, Any]], rehearsal: bool) -> list[str]:
    """The Markdown table of the figures: time ratios ours / peer (lower is better)."""
    lines = [
        "| figure | backend | dtype | shape | ours / peer (min-max) | ours ms | peer ms "
        "| target | meets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        figure = FIGURES[row["figure"]]
        head = f"| {figure.title} | {row['backend']} | {row['dtype']} | {row['shape']} |"
        if row.get("status") != "ok":
            reason = str(row.get("reason", ""))[:120].replace("|", "/")
            lines.append(f"{head} {row.get('status')}: {reason} | | | ≤ {figure.target:g} | |")
            continue
        ratio, low, high = paired_ratios(row["ours"], row["peer"])
        unit = 1.0 if row["figure"] == "accuracy" else 1e3
        ours, peer = (statistics.median(row[k]) * unit for k in ("ours", "peer"))
        meets = "—" if rehearsal else ("yes" if ratio <= figure.target else "no")
        cells = f" {ratio:.3f} ({low:.3f}-{high:.3f}) | {ours:.4g} | {peer:.4g} |"
        lines.append(f"{head}{cells} ≤ {figure.target:g} | {meets} |")
        if "plain" in row:
            plain = paired_ratios(row["plain"], row["peer"])
            lines.append(
                f"| (the same without out and lse) | {row['backend']} | {row['dtype']} | "
                f"{row['shape']} | {plain[0]:.3f} ({plain[1]:.3f}-{plain[2]:.3f}) | "
                f"{statistics.median(row['plain']) * 1e3:.4g} | {peer:.4g} | | |"
            )
    return lines
