"""How much faster a causal call is than the same call without causal.

Usage::

    python asv_benchmarks/studies/causal_balance.py --repeat 7                # L=S=4096
    python asv_benchmarks/studies/causal_balance.py --repeat 3 --length 1024  # a smoke test

NumPy, float32, B=1, H=8, L=S=``--length``, E=64, ``implementation="auto"`` (the blocked
kernel on its thread pool). The non-causal and causal calls run in the same process, one
untimed warm-up round and then ``--repeat`` interleaved rounds
(:func:`sdpa_array.lab.cli.bench.interleaved_times`). Prints each call's median and min-max in
ms and the ratio of the medians (target: at least 1.8x, goal 1.95x; the work halves, so the
limit is about 2x). When torch is installed, torch's own
``torch.nn.functional.scaled_dot_product_attention`` on the same data with
``torch.set_num_threads(--threads)`` is timed for reference, in rounds of its own after
NumPy's; torch is imported only then (torch's OpenMP threads keep spinning for a while after
a call, and NumPy calls run next to them were up to 1.5x slower in a first version of this
script that interleaved all four calls).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np

import sdpa_array
from sdpa_array.lab.cli.bench import interleaved_times


def _row(name: str, times: list[float]) -> str:
    med = statistics.median(times) * 1e3
    return f"{name:<22} {med:8.1f} ms  ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--length", type=int, default=4096, help="L = S (default 4096)")
    parser.add_argument("--heads", type=int, default=8, help="H (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="NumPy block and torch threads")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out")
    args = parser.parse_args(argv)

    sdpa_array.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.length, 64)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    f = sdpa_array.scaled_dot_product_attention
    print(
        f"float32 1x{args.heads}x{args.length}x{args.length}x64, {args.threads} threads, "
        f"{args.repeat} interleaved rounds: median (min-max)"
    )
    times = interleaved_times(
        {
            "numpy non-causal": lambda: f(q, k, v, implementation="auto"),
            "numpy causal": lambda: f(q, k, v, is_causal=True, implementation="auto"),
        },
        lambda _: None,
        args.repeat,
    )
    for name, ts in times.items():
        print(_row(name, ts), flush=True)
    torch: Any = None
    if not args.no_torch:  # imported after NumPy's rounds: loading it slowed them down
        try:
            import torch
        except ImportError:
            print("torch is not installed: no reference ratio")
    if torch is not None:
        torch.set_num_threads(args.threads)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        torch_times = interleaved_times(
            {
                "torch non-causal": lambda: sdpa(tq, tk, tv),
                "torch causal": lambda: sdpa(tq, tk, tv, is_causal=True),
            },
            lambda _: None,
            args.repeat,
        )
        for name, ts in torch_times.items():
            print(_row(name, ts))
        times.update(torch_times)
    for lib in ("numpy", "torch"):
        if f"{lib} causal" in times:
            n = statistics.median(times[f"{lib} non-causal"])
            c = statistics.median(times[f"{lib} causal"])
            per_round = [
                a / b
                for a, b in zip(times[f"{lib} non-causal"], times[f"{lib} causal"], strict=True)
            ]
            print(
                f"{lib}: causal is {n / c:.2f}x faster than non-causal "
                f"(per round {min(per_round):.2f}-{max(per_round):.2f})"
            )


if __name__ == "__main__":
    main()
