"""Eager JAX calls against the same call under ``jax.jit``, and against running op by op.

The library compiles an eager JAX call whole (``sdpa_array._api.jax_eager``); the
target is an eager call within 2x of the jitted one. For each shape and implementation the
script times, interleaved over ``--rounds`` rounds (median, min-max): the eager call, the
same call under the caller's own ``jax.jit``, and the eager call with
``SDPA_ARRAY_JAX_EAGER_JIT=0`` (operation by operation, as before). The first eager call's
time (tracing and compiling) is printed too::

    python asv_benchmarks/studies/jax_eager_bench.py
    python asv_benchmarks/studies/jax_eager_bench.py --shapes 1x8x2048x64 --dtype bfloat16

On a GPU, run it with ``JAX_PLATFORMS=cuda``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1x8x512x64", "1x8x2048x64"])
    ap.add_argument("--impls", nargs="+", default=["auto", "blocked", "materialized"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    import jax
    import numpy as np

    import sdpa_array as sa
    from sdpa_array._api.jax_eager import ENVIRONMENT_VARIABLE

    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores")
    for text in args.shapes:
        shape = tuple(int(n) for n in text.split("x"))
        q, k, v = (jax.numpy.asarray(rng.standard_normal(shape), dtype=args.dtype) for _ in "qkv")
        for impl in args.impls:
            run = {"is_causal": args.causal, "implementation": impl}

            def eager(run: dict = run, qkv: tuple = (q, k, v)) -> Any:
                return sa.scaled_dot_product_attention(*qkv, **run)

            jitted = jax.jit(
                lambda a, b, c, run=run: sa.scaled_dot_product_attention(a, b, c, **run)
            )

            def op_by_op(eager: Any = eager) -> Any:
                os.environ[ENVIRONMENT_VARIABLE] = "0"
                try:
                    return eager()
                finally:
                    os.environ[ENVIRONMENT_VARIABLE] = "1"

            start = time.perf_counter()
            eager().block_until_ready()
            first = time.perf_counter() - start
            cases = {
                "eager": eager,
                "jit": lambda j=jitted, qkv=(q, k, v): j(*qkv),
                "op-by-op": op_by_op,
            }
            for fn in cases.values():
                fn().block_until_ready()
            times: dict[str, list[float]] = {name: [] for name in cases}
            for r in range(args.rounds):
                names = list(cases)[r % 3 :] + list(cases)[: r % 3]
                for name in names:
                    start = time.perf_counter()
                    cases[name]().block_until_ready()
                    times[name].append(time.perf_counter() - start)
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            ratios = [e / j for e, j in zip(times["eager"], times["jit"], strict=True)]
            print(
                f"{text} {args.dtype} {impl:12s} eager {med['eager']:8.2f} ms  jit "
                f"{med['jit']:8.2f} ms  eager/jit {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f})  op-by-op {med['op-by-op']:8.1f} ms  "
                f"first call {first * 1e3:.0f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
