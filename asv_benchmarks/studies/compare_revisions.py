"""Compare two source trees of sdpa_array on NumPy, interleaved, in fresh processes.

Usage::

    git worktree add /tmp/old <revision>
    python asv_benchmarks/studies/compare_revisions.py /tmp/old . --rounds 5

Each round runs one process per tree (alternating), each timing the forward and the VJP
(plain and causal) at B=1, H=8, L=S=2048, E=64, float32 as the median of a few calls after a
warm-up; the table gives, per tree and case, the median over rounds and the min-max spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = ("forward", "causal forward", "vjp", "causal vjp")

WORKER = r"""
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import sdpa_array as s
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((1, 8, 2048, 64), dtype=np.float32) for _ in range(4))
def median_time(f, n):
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); times.append(time.perf_counter() - t0)
    return statistics.median(times)
print(json.dumps([
    median_time(lambda: s.scaled_dot_product_attention(q, k, v), 5),
    median_time(lambda: s.scaled_dot_product_attention(q, k, v, is_causal=True), 5),
    median_time(lambda: s.scaled_dot_product_attention_vjp(q, k, v, g), 3),
    median_time(lambda: s.scaled_dot_product_attention_vjp(q, k, v, g, is_causal=True), 3),
]))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="source tree of the first revision")
    parser.add_argument("new", help="source tree of the second revision")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[list[float]]] = {args.old: [], args.new: []}
    for _ in range(args.rounds):
        for tree in (args.old, args.new):
            out = subprocess.run(
                [sys.executable, "-c", WORKER, tree], check=True, capture_output=True, text=True
            )
            times[tree].append(json.loads(out.stdout))
    print(f"{'case':<16}" + "".join(f"{t[-30:]:>34}" for t in times))
    for i, case in enumerate(CASES):
        cells = []
        for runs in times.values():
            xs = [r[i] * 1e3 for r in runs]
            cells.append(f"{statistics.median(xs):8.1f} ms ({min(xs):.0f}-{max(xs):.0f})")
        print(f"{case:<16}" + "".join(f"{c:>34}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
