"""``python -m sdpa_array bench``: our attention against torch's native kernel, same data.

For each selected backend (from :mod:`sdpa_array.testing.backends`) it times, interleaved in one
process on the same inputs, ``scaled_dot_product_attention(..., implementation="auto")``,
torch's ``scaled_dot_product_attention`` (on the very same memory: NumPy arrays are viewed
as torch tensors without a copy), the naive three-step computation, and the two matrix
products of the same shapes alone; it prints medians, the throughput ratio to torch, the
achieved GFLOP/s and the GEMM-bound fraction. ``--memory`` adds the peak resident memory
of a long single-head call.

The timing helpers here are shared with the asv suite in ``asv_benchmarks/``, so both
measure the same way: GPU work is synchronized before the clock is read, each callable runs
once as warm-up, and repetitions of the candidates are interleaved so that a noisy machine
slows all of them alike.

Examples
--------
``python -m sdpa_array bench`` (NumPy and torch, B=1, H=8, L=S=4096, E=64, float32),
``python -m sdpa_array bench --backends all --quick``,
``python -m sdpa_array bench --shape 1,8,1024,64 --repeat 9 --memory``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..testing.backends import BACKENDS, Backend, get_backend
from .backend_choice import parse_backends, report_unavailable, unavailable_reason

__all__ = [
    "attention_flops",
    "interleaved_times",
    "main",
    "make_inputs",
    "naive_attention",
    "peak_rss_growth",
    "torch_sdpa_peer",
    "two_products",
]


def attention_flops(B: int, H: int, L: int, S: int, E: int, Ev: int, causal: bool) -> float:
    """Floating-point operations of the two matrix products over the admissible pairs.

    ``2 * (E + Ev)`` per admissible (query, key) pair, i.e. ``4 * B * H * L * S * E`` for an
    unrestricted call with ``Ev == E``; a causal call counts only the pairs on or below the
    (top-left) diagonal, the work a kernel that skips masked blocks needs.
    """
    # causal: key j <= query i
    pairs = sum(min(i + 1, S) for i in range(L)) if causal else L * S
    return 2.0 * (E + Ev) * B * H * pairs


def make_inputs(
    backend: Backend, shape: tuple[int, int, int, int], dtype: str, seed: int = 0
) -> tuple[Any, Any, Any]:
    """Standard-normal ``q, k, v`` of shape ``(B, H, L, E)`` on ``backend``, synchronized."""
    rng = np.random.default_rng(seed)
    arrays = tuple(
        backend.asarray(rng.standard_normal(shape, dtype=np.float32), dtype) for _ in "qkv"
    )
    for x in arrays:
        backend.synchronize(x)
    return arrays[0], arrays[1], arrays[2]


def naive_attention(q: Any, k: Any, v: Any, *, is_causal: bool = False) -> Any:
    """The straightforward three steps (scores, softmax, product) in the arrays' library."""
    from .._compat import array_namespace

    xp = array_namespace({"q": q})
    s = xp.matmul(q, xp.matrix_transpose(k)) * (1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        L, S = s.shape[-2], s.shape[-1]
        dev = getattr(s, "device", None)
        keep = xp.arange(S, device=dev)[None, :] <= xp.arange(L, device=dev)[:, None]
        s = xp.where(keep, s, xp.asarray(-math.inf, dtype=s.dtype, device=dev))
    s = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    return xp.matmul(s / xp.sum(s, axis=-1, keepdims=True), v)


def two_products(q: Any, k: Any, v: Any) -> Any:
    """``(q kᵀ) v``: the two matrix products of attention, nothing else."""
    from .._compat import array_namespace

    xp = array_namespace({"q": q})
    return xp.matmul(xp.matmul(q, xp.matrix_transpose(k)), v)


def torch_sdpa_peer(backend: Backend) -> Callable[..., Any]:
    """torch's own ``scaled_dot_product_attention`` on the backend's memory, without a copy.

    Raises
    ------
    NotImplementedError
        If torch is absent, or the backend's arrays cannot be shared with torch
        (array-api-strict, JAX, Dask, CuPy): the comparison must use the same data.
    """
    if backend.library not in ("numpy", "torch") or not get_backend("torch").is_available():
        raise NotImplementedError(f"torch's kernel cannot run on {backend.id} arrays in place")
    get_backend("torch").configure()  # pins matmul precision (no TF32)
    import torch

    def as_torch(x: Any) -> Any:
        return torch.from_numpy(x) if isinstance(x, np.ndarray) else x

    def run(q: Any, k: Any, v: Any, *, is_causal: bool = False) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(
            as_torch(q), as_torch(k), as_torch(v), is_causal=is_causal
        )

    return run


def interleaved_times(
    candidates: dict[str, Callable[[], Any]],
    sync: Callable[[Any], None],
    repeat: int,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Wall-clock seconds of each candidate, ``repeat`` rounds, candidates interleaved.

    Each call's result is passed to ``sync`` (device synchronization, Dask compute) before
    the clock stops; ``warmup`` untimed rounds come first.
    """
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(warmup + repeat):
        for name, fn in candidates.items():
            start = time.perf_counter()
            sync(fn())
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_growth(fn: Callable[[], Any]) -> float | None:
    """Bytes by which the process's peak resident memory rose above its size before ``fn``.

    Linux only (``/proc/self/status``); the peak is reset first through
    ``/proc/self/clear_refs``. ``None`` where that is not possible.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return None
    before = _read_status("VmRSS")
    fn()
    peak = _read_status("VmHWM")
    if before is None or peak is None:
        return None
    return float(peak - before)


@dataclass
class _Row:
    backend: str
    shape: str
    causal: bool
    ours: float
    torch: float | None
    naive: float | None
    products: float | None
    flops: float

    def cells(self) -> list[str]:
        def ms(t: float | None) -> str:
            return "-" if t is None else f"{t * 1e3:.1f}"

        ratio = "-" if self.torch is None else f"{self.torch / self.ours:.2f}"
        naive = "-" if self.naive is None else f"{self.naive / self.ours:.2f}"
        useful = self.flops / (4.0 * _shape_pairs(self.shape) * _shape_e(self.shape))
        fraction = "-" if self.products is None else f"{self.products * useful / self.ours:.2f}"
        return [
            self.backend,
            self.shape,
            "yes" if self.causal else "no",
            ms(self.ours),
            ms(self.torch),
            ratio,
            ms(self.naive),
            naive,
            f"{self.flops / self.ours / 1e9:.0f}",
            fraction,
        ]


HEADER = [
    "backend",
    "B x H x L x S x E",
    "causal",
    "auto ms",
    "torch ms",
    "torch/auto",
    "naive ms",
    "naive/auto",
    "GFLOP/s",
    "GEMM-bound",
]


def _shape_pairs(shape: str) -> int:
    B, H, L, S, _ = (int(n) for n in shape.split("x"))
    return B * H * L * S


def _shape_e(shape: str) -> int:
    return int(shape.split("x")[-1])


def _measure(
    backend: Backend, shape: tuple[int, int, int, int], causal: bool, dtype: str, repeat: int
) -> _Row:
    import sdpa_array

    q, k, v = make_inputs(backend, shape, dtype)
    candidates: dict[str, Callable[[], Any]] = {
        "ours": lambda: sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "naive": lambda: naive_attention(q, k, v, is_causal=causal),
        "products": lambda: two_products(q, k, v),
    }
    try:
        peer = torch_sdpa_peer(backend)
        candidates["torch"] = lambda: peer(q, k, v, is_causal=causal)
    except NotImplementedError:
        pass
    times = {
        n: statistics.median(t)
        for n, t in interleaved_times(candidates, backend.synchronize, repeat).items()
    }
    B, H, L, E = shape
    return _Row(
        backend=backend.id,
        shape=f"{B}x{H}x{L}x{L}x{E}",
        causal=causal,
        ours=times["ours"],
        torch=times.get("torch"),
        naive=times["naive"],
        products=times["products"],
        flops=attention_flops(B, H, L, L, E, E, causal),
    )


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = [int(n) for n in text.split(",")]
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--shape takes B,H,L,E (positive ints), got {text!r}")
    return parts[0], parts[1], parts[2], parts[3]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a Markdown table.

    Returns the exit status: 0, or 2 if a backend named with ``--backends`` is not available
    here (unknown ids exit with 2 through argparse).
    """
    parser = argparse.ArgumentParser(
        prog="python -m sdpa_array bench",
        description="Time scaled_dot_product_attention (implementation='auto') against "
        "torch's native kernel and the naive three steps, on the same data, interleaved.",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated backend ids, or 'all' for every installed one "
        f"({', '.join(b.id for b in BACKENDS)}); default: numpy, and torch if installed",
    )
    parser.add_argument("--shape", type=_parse_shape, default=None, help="B,H,L,E (L = S)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (median)")
    parser.add_argument("--quick", action="store_true", help="B,H,L,E = 1,8,1024,64, 3 rounds")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also measure the peak memory of B=1, H=1, L=S=32768, E=64 on NumPy",
    )
    args = parser.parse_args(argv)
    shape = args.shape or ((1, 8, 1024, 64) if args.quick else (1, 8, 4096, 64))
    repeat = args.repeat or (3 if args.quick else 5)
    if args.backends is None:
        chosen = [get_backend("numpy")]
        torch_backend = get_backend("torch")
        if torch_backend.is_available():
            chosen.append(torch_backend)
        else:
            print(f"skipping torch: {unavailable_reason(torch_backend)}", file=sys.stderr)
    elif args.backends == "all":
        chosen = [b for b in BACKENDS if b.is_available()]
    else:
        chosen = parse_backends(parser, args.backends)
        if not report_unavailable(chosen):
            return 2

    from .._kernels import parallel

    print(
        f"# sdpa_array bench: {args.dtype}, median of {repeat} interleaved rounds, "
        f"{os.cpu_count()} CPUs, {parallel.get_num_threads()} NumPy block threads"
    )
    rows: list[_Row] = []
    notes = []
    for backend in chosen:
        if args.dtype not in backend.dtypes:
            print(f"skipping {backend.id}: no {args.dtype}", file=sys.stderr)
            continue
        backend.configure()  # JAX float64, highest matmul precision, no TF32
        full, causal = (_measure(backend, shape, c, args.dtype, repeat) for c in (False, True))
        rows += [full, causal]
        notes.append(
            f"{backend.id}: is_causal=True takes {causal.ours / full.ours:.2f}x the time of "
            f"is_causal=False ({full.ours / causal.ours:.2f}x faster)"
        )
        if backend.library == "torch" and shape != (1, 8, 1024, 64) and not args.quick:
            rows.append(_measure(backend, (1, 8, 1024, 64), False, args.dtype, repeat))
    print(_table([row.cells() for row in rows]))
    print(
        "torch/auto > 1: ours is faster. GEMM-bound: time of the two products alone (scaled "
        "to the admissible pairs) / our time. GFLOP/s count 2*(E+Ev) per admissible pair."
    )
    for note in notes:
        print(note)
    if args.memory:
        _memory_row(args.dtype)
    return 0


def _memory_row(dtype: str) -> None:
    import sdpa_array

    numpy_backend = get_backend("numpy")
    L = 32768
    q, k, v = make_inputs(numpy_backend, (1, 1, L, 64), dtype)
    inputs = sum(x.nbytes for x in (q, k, v))
    sdpa_array.scaled_dot_product_attention(q[..., :256, :], k[..., :256, :], v[..., :256, :])
    growth = peak_rss_growth(lambda: sdpa_array.scaled_dot_product_attention(q, k, v))
    tracemalloc.start()
    try:
        sdpa_array.scaled_dot_product_attention(q, k, v)
        allocated = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    scores = L * L * np.dtype(dtype).itemsize
    text = "n/a (needs Linux /proc)" if growth is None else f"{growth / 2**20:.1f} MiB"
    print(
        f"\nmemory: numpy 1x1x{L}x{L}x64 {dtype}, implementation='auto': peak RSS growth "
        f"{text}, peak of NumPy allocations (tracemalloc) {allocated / 2**20:.1f} MiB "
        f"(inputs {inputs / 2**20:.0f} MiB; one score matrix {scores / 2**30:.0f} GiB)"
    )
