"""GPU decode benchmark: ``attention_with_kv_cache`` against the memory bandwidth limit.

One decoding step reads every attended key and value once, so its limit is memory
bandwidth. The bandwidth comes from the same run: a device-to-device copy of a buffer the
size of the attended cache, counted as bytes read plus bytes written, as NVIDIA's
``bandwidthTest`` counts it. Each row gives the decode's effective bandwidth (the attended
keys' and values' bytes over its time) as a fraction of that copy's::

    python asv_benchmarks/studies/gpu_decode_bench.py   # B=1, Hq=32, Hkv=8, 32768 tokens
    python asv_benchmarks/studies/gpu_decode_bench.py --batch 4 --cache 8192 --json out.json

A row ``decode torch graph`` replays the torch call captured in a CUDA graph (lengths as a
device tensor), the device's time without the host's per-call Python overhead.

The decode, the copy and torch's SDPA on the same tokens gathered contiguous (a peer that
needs the gathered copy, which is not timed) are interleaved: ``--rounds`` rounds of
``--reps`` queued calls, one synchronisation each, median and min-max over rounds. The
cache is paged (pages of ``--page`` tokens in random order) unless ``--contiguous``.
Under ``TRITON_INTERPRET=1`` the script runs on CPU torch tensors (``--device cpu``, small
sizes): a check that it runs, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--cache", type=int, default=32768, help="tokens attended per sequence")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--libraries", nargs="+", default=["torch", "cupy"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the rows here")
    return ap.parse_args()


def _timer(sync: Callable[[], None]) -> Callable[[Callable[[], Any], int], float]:
    def timed(fn: Callable[[], Any], reps: int) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    return timed


def _captured(step: Callable[[], Any], torch: Any) -> Callable[[], Any] | None:
    """``step`` captured in a CUDA graph (lengths on the device stay there: no host
    overhead per call), as ``graph.replay``; ``None``, with the reason printed, where the
    capture fails. The first capture compiles what it needs; the second is kept."""
    graph = None
    try:
        for _ in range(2):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
    except Exception as exc:  # report and go on with the other rows
        print(f"CUDA graph capture FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None
    return graph.replay


def main() -> None:
    args = _parse()
    import numpy as np
    import torch
    import torch.nn.functional as F

    import sdpa_array as sa

    dev = torch.device(args.device)
    dt = getattr(torch, args.dtype)
    B, Hq, Hkv, n, E, ps = args.batch, args.heads, args.kv_heads, args.cache, args.dim, args.page

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        cupy = sys.modules.get("cupy")
        if cupy is not None and dev.type == "cuda":
            cupy.cuda.get_current_stream().synchronize()

    timed = _timer(sync)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, 1, E, device=dev, dtype=dt, generator=g)
    if args.contiguous:
        kc = torch.randn(B, Hkv, n, E, device=dev, dtype=dt, generator=g)
        vc = torch.randn(B, Hkv, n, E, device=dev, dtype=dt, generator=g)
        table = None
        k_full, v_full = kc, vc
    else:
        per_seq = -(-n // ps)
        pages = B * per_seq
        kc = torch.randn(pages, Hkv, ps, E, device=dev, dtype=dt, generator=g)
        vc = torch.randn(pages, Hkv, ps, E, device=dev, dtype=dt, generator=g)
        order = np.random.default_rng(0).permutation(pages).reshape(B, per_seq)
        table = torch.as_tensor(order, device=dev, dtype=torch.int32)
        idx = table.long()
        k_full = kc[idx].permute(0, 2, 1, 3, 4).reshape(B, Hkv, per_seq * ps, E)[:, :, :n]
        v_full = vc[idx].permute(0, 2, 1, 3, 4).reshape(B, Hkv, per_seq * ps, E)[:, :, :n]
        k_full, v_full = k_full.contiguous(), v_full.contiguous()
    lengths = [n] * B
    read_bytes = 2 * B * Hkv * n * E * q.element_size()
    buffer = torch.empty(read_bytes, dtype=torch.uint8, device=dev)
    target = torch.empty_like(buffer)
    libs: dict[str, tuple[Any, Any, Any, Any]] = {"torch": (q, kc, vc, table)}
    if "cupy" in args.libraries and dev.type == "cuda":
        try:
            import cupy

            libs["cupy"] = tuple(  # type: ignore[assignment]
                None if t is None else cupy.from_dlpack(t) for t in (q, kc, vc, table)
            )
        except ImportError:
            pass
    libs = {k: v for k, v in libs.items() if k in args.libraries}

    def copy() -> Any:
        return target.copy_(buffer)

    def peer() -> Any:
        return F.scaled_dot_product_attention(q, k_full, v_full, enable_gqa=True)

    candidates: dict[str, Callable[[], Any]] = {"copy": copy, "peer": peer}
    for name, (xq, xk, xv, xt) in libs.items():

        def decode(xq: Any = xq, xk: Any = xk, xv: Any = xv, xt: Any = xt) -> Any:
            return sa.attention_with_kv_cache(
                xq, xk, xv, cache_lengths=lengths, block_table=xt, enable_gqa=True
            )

        candidates[f"decode {name}"] = decode
    if dev.type == "cuda" and "torch" in libs:
        graph = _captured(
            lambda: sa.attention_with_kv_cache(
                q,
                kc,
                vc,
                cache_lengths=torch.tensor(lengths, device=dev, dtype=torch.int32),
                block_table=table,
                enable_gqa=True,
            ),
            torch,
        )
        if graph is not None:
            candidates["decode torch graph"] = graph
    times: dict[str, list[float]] = {k: [] for k in candidates}
    for r in range(args.rounds):
        names = list(candidates)
        names = names[r % len(names) :] + names[: r % len(names)]
        for k in names:
            times[k].append(timed(candidates[k], args.reps))
    copy_bw = [2 * read_bytes / t for t in times["copy"]]
    rows = []
    for k, ts in times.items():
        med = statistics.median(ts)
        fractions = [read_bytes / t / bw for t, bw in zip(ts, copy_bw, strict=True)]
        row = {
            "name": k,
            "median_ms": med * 1e3,
            "min_ms": min(ts) * 1e3,
            "max_ms": max(ts) * 1e3,
            "bandwidth_fraction": statistics.median(fractions),
            "fraction_min": min(fractions),
            "fraction_max": max(fractions),
        }
        rows.append(row)
        print(
            f"{k:14s} {row['median_ms']:8.3f} ms ({row['min_ms']:.3f}-{row['max_ms']:.3f})  "
            f"of copy bandwidth {row['bandwidth_fraction']:.3f} "
            f"({row['fraction_min']:.3f}-{row['fraction_max']:.3f})",
            flush=True,
        )
    bw = statistics.median(copy_bw) / 1e9
    print(f"copy bandwidth {bw:.0f} GB/s; {read_bytes / 2**20:.0f} MiB of keys and values read")
    if args.json:
        meta = {"device": str(dev), "torch": torch.__version__, "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "copy_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
