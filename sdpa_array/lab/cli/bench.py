"""``python -m sdpa_array bench``: our attention against torch's native kernel, same data.

For each selected backend (from :mod:`sdpa_array.testing.backends`) it times, interleaved in one
process on the same inputs, ``scaled_dot_product_attention(..., implementation="auto")``,
torch's ``scaled_dot_product_attention`` (on the very same memory: NumPy arrays are viewed
as torch tensors without a copy), the naive three-step computation, and the two matrix
products of the same shapes alone; causal rows also time our non-causal call in the same
rounds, for the causal speedup. It prints one Markdown table row per measurement as soon as
that measurement ends: medians and their min-max range over the rounds, the throughput
ratio to torch, the achieved GFLOP/s and the GEMM-bound fraction, every ratio a ratio of
medians of the same interleaved run. Progress lines (``[2/4] measuring numpy float32 causal
1x8x4096x4096x64 (5 rounds) ...``) go to stderr. ``--memory`` adds the peak resident memory
of a long single-head call.

The timing helpers here are shared with the asv suite in ``asv_benchmarks/``, so both
measure the same way: GPU work is synchronized before the clock is read, each callable runs
once as warm-up, and the candidates are interleaved (a new order each round) so that a
noisy machine slows all of them alike.

Examples
--------
``python -m sdpa_array bench`` (NumPy and torch, B=1, H=8, L=S=4096, E=64, float32),
``python -m sdpa_array bench --backends all --quick``,
``python -m sdpa_array bench --shape 1,8,1024,64 --repeat 9 --memory``,
``python -m sdpa_array bench --backends numpy --shape 1,1,64,16 --repeat 1`` (seconds).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...testing.backends import BACKENDS, Backend, get_backend
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
    from ..._arrays.compat import array_namespace

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
    from ..._arrays.compat import array_namespace

    xp = array_namespace({"q": q})
    return xp.matmul(xp.matmul(q, xp.matrix_transpose(k)), v)


def torch_sdpa_peer(backend: Backend) -> Callable[..., Any]:
    """torch's own ``scaled_dot_product_attention`` on the backend's memory, without a copy.

    Raises
    ------
    NotImplementedError
        If torch is absent, or the backend's arrays cannot be shared with torch without a
        copy (array-api-strict, JAX, Dask): the comparison must use the same data. NumPy
        arrays are shared through ``torch.from_numpy``, CuPy arrays through DLPack.
    """
    shared = ("numpy", "torch", "cupy")
    if backend.library not in shared or not get_backend("torch").is_available():
        raise NotImplementedError(f"torch's kernel cannot run on {backend.id} arrays in place")
    get_backend("torch").configure()  # pins matmul precision (no TF32)
    import torch

    def as_torch(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return torch.from_numpy(x)
        return x if isinstance(x, torch.Tensor) else torch.utils.dlpack.from_dlpack(x)

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

    Each round calls every candidate once, in an order shuffled anew (seeded by the round)
    so that no candidate always follows the same one and its after-effects. Each result goes
    to ``sync`` (device synchronization, Dask compute) before the clock stops; ``warmup``
    untimed rounds come first. The lists keep the order of the timed rounds.
    """
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeat):
        order = list(names)
        random.Random(round_).shuffle(order)
        for name in order:
            start = time.perf_counter()
            sync(candidates[name]())
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def report_groups(
    groups: dict[str, dict[str, Callable[[], Any]]], rounds: int, widths: tuple[int, int]
) -> None:
    """Time each group's cases interleaved (:func:`interleaved_times`) and print, per case,
    the median, its min-max and the ratio to the group's first case (its peer);
    ``widths`` are those of the group and case columns."""
    for group, cases in groups.items():
        times = interleaved_times(cases, lambda result: None, rounds)
        peer = statistics.median(next(iter(times.values())))
        for name, ts in times.items():
            median = statistics.median(ts)
            print(
                f"{group:{widths[0]}s} {name:{widths[1]}s} {median * 1e3:9.1f} ms "
                f"({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})  / peer {median / peer:.3f}"
            )


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


def _decimals(seconds: float) -> int:
    """Decimals that show ``seconds`` in milliseconds to about three significant digits."""
    ms = seconds * 1e3
    return 1 if ms >= 10 else 2 if ms >= 1 else 3


