"""Kernel launches and host synchronisations of one call per path (``torch.profiler``),
counted in the child process of ``gpu-check``."""

from __future__ import annotations

import functools
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .figures import configured_backend, random_inputs
from .sections import load_module
from .setup import Setup

#: Profiler events that launch a kernel, and those that wait for the device.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNC_MARKS = ("Synchronize",)


def profile_paths(setup: Setup) -> list[tuple[str, Callable[[], Any], Any]]:
    """``(path, one call, backend)`` for each path the profile counts."""
    sa = load_module("sdpa_array")

    paths: list[tuple[str, Callable[[], Any], Any]] = []
    dtype = "float16" if not setup.rehearsal else "float32"
    torch_b = configured_backend(setup.torch_backend, dtype)
    q, k, v, g = random_inputs(torch_b, setup.profile_shape + "-causal", dtype, count=4)
    out, lse = sa.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    attention, vjp = sa.scaled_dot_product_attention, sa.scaled_dot_product_attention_vjp
    for impl in ("auto", "triton", "blocked"):
        call = functools.partial(attention, q, k, v, is_causal=True, implementation=impl)
        paths.append((f"torch forward {impl}", call, torch_b))
    paths.append(("torch VJP auto", lambda: vjp(q, k, v, g, is_causal=True), torch_b))
    paths.append(
        (
            "torch VJP auto given out, lse",
            lambda: vjp(q, k, v, g, is_causal=True, out=out, lse=lse),
            torch_b,
        )
    )
    try:
        cupy_b = configured_backend(setup.cupy_backend, dtype)
        cq, ck, cv = (cupy_b.asarray(torch_b_to_numpy(x), dtype) for x in (q, k, v))
        paths.append(("cupy forward auto", lambda: attention(cq, ck, cv, is_causal=True), cupy_b))
    except NotImplementedError:
        pass
    return paths


def _first(result: Any) -> Any:
    """The array to synchronise on: the first of a tuple of results (gradients)."""
    return result[0] if isinstance(result, tuple) else result


def torch_b_to_numpy(x: Any) -> Any:
    return x.detach().float().cpu().numpy()


def run_profile(setup: Setup, work: Path) -> int:
    """The child process of the profile section: per path, the kernel launches, host
    synchronisations and profiler events of one warmed-up call."""
    torch = load_module("torch")
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with (work / "profile.jsonl").open("w") as sink:
        try:
            paths = profile_paths(setup)
        except Exception as exc:
            failed = {"path": "setup", "status": "error", "reason": f"{type(exc).__name__}: {exc}"}
            sink.write(json.dumps(failed) + "\n")
            traceback.print_exc()
            return 1
        for name, call, backend in paths:
            row: dict[str, Any] = {"path": name, "shape": setup.profile_shape + "-causal"}
            try:
                backend.synchronize(_first(call()))
                with profile(activities=activities) as prof:
                    start = time.perf_counter()
                    backend.synchronize(_first(call()))
                    row["wall_ms"] = (time.perf_counter() - start) * 1e3
                events = prof.key_averages()
                row["launches"] = sum(e.count for e in events if e.key in LAUNCH_EVENTS)
                row["syncs"] = sum(
                    e.count
                    for e in events
                    if any(m in e.key for m in SYNC_MARKS)
                    or ("cudaMemcpy" in e.key and "Async" not in e.key)
                )
                row["events"] = sum(e.count for e in events)
                row["status"] = "ok"
            except Exception as exc:
                from .... import CannotDelegateError, CannotUseTritonError

                skip = isinstance(exc, (CannotDelegateError, CannotUseTritonError))
                row.update(
                    status="skip" if skip else "error", reason=f"{type(exc).__name__}: {exc}"
                )
            print(f"  {name:32s} {_profile_text(row)}", flush=True)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
    return 0


def _profile_text(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason', '')[:160]}"
    return (
        f"{row['launches']} kernel launches, {row['syncs']} host syncs, "
        f"{row['events']} profiler events, {row['wall_ms']:.2f} ms"
    )
