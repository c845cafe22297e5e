"""What sinks and dropout cost on the blocked NumPy path, against their targets.

Usage::

    python asv_benchmarks/studies/sinks_dropout_cost.py --repeat 7
    python asv_benchmarks/studies/sinks_dropout_cost.py --repeat 5 --vjp --threads 1

Times ``implementation="blocked"`` at float32, B=1, H=8, L=S=4096, E=64 without extras,
with ``dropout_p=0.1`` and with one sink per head: one warm-up round, then the three cases
interleaved round by round; each row gives the median, its ratio to the plain median and
every round's time. ``--vjp`` times ``scaled_dot_product_attention_vjp`` (no saved forward)
instead of the forward. Targets: dropout at most 1.5x, sinks at most 5% over plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import sdpa_array


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--vjp", action="store_true")
    args = parser.parse_args()
    if args.threads is not None:
        sdpa_array.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shape = (1, 8, args.length, 64)
    q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    cases = {
        "plain": {},
        "dropout 0.1": {"dropout_p": 0.1, "dropout_seed": 1},
        "sinks": {"sinks": rng.standard_normal(8).astype(np.float32)},
    }

    def run(options: dict) -> None:
        if args.vjp:
            sdpa_array.scaled_dot_product_attention_vjp(
                q, k, v, g, implementation="blocked", **options
            )
        else:
            sdpa_array.scaled_dot_product_attention(q, k, v, implementation="blocked", **options)

    for options in cases.values():
        run(options)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, options in cases.items():
            start = time.perf_counter()
            run(options)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    what = "VJP" if args.vjp else "forward"
    threads = sdpa_array.get_num_threads()
    print(f"blocked NumPy {what}, 1x8x{args.length}^2x64 float32, {threads} threads")
    for name, ts in times.items():
        median = statistics.median(ts)
        rounds = ", ".join(f"{t:.3f}" for t in ts)
        print(f"{name:12s} median {median:.3f} s  x{median / base:.2f}  rounds [{rounds}]")


if __name__ == "__main__":
    main()