def _ms(seconds: float, decimals: int | None = None) -> str:
    """Milliseconds, with ``decimals`` (by default those :func:`_decimals` chooses)."""
    return f"{seconds * 1e3:.{_decimals(seconds) if decimals is None else decimals}f}"


def _median_range(times: list[float] | None) -> str:
    """``median (min-max)`` in milliseconds, all three to the median's decimals; ``-`` if none."""
    if not times:
        return "-"
    median = statistics.median(times)
    d = _decimals(median)
    return f"{_ms(median, d)} ({_ms(min(times), d)}-{_ms(max(times), d)})"


def _shape_text(shape: tuple[int, int, int, int]) -> str:
    B, H, L, E = shape
    return f"{B}x{H}x{L}x{L}x{E}"


@dataclass(frozen=True)
class _Case:
    """One row to measure: a backend, a shape ``(B, H, L, E)`` with ``S = L``, causal or not."""

    backend: Backend
    shape: tuple[int, int, int, int]
    causal: bool

    def describe(self, dtype: str) -> str:
        kind = "causal" if self.causal else "non-causal"
        return f"{self.backend.id} {dtype} {kind} {_shape_text(self.shape)}"


@dataclass
class _Row:
    """A measured case: seconds per timed round of each candidate, from one interleaved run.

    Candidates: ``ours``, ``naive``, ``products``, ``torch`` (absent where torch cannot use
    the backend's memory) and, in causal rows, ``ours_full`` (our non-causal call).
    """

    case: _Case
    times: dict[str, list[float]]

    def median(self, name: str) -> float | None:
        samples = self.times.get(name)
        return statistics.median(samples) if samples else None

    def cells(self) -> list[str]:
        B, H, L, E = self.case.shape
        flops = attention_flops(B, H, L, L, E, E, self.case.causal)
        ours = statistics.median(self.times["ours"])  # always a candidate
        torch, naive, products = self.median("torch"), self.median("naive"), self.median("products")
        # the products are timed on the whole (L, S) matrix; scale them to the admissible pairs
        useful = flops / (4.0 * B * H * L * L * E)
        return [
            self.case.backend.id,
            _shape_text(self.case.shape),
            "yes" if self.case.causal else "no",
            _median_range(self.times["ours"]),
            _median_range(self.times.get("torch")),
            "-" if torch is None else f"{torch / ours:.2f}",
            "-" if naive is None else _ms(naive),
            "-" if naive is None else f"{naive / ours:.2f}",
            f"{flops / ours / 1e9:.0f}",
            "-" if products is None else f"{products * useful / ours:.2f}",
        ]

    def causal_note(self) -> str | None:
        """The causal speedup over our non-causal call, for causal rows."""
        causal, full = self.median("ours"), self.median("ours_full")
        if not self.case.causal or causal is None or full is None:
            return None
        return (
            f"{self.case.backend.id} {_shape_text(self.case.shape)}: is_causal=True takes "
            f"{causal / full:.2f}x the time of is_causal=False ({full / causal:.2f}x faster; "
            "medians of the same interleaved rounds)"
        )


HEADER = [
    "backend",
    "B x H x L x S x E",
    "causal",
    "auto ms (min-max)",
    "torch ms (min-max)",
    "torch/auto",
    "naive ms",
    "naive/auto",
    "GFLOP/s",
    "GEMM-bound",
]

#: Column widths for numbers not known before they are measured (wider cells still print).
_MIN_WIDTHS = [0, 0, 0, 22, 22, 0, 0, 0, 0, 0]


def _measure(case: _Case, dtype: str, repeat: int) -> _Row:
    """Time the candidates of ``case`` in one interleaved run."""
    import sdpa_array

    backend = case.backend
    q, k, v = make_inputs(backend, case.shape, dtype)
    causal = case.causal
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
    if causal:
        candidates["ours_full"] = lambda: sdpa_array.scaled_dot_product_attention(q, k, v)
    return _Row(case, interleaved_times(candidates, backend.synchronize, repeat))


