"""What the scores in chunks cost the calls whose scores may be large.

NumPy, float32, B=1, H=8, E=64: the blocked forward at L=S=4096 (plain and causal) and the
blocked VJP at L=S=2048, with ``q`` and ``k`` times 31.6 (logits ~1e3, where the kernels cut
the scores' contraction, ``sdpa_array._arrays.products.score_chunks``), each timed with the
chunks and with one product (the same function made to return 1 between calls); plus the
forward at unit logits with a bias (the score bound is read, one product is kept). Rounds
interleave the two (alternating which goes first); the table gives each median with its
min-max and the median of the per-round ratios chunks / one::

    python asv_benchmarks/studies/score_chunks_cost.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import sdpa_array
from sdpa_array._arrays import products

LARGE = 31.6


def cases(length: int, vjp_length: int) -> dict[str, Callable[[], Any]]:
    """The timed calls, by name."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, length, 64), dtype=np.float32) for _ in range(3))
    bias = rng.standard_normal((length, length), dtype=np.float32)
    g = [rng.standard_normal((1, 8, vjp_length, 64), dtype=np.float32) for _ in range(4)]
    attend = sdpa_array.scaled_dot_product_attention
    return {
        f"forward {length}, logits ~1e3": lambda: attend(q * LARGE, k * LARGE, v),
        f"forward {length} causal, logits ~1e3": lambda: attend(
            q * LARGE, k * LARGE, v, is_causal=True
        ),
        f"VJP {vjp_length}, logits ~1e3": lambda: sdpa_array.scaled_dot_product_attention_vjp(
            g[0] * LARGE, g[1] * LARGE, g[2], g[3]
        ),
        f"forward {length} with a bias, unit logits": lambda: attend(q, k, v, bias=bias),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--vjp-length", type=int, default=2048)
    args = ap.parse_args()
    chunked = products.score_chunks
    modes: dict[str, Callable[..., int]] = {"chunks": chunked, "one": lambda xp, features: 1}
    calls = cases(args.length, args.vjp_length)
    times: dict[tuple[str, str], list[float]] = {(c, m): [] for c in calls for m in modes}
    try:
        for fn in calls.values():
            fn()  # warm-up
        for r in range(args.rounds):
            for name, fn in calls.items():
                for mode in list(modes)[:: 1 if r % 2 else -1]:
                    products.score_chunks = modes[mode]
                    start = time.perf_counter()
                    fn()
                    times[name, mode].append(time.perf_counter() - start)
    finally:
        products.score_chunks = chunked
    print(f"{os.cpu_count()} CPUs, NumPy {np.__version__}, {args.rounds} interleaved rounds\n")
    print("| call | chunks, ms | one product, ms | chunks / one |")
    print("|---|---|---|---|")
    for name in calls:
        a, b = np.array(times[name, "chunks"]), np.array(times[name, "one"])
        ratio = a / b
        print(
            f"| {name} | {np.median(a) * 1e3:.1f} ({a.min() * 1e3:.1f}-{a.max() * 1e3:.1f}) "
            f"| {np.median(b) * 1e3:.1f} ({b.min() * 1e3:.1f}-{b.max() * 1e3:.1f}) "
            f"| {np.median(ratio):.3f} ({ratio.min():.3f}-{ratio.max():.3f}) |"
        )


if __name__ == "__main__":
    main()
