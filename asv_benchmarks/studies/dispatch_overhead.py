"""What ``implementation="auto"`` costs on top of torch's own kernel when it delegates.

torch CPU, float32, self-attention at three sizes: ``sdpa_array.scaled_dot_product_attention``
(which validates, plans and hands the call to ``torch.nn.functional.scaled_dot_product_attention``)
and torch's function called directly, interleaved call by call; the table gives each median
with its min-max, the difference (our validation and planning per call) and torch / ours::

    python asv_benchmarks/studies/dispatch_overhead.py --calls 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import sdpa_array

SHAPES = [(1, 8, 16, 64), (1, 8, 128, 64), (4, 16, 1024, 64)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        "float32, medians (min-max)"
    )
    for shape in SHAPES:
        q = torch.randn(shape)

        def ours(q: torch.Tensor = q) -> object:
            return sdpa_array.scaled_dot_product_attention(q, q, q)

        def theirs(q: torch.Tensor = q) -> object:
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

        assert sdpa_array.explain(q, q, q).forward == "native"
        for _ in range(10):
            ours()
            theirs()
        calls = args.calls if shape[2] < 1024 else max(5, args.calls // 40)
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        for i in range(calls):
            for name, fn in (("ours", ours), ("torch", theirs))[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[n]) for n in ("ours", "torch"))
        spread = {n: (min(t) * 1e6, max(t) * 1e6) for n, t in times.items()}
        print(
            f"{shape}: ours {a * 1e6:9.1f} us ({spread['ours'][0]:.0f}-{spread['ours'][1]:.0f})"
            f"  torch {b * 1e6:9.1f} us ({spread['torch'][0]:.0f}-{spread['torch'][1]:.0f})"
            f"  overhead {(a - b) * 1e6:7.1f} us  torch/ours {b / a:.3f}"
        )


if __name__ == "__main__":
    main()