class _Table:
    """A Markdown table printed one row at a time, its widths fixed by the header line."""

    def __init__(self, cases: list[_Case]) -> None:
        known = [0] * len(HEADER)  # widest cell known before measuring, per column
        known[0] = max([len(c.backend.id) for c in cases], default=0)
        known[1] = max([len(_shape_text(c.shape)) for c in cases], default=0)
        self.widths = [
            max(len(h), m, k) for h, m, k in zip(HEADER, _MIN_WIDTHS, known, strict=True)
        ]

    def header(self) -> str:
        head = " | ".join(h.ljust(w) for h, w in zip(HEADER, self.widths, strict=True))
        return f"| {head} |\n|" + "|".join("-" * (w + 2) for w in self.widths) + "|"

    def row(self, cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, self.widths, strict=True)) + " |"


def _emit(text: str) -> None:
    """Print ``text`` on stdout now (flushed, also when stdout is a pipe or a file)."""
    print(text, flush=True)


def _progress(text: str) -> None:
    """Print a progress line on stderr now."""
    print(text, file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = [int(n) for n in text.split(",")]
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--shape takes B,H,L,E (positive ints), got {text!r}")
    return parts[0], parts[1], parts[2], parts[3]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison, printing each Markdown table row as soon as it is measured.

    Returns the exit status: 0, or 2 if a backend named with ``--backends`` is not available
    here (unknown ids exit with 2 through argparse).
    """
    parser = argparse.ArgumentParser(
        prog="python -m sdpa_array bench",
        description="Time scaled_dot_product_attention (implementation='auto') against "
        "torch's native kernel and the naive three steps, on the same data, interleaved. "
        "Rows are printed as they are measured; progress goes to stderr.",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated backend ids, or 'all' for every installed one "
        f"({', '.join(b.id for b in BACKENDS)}); default: numpy, and torch if installed",
    )
    parser.add_argument(
        "--shape",
        type=_parse_shape,
        default=None,
        help="B,H,L,E (L = S); default 1,8,4096,64 (1,8,1024,64 with --quick)",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--repeat",
        type=_positive_int,
        default=None,
        help="timed interleaved rounds per row (median, min-max); default 5 (3 with --quick)",
    )
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

    cases: list[_Case] = []
    for backend in chosen:
        if args.dtype not in backend.dtypes:
            print(f"skipping {backend.id}: no {args.dtype}", file=sys.stderr)
            continue
        cases += [_Case(backend, shape, False), _Case(backend, shape, True)]
        if backend.library == "torch" and shape != (1, 8, 1024, 64) and not args.quick:
            # torch tensors at the size of the "within 5% of torch" target
            cases.append(_Case(backend, (1, 8, 1024, 64), False))
    steps = len(cases) + (1 if args.memory else 0)

    from ..._arrays import parallel

    _emit(
        f"# sdpa_array bench: {args.dtype}, times in ms as median (min-max) of {repeat} "
        f"interleaved rounds, {os.cpu_count()} CPUs, "
        f"{parallel.get_num_threads()} NumPy block threads"
    )
    table = _Table(cases)
    _emit(table.header())
    notes = []
    configured: set[str] = set()
    for step, case in enumerate(cases, start=1):
        _progress(f"[{step}/{steps}] measuring {case.describe(args.dtype)} ({repeat} rounds) ...")
        if case.backend.id not in configured:
            case.backend.configure()  # JAX float64, highest matmul precision, no TF32
            configured.add(case.backend.id)
        row = _measure(case, args.dtype, repeat)
        _emit(table.row(row.cells()))
        note = row.causal_note()
        if note is not None:
            notes.append(note)
    _emit(
        "torch/auto > 1: ours is faster. GEMM-bound: time of the two products alone (scaled "
        "to the admissible pairs) / our time. GFLOP/s count 2*(E+Ev) per admissible pair. "
        "Ratios are of medians of the same interleaved rounds."
    )
    for note in notes:
        _emit(note)
    if args.memory:
        _progress(f"[{steps}/{steps}] measuring numpy {args.dtype} memory, L = S = 32768 ...")
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
    _emit(
        f"\nmemory: numpy 1x1x{L}x{L}x64 {dtype}, implementation='auto': peak RSS growth "
        f"{text}, peak of NumPy allocations (tracemalloc) {allocated / 2**20:.1f} MiB "
        f"(inputs {inputs / 2**20:.0f} MiB; one score matrix {scores / 2**30:.0f} GiB)"
    )
