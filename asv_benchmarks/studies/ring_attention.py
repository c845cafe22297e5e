"""Ring attention (context parallelism) over gloo processes against the single-process call.

Usage::

    python asv_benchmarks/studies/ring_attention.py                       # L = 1024 2048 4096
    python asv_benchmarks/studies/ring_attention.py --lengths 512 1024 --rounds 3

B=1, H=4, E=64, torch float32, ``is_causal=True``, forward and backward (``out.backward``).
For each length and ``P`` in ``--processes`` (1: the single-process
``scaled_dot_product_attention`` in one process; 2, 4: :func:`sdpa_array.distributed.
ring_attention` on ``P`` gloo processes over loopback, ``--sharding``), fresh processes each
time, every participant reports

* its time per forward+backward (median of ``--rounds`` after one warm-up, with the
  min-max over rounds), the slowest participant's median is shown;
* its peak resident memory above the memory after making its inputs
  (``ru_maxrss``; the largest over participants);
* the bytes it sent forward and backward (``RingStats``), against the minimum forward
  traffic of ``P - 1`` key/value slices.

Each process runs with ``--threads`` torch threads (default: the machine's cores / P, at
least 1), so that the P processes share the cores as one process would use them.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np


def _participant(rank: int, world: int, port: int, args: Any, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    import sdpa_array
    from sdpa_array.distributed import RingStats, ring_attention, shard_sequence

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    rng = np.random.default_rng(0)
    shape = (1, 4, args.length, 64)
    full = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for _ in range(4)]
    if world > 1:
        full = [shard_sequence(x, rank, world, sharding=args.sharding).clone() for x in full]
    q, k, v, g = (x.requires_grad_(i < 3) for i, x in enumerate(full))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    stats = RingStats()
    for r in range(args.rounds + 1):
        stats = RingStats()
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        if world > 1:
            out = ring_attention(q, k, v, is_causal=True, sharding=args.sharding, stats=stats)
        else:
            out = sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(g)
        if r:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    kv = (k.numel() + v.numel()) * k.element_size()
    queue.put((rank, times, peak * 1024, stats.bytes_sent, stats.backward_bytes_sent, kv))
    if world > 1:
        dist.destroy_process_group()


def _run(world: int, args: Any) -> list[Any]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_participant, args=(r, world, port, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return sorted(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sharding", default="zigzag", choices=["contiguous", "zigzag"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    print(f"cores: {os.cpu_count()}, causal, B=1 H=4 E=64 float32, sharding {args.sharding}")
    header = f"{'L':>6} {'P':>2} {'time s (min-max)':>24} {'peak MiB':>9} "
    print(header + f"{'sent fwd MiB':>13} {'min fwd MiB':>12} {'sent bwd MiB':>13}")
    for length in args.lengths:
        args.length = length
        for world in args.processes:
            results = _run(world, args)
            slowest = max(results, key=lambda r: statistics.median(r[1]))
            times = slowest[1]
            med = statistics.median(times)
            peak = max(r[2] for r in results) / 2**20
            sent = max(r[3] for r in results) / 2**20
            back = max(r[4] for r in results) / 2**20
            minimum = (world - 1) * results[0][5] / 2**20
            spread = f"{med:.3f} ({min(times):.3f}-{max(times):.3f})"
            print(
                f"{length:>6} {world:>2} {spread:>24} {peak:>9.1f} "
                f"{sent:>13.2f} {minimum:>12.2f} {back:>13.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
