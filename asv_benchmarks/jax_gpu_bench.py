"""JAX on the GPU: sdpa_array against ``jax.nn.dot_product_attention`` (issue 29's figures).

For each shape, dtype and causality the script times, interleaved over ``--rounds`` rounds
(median and min-max of the ratios), every call under ``jax.jit``:

- the peer, ``jax.nn.dot_product_attention(implementation="cudnn")`` (``xla`` beside it);
- this library's ``auto``, ``native``, ``materialized`` and ``blocked``;
- the GEMM-bound limit: the two bare products ``Q Kᵀ`` and ``P V`` of the same shapes and
  dtype, scores written to memory, no softmax;
- this library's ``auto`` called eagerly (no caller ``jit``; the library compiles it whole).

Each row: milliseconds, TFLOP/s (``4·B·H·L·S·E``, half when causal), the ratio to cuDNN
(issue 29: ``auto`` ≥ 0.9) and the fraction of the GEMM bound (``materialized`` and
``blocked`` ≥ 0.5)::

    JAX_PLATFORMS=cuda python asv_benchmarks/jax_gpu_bench.py
    python asv_benchmarks/jax_gpu_bench.py --shapes 1x2x256x64 --dtypes float32 --rounds 2

On a CPU the cuDNN row fails and the ratios are given against ``xla`` instead (a check that
the script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def _timer(fn: Callable[[], Any], reps: int) -> float:
    import jax

    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        res = fn()
    jax.block_until_ready(res)
    return (time.perf_counter() - t0) / reps


def _calls(q: Any, k: Any, v: Any, causal: bool) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    import sdpa_array as sa

    qt, kt, vt = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # BTNH for jax.nn
    calls: dict[str, Callable[[], Any]] = {}
    for impl in ("cudnn", "xla"):
        f = jax.jit(
            lambda a, b, c, impl=impl: jax.nn.dot_product_attention(
                a, b, c, is_causal=causal, implementation=impl
            )
        )
        calls[f"jax.nn {impl}"] = lambda f=f: f(qt, kt, vt)
    for impl in ("auto", "native", "materialized", "blocked"):
        g = jax.jit(
            lambda a, b, c, impl=impl: sa.scaled_dot_product_attention(
                a, b, c, is_causal=causal, implementation=impl
            )
        )
        calls[f"ours {impl} jit"] = lambda g=g: g(q, k, v)
    bare = jax.jit(lambda a, b, c: (a @ jnp.swapaxes(b, -1, -2)) @ c)
    calls["bare products jit"] = lambda: bare(q, k, v)
    calls["ours auto eager"] = lambda: sa.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1x8x2048x64", "4x16x4096x128"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    machine = {"jax": jax.__version__, "device": dev.device_kind, "platform": dev.platform}
    print(json.dumps(machine), flush=True)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        B, H, L, E = (int(n) for n in shape.split("x"))
        for dtype in args.dtypes:
            keys = jax.random.split(jax.random.key(0), 3)
            q, k, v = (jax.random.normal(kk, (B, H, L, E), getattr(jnp, dtype)) for kk in keys)
            for causal in (False, True):
                tag = f"{shape} {dtype} {'causal' if causal else 'full'}"
                fl = 4.0 * B * H * L * L * E * (0.5 if causal else 1.0)
                calls = _calls(q, k, v, causal)
                times: dict[str, list[float]] = {name: [] for name in calls}
                failed: dict[str, str] = {}
                for _ in range(args.rounds):
                    for name, fn in calls.items():
                        if name in failed:
                            continue
                        try:
                            times[name].append(_timer(fn, args.reps))
                        except Exception as exc:  # one failing call must not hide the rest
                            failed[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                peer = "jax.nn cudnn" if "jax.nn cudnn" not in failed else "jax.nn xla"
                for name, ts in times.items():
                    if name in failed:
                        print(f"{tag:36s} {name:22s} FAILED {failed[name]}", flush=True)
                        rows.append({"case": tag, "call": name, "error": failed[name]})
                        continue
                    ratios = [p / t for p, t in zip(times[peer], ts, strict=True)]
                    gemm = [b / t for b, t in zip(times["bare products jit"], ts, strict=True)]
                    med = statistics.median(ts)
                    row = {
                        "case": tag,
                        "call": name,
                        "ms": med * 1e3,
                        "tflops": fl / med / 1e12,
                        "vs": peer,
                        "ratio": statistics.median(ratios),
                        "ratio_spread": [min(ratios), max(ratios)],
                        "gemm_bound_fraction": statistics.median(gemm),
                    }
                    rows.append(row)
                    print(
                        f"{tag:36s} {name:22s} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
                        f"  / {peer} {row['ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                        f"  gemm-bound {row['gemm_bound_fraction']:.3f}",
                        flush=True,
                    )
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
