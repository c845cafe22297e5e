"""What ``layout="BLHE"`` costs against the default layout on the same data.

NumPy, float32, B=1, H=8, L=S=2048, E=64 (and the caller's ``--length``): the same values
held as (B, H, L, E) and as (B, L, H, E), each called in its own layout, forward and VJP,
``materialized`` and ``blocked``; rounds interleave the two layouts (alternating which goes
first); the table gives each median with its min-max and the ratio BLHE / BHLE::

    python asv_benchmarks/studies/layout_cost.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import sdpa_array


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--length", type=int, default=2048)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (1, 8, args.length, 64)
    heads_first = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]
    length_first = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in heads_first]
    layouts = {"BHLE": heads_first, "BLHE": length_first}
    cases = {}
    for impl in ("materialized", "blocked"):
        for layout, (q, k, v, g) in layouts.items():
            cases[("forward", impl, layout)] = lambda q=q, k=k, v=v, i=impl, lay=layout: (
                sdpa_array.scaled_dot_product_attention(q, k, v, implementation=i, layout=lay)
            )
            cases[("vjp", impl, layout)] = lambda q=q, k=k, v=v, g=g, i=impl, lay=layout: (
                sdpa_array.scaled_dot_product_attention_vjp(
                    q, k, v, g, implementation=i, layout=lay
                )
            )
    times: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
    for fn in cases.values():
        fn()
    for r in range(args.rounds):
        keys = list(cases)
        for i in range(0, len(keys), 2):
            pair = keys[i : i + 2][:: 1 if r % 2 == 0 else -1]
            for key in pair:
                t0 = time.perf_counter()
                cases[key]()
                times[key].append(time.perf_counter() - t0)
    print(f"NumPy {np.__version__}, float32, shape (B, H, L, E) = {shape}, {args.rounds} rounds")
    for call in ("forward", "vjp"):
        for impl in ("materialized", "blocked"):
            a, b = times[(call, impl, "BHLE")], times[(call, impl, "BLHE")]
            print(
                f"{call:8s} {impl:12s} BHLE {statistics.median(a) * 1e3:7.1f} ms "
                f"({min(a) * 1e3:.1f}-{max(a) * 1e3:.1f})  "
                f"BLHE {statistics.median(b) * 1e3:7.1f} ms "
                f"({min(b) * 1e3:.1f}-{max(b) * 1e3:.1f})  BLHE/BHLE "
                f"{statistics.median(b) / statistics.median(a):.3f}"
            )


if __name__ == "__main__":
    main()
