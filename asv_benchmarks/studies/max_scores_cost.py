"""What ``return_max_scores=True`` costs against the same call without it.

NumPy, float32, B=1, H=8, L=S=4096, E=64 by default (``--length`` changes L=S), the
blocked implementation: the same call with and without the maximum scores, plain and with
a bias (where the scaled products are kept beside the scores); rounds interleave the two
(alternating which goes first); the table gives each median with its min-max and the ratio
with / without (target: at most 1.05 for the plain call)::

    python asv_benchmarks/studies/max_scores_cost.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import sdpa_array


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--length", type=int, default=4096)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (1, 8, args.length, 64)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    bias = rng.standard_normal((args.length, args.length), dtype=np.float32)
    variants = {"plain": {}, "bias": {"bias": bias}, "causal": {"is_causal": True}}
    cases = {}
    for name, options in variants.items():
        for wanted in (False, True):
            cases[(name, wanted)] = lambda o=options, w=wanted: (
                sdpa_array.scaled_dot_product_attention(
                    q, k, v, implementation="blocked", return_max_scores=w, **o
                )
            )
    times: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    for fn in cases.values():
        fn()
    for r in range(args.rounds):
        for name in variants:
            for wanted in (False, True)[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                cases[(name, wanted)]()
                times[(name, wanted)].append(time.perf_counter() - t0)
    print(
        f"NumPy {np.__version__}, float32, blocked, (B, H, L, E) = {shape}, "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    for name in variants:
        a, b = times[(name, False)], times[(name, True)]
        print(
            f"{name:7s} without {statistics.median(a) * 1e3:8.1f} ms "
            f"({min(a) * 1e3:.1f}-{max(a) * 1e3:.1f})  "
            f"with {statistics.median(b) * 1e3:8.1f} ms "
            f"({min(b) * 1e3:.1f}-{max(b) * 1e3:.1f})  with/without "
            f"{statistics.median(b) / statistics.median(a):.3f}"
        )


if __name__ == "__main__":
    main()
