"""Decoding over a paged KV cache on NumPy against torch's native SDPA on the gathered cache.

Usage::

    python asv_benchmarks/studies/bench_kv_cache.py  # B=4, Hq=32, Hkv=8, L=1, 32768, E=128
    python asv_benchmarks/studies/bench_kv_cache.py --cache 4096 --rounds 3  # seconds, a try

One decoding step: ``attention_with_kv_cache`` writes one new token per sequence into a
paged float32 cache (pages of 256 tokens, in a random order in the pool) and attends to
``cache`` tokens per sequence, causal, grouped-query. The peer is
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` on the same tokens
gathered into a contiguous ``(B, Hkv, cache, E)`` tensor; the gathering is not timed (it is
the copy our call avoids). The two run interleaved in one process (each round starting with
the other one), after a warm-up round; the table gives the median and the min-max spread.

Memory: the peak of the Python-tracked allocations during one call of ours
(:mod:`tracemalloc`, which sees NumPy's buffers), against the size of the cache (keys and
values); it is measured in a separate call, since tracing slows allocation down.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tracemalloc

import numpy as np

from sdpa_array._api.kv_cache import attention_with_kv_cache
from sdpa_array._arrays.parallel import get_num_threads
from sdpa_array.lab.cli.bench import interleaved_times
from sdpa_array.testing.backends import get_backend


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--cache", type=int, default=32768, help="attended tokens per sequence")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    B, Hq, Hkv, T, E, ps = (
        args.batch,
        args.heads_q,
        args.heads_kv,
        args.cache,
        args.dim,
        args.page_size,
    )
    get_backend("torch").configure()  # float32 matmul at full precision
    import torch

    rng = np.random.default_rng(0)
    max_pages = -(-T // ps)
    num_pages = B * max_pages
    table = rng.permutation(num_pages).reshape(B, max_pages)
    k_pool = rng.standard_normal((num_pages, Hkv, ps, E), dtype=np.float32)
    v_pool = rng.standard_normal((num_pages, Hkv, ps, E), dtype=np.float32)
    q = rng.standard_normal((B, Hq, 1, E), dtype=np.float32)
    new_k = rng.standard_normal((B, Hkv, 1, E), dtype=np.float32)
    new_v = rng.standard_normal((B, Hkv, 1, E), dtype=np.float32)
    lengths = [T - 1] * B  # one new token each: T attended tokens

    def ours() -> np.ndarray:
        out, _, _ = attention_with_kv_cache(
            q,
            k_pool,
            v_pool,
            cache_lengths=lengths,
            new_key=new_k,
            new_value=new_v,
            block_table=table,
            num_splits=args.num_splits,
            is_causal=True,
            enable_gqa=True,
        )
        return out

    expected = ours()  # also writes the new tokens, so that the gathered cache holds them
    gathered = [
        torch.from_numpy(np.ascontiguousarray(pool[table].transpose(0, 2, 1, 3, 4)))
        .reshape(B, Hkv, max_pages * ps, E)[:, :, :T]
        .contiguous()
        for pool in (k_pool, v_pool)
    ]
    tq = torch.from_numpy(q)

    def peer() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            tq, gathered[0], gathered[1], enable_gqa=True
        )

    gap = float(np.max(np.abs(peer().numpy() - expected)))
    times = interleaved_times({"ours": ours, "torch": peer}, lambda _: None, args.rounds)

    tracemalloc.start()
    tracemalloc.reset_peak()
    ours()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    cache_bytes = k_pool.nbytes + v_pool.nbytes

    print(
        f"B={B} Hq={Hq} Hkv={Hkv} L=1 cache={T} E={E} float32, paged (page {ps}, "
        f"{num_pages} pages, random order); NumPy threads {get_num_threads()}, torch threads "
        f"{torch.get_num_threads()}; {args.rounds} interleaved rounds"
    )
    print(f"{'':<34}{'median ms':>12}{'min-max ms':>18}")
    rows = {
        "attention_with_kv_cache (NumPy)": times["ours"],
        "torch SDPA, gathered cache": times["torch"],
    }
    for name, ts in rows.items():
        ms = [t * 1e3 for t in ts]
        print(f"{name:<34}{statistics.median(ms):>12.1f}{f'{min(ms):.1f}-{max(ms):.1f}':>18}")
    ratio = statistics.median(times["ours"]) / statistics.median(times["torch"])
    print(f"ours / torch (medians): {ratio:.2f}")
    print(
        f"peak traced memory of our call: {peak / 2**20:.1f} MiB = {peak / cache_bytes:.3f} x "
        f"the cache (keys + values, {cache_bytes / 2**20:.0f} MiB)"
    )
    print(f"max |ours - torch|: {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
