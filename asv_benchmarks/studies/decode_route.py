"""One decoding step, two routes: the main function with key lengths, or the cache function.

The transformers adapter sends decoding steps (a few queries over a cache) through
:func:`sdpa_array.attention_with_kv_cache` on a CUDA device, where its split-KV Triton
kernel runs, and through :func:`sdpa_array.scaled_dot_product_attention` with
``key_lengths`` elsewhere. This script measures that choice on the machine it runs on: one
query per sequence (B=4, H=8, E=64, float32, torch) over caches of ``S`` tokens, the rows
left-padded by 0, S/8, S/4 and S/2 tokens, causal, as

* ``main``: ``scaled_dot_product_attention(..., key_lengths=S - pad, padding_side="left",
  alignment="bottom_right")`` (on the CPU, torch's flash kernel with a key mask);
* ``cache``: ``attention_with_kv_cache(..., cache_lengths=[S] * B, cache_leftpad=pad)``.

Rounds alternate the two; the table gives medians, min-max and the ratio::

    python asv_benchmarks/studies/decode_route.py --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def _routes(q: Any, k: Any, v: Any, pad: list[int]) -> dict[str, Callable[[], Any]]:
    """The two routes of one decoding step (see the module docstring)."""
    import torch

    import sdpa_array

    B, S = int(q.shape[0]), int(k.shape[2])
    lengths = torch.tensor([S - p for p in pad], device=q.device)

    def main_route() -> Any:
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, is_causal=True, alignment="bottom_right",
            key_lengths=lengths, padding_side="left",
        )  # fmt: skip

    def cache_route() -> Any:
        return sdpa_array.attention_with_kv_cache(
            q, k, v, cache_lengths=[S] * B, cache_leftpad=pad, is_causal=True
        )[0]

    return {"main": main_route, "cache": cache_route}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import torch

    B, H, E = 4, 8, 64
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    print(f"device {args.device}; B={B}, H={H}, E={E}, one query, float32")
    for S in (1024, 8192):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, n, E, generator=g).to(args.device) for n in (1, S, S))
        pad = [0, S // 8, S // 4, S // 2]

        routes = _routes(q, k, v, pad)
        times: dict[str, list[float]] = {name: [] for name in routes}
        for f in routes.values():
            f()
        for r in range(args.rounds):
            for name, f in list(routes.items())[:: 1 if r % 2 == 0 else -1]:
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                times[name].append(time.perf_counter() - t0)
        cells = [
            f"{name} {statistics.median(ts) * 1e3:.3f} ms ({min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f})"
            for name, ts in times.items()
        ]
        ratio = statistics.median(times["cache"]) / statistics.median(times["main"])
        print(f"S={S:5d}: " + "; ".join(cells) + f"; cache / main {ratio:.2f}")


if __name__ == "__main__":
    main()
