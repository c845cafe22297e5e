"""Where the blocked path stops being slower than the materialized one, per CPU library.

Usage::

    python asv_benchmarks/studies/auto_crossover.py --repeat 5   # every CPU library
    python asv_benchmarks/studies/auto_crossover.py --libraries dask --lengths 256,512 --vjp

For each library (a backend id of :mod:`sdpa_array.testing.backends`) and each
``L = S`` it times ``implementation="materialized"`` against ``implementation="blocked"``
(the forward, and with ``--vjp`` also ``scaled_dot_product_attention_vjp``) at float32,
B=1, H=8, E=64, with :func:`sdpa_array.lab.cli.bench.interleaved_times` (one warm-up round,
candidates interleaved; Dask results are computed, device results synchronized, before
the clock stops). A row gives both medians, the ratio of medians blocked/materialized and
the min-max of the per-round ratios. Sizes whose score matrix exceeds ``--max-score-bytes``
are skipped, and so are a library's larger sizes once one call takes more than
``--max-call-seconds``. The crossover is the smallest score-matrix size (bytes of one
float32 ``B x H x L x S`` matrix) from which blocked is not slower (ratio <= 1) at that and
every larger measured size; it is what ``AUTO_BLOCKED_BYTES_BY_LIBRARY`` in
``sdpa_array/_plan/dispatch.py`` records (docs/performance.md has the thresholds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import sdpa_array
from sdpa_array.lab.cli.bench import interleaved_times
from sdpa_array.testing.backends import Backend, get_backend

B, H, E = 1, 8, 64
DTYPE = "float32"
ITEMSIZE = 4


def _syncer(backend: Backend) -> Callable[[Any], None]:
    """Finish the work behind a result (an array or a tuple of arrays) before the clock."""
    if backend.library == "dask":
        import dask

        def sync(result: Any) -> None:
            dask.compute(*(result if isinstance(result, tuple) else (result,)))

        return sync

    def sync_each(result: Any) -> None:
        for x in result if isinstance(result, tuple) else (result,):
            backend.synchronize(x)

    return sync_each


def _candidates(backend: Backend, L: int, vjp: bool) -> dict[str, Callable[[], Any]]:
    rng = np.random.default_rng(0)
    shape = (B, H, L, E)
    q, k, v, g = (
        backend.asarray(rng.standard_normal(shape, dtype=np.float32), DTYPE) for _ in range(4)
    )
    if vjp:
        run = sdpa_array.scaled_dot_product_attention_vjp
        return {
            name: (lambda name=name: run(q, k, v, g, implementation=name))
            for name in ("materialized", "blocked")
        }
    fwd = sdpa_array.scaled_dot_product_attention
    return {
        name: (lambda name=name: fwd(q, k, v, implementation=name))
        for name in ("materialized", "blocked")
    }


def measure(backend: Backend, L: int, vjp: bool, repeat: int) -> tuple[float, float, float, float]:
    """``(materialized median s, blocked median s, min and max of the per-round ratios)``."""
    times = interleaved_times(_candidates(backend, L, vjp), _syncer(backend), repeat)
    mat, blk = times["materialized"], times["blocked"]
    ratios = [b / m for b, m in zip(blk, mat, strict=True)]
    return statistics.median(mat), statistics.median(blk), min(ratios), max(ratios)


def crossover(rows: list[tuple[int, float]]) -> int | None:
    """Smallest score bytes from which every measured ratio is <= 1 (None: no such size)."""
    found = None
    for nbytes, ratio in reversed(rows):
        if ratio > 1.0:
            break
        found = nbytes
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", default="numpy,torch,strict,jax,dask")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--vjp", action="store_true", help="also time the VJP")
    parser.add_argument("--max-score-bytes", type=int, default=2**31)
    parser.add_argument("--max-call-seconds", type=float, default=10.0)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    kinds = ("forward", "vjp") if args.vjp else ("forward",)
    summary = []
    for lib in args.libraries.split(","):
        backend = get_backend(lib)
        if not backend.is_available():
            print(f"{lib}: not available, skipped", flush=True)
            continue
        backend.configure()
        for kind in kinds:
            print(f"\n{lib} {kind} (B={B}, H={H}, E={E}, {DTYPE}, {args.repeat} rounds)")
            print(
                f"{'L=S':>6} {'score MiB':>10} {'mat ms':>9} {'blk ms':>9} {'blk/mat':>8}  spread"
            )
            rows = []
            for L in lengths:
                nbytes = B * H * L * L * ITEMSIZE
                if nbytes > args.max_score_bytes:
                    print(f"{L:>6} {nbytes / 2**20:>10.0f}  skipped (score matrix too large)")
                    continue
                mat, blk, lo, hi = measure(backend, L, kind == "vjp", args.repeat)
                ratio = blk / mat
                rows.append((nbytes, ratio))
                print(
                    f"{L:>6} {nbytes / 2**20:>10.1f} {mat * 1e3:>9.1f} {blk * 1e3:>9.1f}"
                    f" {ratio:>8.2f}  ({lo:.2f}-{hi:.2f})",
                    flush=True,
                )
                if max(mat, blk) > args.max_call_seconds:
                    print(
                        f"       larger sizes skipped (a call took over {args.max_call_seconds} s)"
                    )
                    break
            cross = crossover(rows)
            summary.append((lib, kind, cross))
    print("\ncrossover (smallest score bytes from which blocked is not slower):")
    for lib, kind, cross in summary:
        text = (
            "none in the measured range" if cross is None else f"{cross} ({cross / 2**20:.0f} MiB)"
        )
        print(f"  {lib:<8} {kind:<8} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
