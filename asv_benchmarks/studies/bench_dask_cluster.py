"""Causal attention on a dask.distributed LocalCluster against one NumPy process.

Usage::

    python asv_benchmarks/studies/bench_dask_cluster.py                 # L=S=131072, chunks 8192
    python asv_benchmarks/studies/bench_dask_cluster.py --length 32768  # a shorter try

B=1, H=1, E=64, float32, ``is_causal=True``. The inputs are made on the host with one seed,
then:

* ``numpy``: ``scaled_dot_product_attention(..., implementation="blocked")`` on the NumPy
  arrays in this process (its own thread pool, ``SDPA_ARRAY_NUM_THREADS`` or the default);
* ``dask, N workers``: the same arrays as Dask arrays chunked ``(1, 1, chunk, E)`` and
  persisted on a ``LocalCluster(n_workers=N, processes=True, threads_per_worker=1,
  memory_limit=...)``, then ``scaled_dot_product_attention`` (``"auto"`` builds the chunk
  pair graph) persisted and waited for; the inputs' transfer is not timed, the graph
  construction is.

GFLOP/s count ``4 E`` per admissible (query, key) pair (two products), ``L (L + 1) / 2``
pairs. After each cluster run the script checks that no worker spilled to disk or
restarted, and compares the output with the NumPy one (max abs difference).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import sdpa_array


def _spilled(dask_worker: Any) -> int:
    """Bytes this worker wrote to disk (0 without a spill buffer)."""
    data = dask_worker.data
    total = getattr(data, "spilled_total", None)
    if total is not None:
        return int(getattr(total, "disk", 0) or 0)
    return len(getattr(data, "slow", ()))


def _cluster_run(
    arrays: tuple[np.ndarray, ...], workers: int, chunk: int, memory: str
) -> tuple[float, np.ndarray, str]:
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    with (
        LocalCluster(
            n_workers=workers,
            processes=True,
            threads_per_worker=1,
            memory_limit=memory,
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        E = arrays[0].shape[-1]
        q, k, v = (da.from_array(a, chunks=(1, 1, chunk, E)).persist() for a in arrays)
        wait([q, k, v])
        before = sorted(client.scheduler_info()["workers"])
        start = time.perf_counter()
        out = sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=True).persist()
        wait(out)
        seconds = time.perf_counter() - start
        after = sorted(client.scheduler_info()["workers"])
        spilled = sum(client.run(_spilled).values())
        result = out.compute()
        health = f"restarts: {'none' if before == after else 'YES'}, spilled: {spilled} B"
    return seconds, result, health


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=131072, help="L = S")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--features", type=int, default=64, help="E")
    parser.add_argument("--memory-limit", default="1GiB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    L, E = args.length, args.features
    rng = np.random.default_rng(0)
    arrays = tuple(rng.standard_normal((1, 1, L, E), dtype=np.float32) for _ in range(3))
    gflop = 4 * E * L * (L + 1) / 2 / 1e9
    print(f"B=1 H=1 L=S={L} E={E} float32 causal, chunks of {args.chunk}: {gflop:.0f} GFLOP")

    start = time.perf_counter()
    expected = sdpa_array.scaled_dot_product_attention(
        *arrays, is_causal=True, implementation="blocked"
    )
    seconds = time.perf_counter() - start
    print(f"numpy blocked, 1 process     : {seconds:8.2f} s  {gflop / seconds:7.1f} GFLOP/s")
    for workers in args.workers:
        seconds, out, health = _cluster_run(arrays, workers, args.chunk, args.memory_limit)
        error = float(np.max(np.abs(out - expected)))
        print(
            f"dask, {workers} worker(s) x 1 thread: {seconds:8.2f} s  "
            f"{gflop / seconds:7.1f} GFLOP/s  ({health}; max |diff| vs numpy {error:.1e})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
