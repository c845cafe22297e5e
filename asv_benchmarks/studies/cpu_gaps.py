"""The CPU figures against torch in one table, from one interleaved run, with the command.

NumPy and torch on the CPU, float32, ``--threads`` threads (default 2) everywhere: our NumPy
block pool (:func:`sdpa_array.set_num_threads` and ``SDPA_ARRAY_NUM_THREADS``), NumPy's BLAS
(threadpoolctl) and torch (``torch.set_num_threads``). Every candidate is timed in one loop
of rounds (:func:`sdpa_array.lab.cli.bench.interleaved_times`: one untimed warm-up round,
then ``--rounds`` rounds that call each candidate once, in a new order each round). A
figure is the median of its per-round ratios (the two candidates of a ratio ran in the
same round), with the min-max of those ratios beside it; the candidates' medians and
min-max follow the table. Shapes are ``(B, H, L, E)`` with ``S = L``; ``--quick`` shrinks
every L to 256 (128 stays 128).

1. NumPy ``auto`` / torch's fused CPU kernel, throughput, 1x8x4096x64, not causal: torch's
   ``scaled_dot_product_attention`` on the same memory (``torch.from_numpy`` views,
   :func:`~sdpa_array.lab.cli.bench.torch_sdpa_peer`) / ours (> 1: ours is faster).
2. GEMM-bound fraction, the matrix products alone / our call, same shape. *Tile products*:
   for each (batch, head), query block and key tile of our forward plan (``plan_blocks``
   with ``choose_block_sizes``: 1024 x 256 at L = 4096), ``s = q_blk @ k_blkᵀ; s @ v_blk``,
   the tiles spread over the threads by our call's own pool
   (:func:`~sdpa_array._arrays.parallel.map_blocks`, BLAS on one thread per call).
   *Whole products*: ``(q kᵀ) v`` over the whole (L, S) matrix on the multi-threaded BLAS,
   the ``GEMM-bound`` column of ``python -m sdpa_array bench``. Our kernel also splits the
   products that sum over more than 128 keys (``sdpa_array._arrays.products``), the peers do
   not: the fractions count that split as overhead. *A limit*: the tile products / the same
   tiles' fixed-reference softmax written as a plain NumPy loop (``exp2`` in place, row sums
   as a product with ones, ``P V`` in our chunks), on the same pool: what a NumPy
   implementation of our kernel reaches without the library's layers around the arithmetic.
3. Causal speed-up: our non-causal time / our causal time, same shape. *A limit*: the same
   ratio for the tile products alone, over the tiles of the non-causal and the causal plans
   (rows cut as our calls cut them), which is all a kernel whose other work shrank with the
   pairs would reach.
4. and 5. VJP / torch's backward, 1x8x2048x64, without and with causal:
   :func:`sdpa_array.scaled_dot_product_attention_vjp` against torch's backward of its own
   kernel, its forward graph built untimed once (``make_backward_case`` of
   ``asv_benchmarks/benchmarks/backward.py``, the asv suite's). The VJP recomputes the
   scores; torch's backward does not.
   Beside them, the backward's GEMM-bound limit: the five products of each tile of the
   VJP's plan (``plan_backward``: 128 query rows x all 2048 keys), ``s = q kᵀ``,
   ``dp = dO vᵀ`` (both as transposed products where our kernel computes them so:
   ``sdpa_array._arrays.products.scores``), ``sᵀ dO``, ``dp k``, ``dpᵀ q``, on the pool as
   in 2, / torch's non-causal
   backward: the best VJP / torch ratio our products allow (torch's run on MKL, ours on
   NumPy's OpenBLAS).
6. torch via ``auto`` / torch called directly: torch tensors through
   :func:`sdpa_array.scaled_dot_product_attention` (delegated to torch's kernel) against
   torch's function, as throughput (torch's time / ours), at 1x8x1024x64 and at 1x8x128x64,
   where the per-call validation and planning show (``--calls`` calls per candidate there,
   ``--calls-mid`` at 1024).

torch's OpenMP workers spin for a while after each call and may slow the NumPy call after
them; ``OMP_WAIT_POLICY=passive`` rules that out (the header says what was set). The
accuracy figures are ``asv_benchmarks/studies/accuracy_gaps.py``'s. Usage::

    python asv_benchmarks/studies/cpu_gaps.py --rounds 7
    python asv_benchmarks/studies/cpu_gaps.py --quick --rounds 2   # a smoke test, seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_info, threadpool_limits

import sdpa_array
from sdpa_array._arrays.parallel import ENV_VAR, map_blocks
from sdpa_array._arrays.products import matmul, scores, transposes
from sdpa_array._kernels.restrictions import Restrictions
from sdpa_array._kernels.tiling import (
    block_scores,
    choose_block_sizes,
    plan_backward,
    plan_blocks,
)
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import validate
from sdpa_array.lab.cli.bench import interleaved_times, make_inputs, torch_sdpa_peer, two_products
from sdpa_array.testing.backends import get_backend

# The asv suite's backward case (``asv_benchmarks/benchmarks/backward.py``): its package
# ``benchmarks`` sits in this script's parent folder, whatever the working directory.
SUITE = Path(__file__).resolve().parents[1]
if str(SUITE) not in sys.path:
    sys.path.insert(0, str(SUITE))

from benchmarks.backward import PEER, make_backward_case  # noqa: E402

Candidates = dict[str, Callable[[], Any]]

#: Row 6's figure, at two shapes.
VIA_AUTO = "torch via `auto` / torch called directly"

#: (figure, numerator, denominator, target): each figure is numerator time / denominator time.
ROWS = [
    ("NumPy `auto` / torch's fused CPU kernel, throughput", "torch fwd", "ours fwd", "≥ 0.85"),
    ("GEMM-bound fraction (tile products alone / our call)", "fwd tiles", "ours fwd", "≥ 0.85"),
    ("GEMM-bound fraction, whole (L,S) products (`bench`)", "fwd (L,S)", "ours fwd", "-"),
    (
        "GEMM-bound fraction of the same tiles' softmax in plain NumPy (a limit)",
        "fwd tiles",
        "fwd loop",
        "-",
    ),
    ("causal speed-up over the same call without causal", "ours fwd", "ours causal", "≥ 1.8"),
    ("causal speed-up of the tile products alone (a limit)", "fwd tiles", "fwd tiles causal", "-"),
    ("VJP / torch's backward time, non-causal", "ours VJP", "torch bwd", "≤ 1.2"),
    ("VJP / torch's backward time, causal", "ours VJP causal", "torch bwd causal", "≤ 1.2"),
    ("backward GEMM-bound limit (5 tile products / torch)", "bwd tiles", "torch bwd", "-"),
    (VIA_AUTO, "torch direct", "torch via auto", "≥ 0.95"),
    (VIA_AUTO, "torch direct small", "torch via auto small", "≥ 0.95"),
]


def _tiles_on_pool(
    work: Callable[[Any], Any], items: list[Any], costs: list[int] | None = None
) -> Callable[[], Any]:
    """Run ``work`` on each item with the pool (and one-thread BLAS) of our NumPy calls,
    costliest first as they take our query blocks."""
    return lambda: map_blocks(np, work, items, costs)


def forward_tiles(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = False, loop: bool = False
) -> tuple[Callable[[], Any], str]:
    """The two products of every tile of our forward plan (``plan_blocks`` with the rows cut
    as our fixed-reference calls cut them), and the tile size. With ``loop``, the whole
    fixed-reference softmax of a non-causal call in plain NumPy on the same tiles: ``exp2``
    in place, row sums as a product with ones, ``P V`` in our chunks
    (``sdpa_array._arrays.products.matmul``), the sums added and divided at the end: the
    work of our kernel without its layers (validation, operands, score terms, in-place
    checks)."""
    if loop and causal:
        raise ValueError("the plain NumPy loop is the non-causal call's")
    p = validate(q, k, v, Options(is_causal=causal))
    bq, bk = choose_block_sizes(p)
    blocks = plan_blocks(Restrictions((p.band,), p.L, p.S), bq, bk, cut_rows=True)
    heads = [(b, h) for b in range(q.shape[0]) for h in range(q.shape[1])]
    factor = np.float32(q.shape[-1] ** -0.5 * np.log2(np.e))
    ones = np.ones((bk, 1), dtype=q.dtype)

    def work(item: Any) -> Any:
        (b, h), block = item
        rows, out = q[b, h, block.start : block.stop], None
        for t in block.tiles:
            r0, r1 = t.rows or (block.start, block.stop)
            s = rows[r0 - block.start : r1 - block.start] @ k[b, h, t.start : t.stop].T
            out = s @ v[b, h, t.start : t.stop]
        return out

    def softmax(item: Any) -> Any:
        (b, h), block = item
        rows, acc, total = q[b, h, block.start : block.stop] * factor, None, None
        for t in block.tiles:
            e = rows @ k[b, h, t.start : t.stop].T
            np.exp2(e, out=e)
            part = matmul(np, e, v[b, h, t.start : t.stop], whole=p.S)
            sums = e @ ones[: t.stop - t.start]
            if acc is None:
                acc, total = part, sums
            else:
                acc += part
                total += sums
        return acc / total

    items = [(bh, blk) for bh in heads for blk in blocks]
    costs = [block_scores(blk) for _, blk in items]
    return _tiles_on_pool(softmax if loop else work, items, costs), f"{bq}x{bk}"


def backward_tiles(q: Any, k: Any, v: Any, g: Any) -> tuple[Callable[[], Any], str]:
    """The five products of every tile of our (non-causal) backward plan, and the tile size."""
    p = validate(q, k, v, Options())
    plan = plan_backward(p, Restrictions((p.band,), p.L, p.S))
    heads = [(b, h) for b in range(q.shape[0]) for h in range(q.shape[1])]

    def work(item: Any) -> Any:
        (b, h), block = item
        rows, grads, out = q[b, h, block.start : block.stop], g[b, h, block.start : block.stop], ()
        for start, stop in block.tiles:
            keys, values = k[b, h, start:stop], v[b, h, start:stop]
            wide = transposes(np, rows, keys)  # laid out as our kernel lays them out
            s = scores(np, rows, keys, transposed=wide)  # the scores (P)
            dp = scores(np, grads, values, transposed=wide)  # dP (dS)
            out = (s.T @ grads, dp @ keys, dp.T @ rows)  # dV, dQ, dK
        return out

    items = [(bh, blk) for bh in heads for blk in plan.blocks]
    return _tiles_on_pool(work, items), f"{plan.block_q}x{plan.width}"


def _repeated(fn: Callable[[], Any], calls: int) -> Callable[[], Any]:
    def run() -> Any:
        for _ in range(calls):
            out = fn()
        return out

    return run


def build(args: argparse.Namespace) -> tuple[Candidates, dict[str, str], dict[str, int]]:
    """The candidates, a shape text per candidate and the calls each one makes."""
    fwd, bwd, mid = (256, 256, 256) if args.quick else (4096, 2048, 1024)
    numpy_backend = get_backend("numpy")
    q, k, v = make_inputs(numpy_backend, (1, 8, fwd, 64), "float32")
    torch_fwd = torch_sdpa_peer(numpy_backend)
    f = sdpa_array.scaled_dot_product_attention
    fwd_tiles, fwd_tile = forward_tiles(q, k, v)
    cands: Candidates = {
        "ours fwd": lambda: f(q, k, v),
        "torch fwd": lambda: torch_fwd(q, k, v),
        "ours causal": lambda: f(q, k, v, is_causal=True),
        "fwd tiles": fwd_tiles,
        "fwd tiles causal": forward_tiles(q, k, v, causal=True)[0],
        "fwd loop": forward_tiles(q, k, v, loop=True)[0],
        "fwd (L,S)": lambda: two_products(q, k, v),
    }
    shapes = dict.fromkeys(cands, f"1x8x{fwd}x64")
    for name in ("fwd tiles", "fwd tiles causal", "fwd loop"):
        shapes[name] += f", {fwd_tile} tiles"
    for name in ("ours causal", "fwd tiles causal"):
        shapes[name] += "-causal"
    text = f"1x8x{bwd}x64"
    for name, impl, shape in [
        ("ours VJP", "auto", text),
        ("torch bwd", PEER, text),
        ("ours VJP causal", "auto", text + "-causal"),
        ("torch bwd causal", PEER, text + "-causal"),
    ]:
        cands[name], shapes[name] = make_backward_case("numpy", "float32", impl, shape).run, shape
    # the inputs and cotangent make_backward_case drew (the same seeds)
    xq, xk, xv = make_inputs(numpy_backend, (1, 8, bwd, 64), "float32")
    xg = make_inputs(numpy_backend, (1, 8, bwd, 64), "float32", seed=1)[0]
    cands["bwd tiles"], tile = backward_tiles(xq, xk, xv, xg)
    shapes["bwd tiles"] = f"{text}, {tile} tiles"
    calls = dict.fromkeys(cands, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for suffix, length, n in [("", mid, args.calls_mid), (" small", 128, args.calls)]:
        tq, tk, tv = make_inputs(get_backend("torch"), (1, 8, length, 64), "float32")
        route = sdpa_array.explain(tq, tk, tv).forward
        if route != "native":
            print(f"warning: torch tensors of length {length} take the {route} path", flush=True)
        cands[f"torch via auto{suffix}"] = _repeated(lambda q=tq, k=tk, v=tv: f(q, k, v), n)
        cands[f"torch direct{suffix}"] = _repeated(lambda q=tq, k=tk, v=tv: sdpa(q, k, v), n)
        for name in (f"torch via auto{suffix}", f"torch direct{suffix}"):
            shapes[name], calls[name] = f"1x8x{length}x64 (torch)", n
    return cands, shapes, calls


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(args: argparse.Namespace, command: str) -> str:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        built = f"{blas.get('name')} {blas.get('version')}"
    except (KeyError, TypeError):
        built = "unknown"
    running = ", ".join(
        f"{os.path.basename(os.path.dirname(i['filepath']))}: {i['internal_api']} "
        f"{i.get('version')} {i.get('architecture', '')} ({i['num_threads']} threads)"
        for i in threadpool_info()
        if i["user_api"] == "blas"
    )
    return "\n".join(
        [
            f"# CPU figures against torch: `{command}`",
            f"CPU: {_cpu_model()}, {os.cpu_count()} CPUs ({usable} usable), {platform.system()}",
            f"NumPy {np.__version__}, BLAS {built}; loaded: {running}",
            f"torch {torch.__version__} (MKL {torch.backends.mkl.is_available()}), "
            f"{torch.get_num_threads()} threads; sdpa_array {sdpa_array.__version__}, "
            f"{sdpa_array.get_num_threads()} block threads; OMP_WAIT_POLICY="
            f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}",
            f"float32, {args.rounds} interleaved rounds after one warm-up round"
            + (" (--quick: small shapes, not the figures' shapes)" if args.quick else ""),
        ]
    )


def _ms(seconds: list[float], calls: int) -> str:
    t = [s * 1e3 / calls for s in seconds]
    d = 3 if statistics.median(t) < 1 else 2 if statistics.median(t) < 10 else 1
    return f"{statistics.median(t):.{d}f} ({min(t):.{d}f}-{max(t):.{d}f})"


def report(times: dict[str, list[float]], shapes: dict[str, str], calls: dict[str, int]) -> None:
    print("\n| figure | measured (median) | per-round min-max | target |\n|---|---|---|---|")
    for figure, num, den, target in ROWS:
        ratios = [a / b for a, b in zip(times[num], times[den], strict=True)]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        label = f"{figure} [{shapes[den]}]"
        print(f"| {label} | {statistics.median(ratios):.2f} | {spread} | {target} |")
    print(
        "\nmeasured: the median over the rounds of the ratio of the two candidates' times in "
        "the same round (not a ratio of medians); shapes in brackets are the denominator's. "
        "The backward GEMM-bound limit (the VJP's five tile products alone / torch's "
        "non-causal backward) is the lowest non-causal VJP / torch ratio our products allow: "
        "torch's products run on MKL, ours on NumPy's OpenBLAS."
    )
    print("\n| candidate | shape | ms per call, median (min-max) |\n|---|---|---|")
    for name, seconds in times.items():
        n = calls[name]
        shape = shapes[name] + (f", {n} calls per round" if n > 1 else "")
        print(f"| {name} | {shape} | {_ms(seconds, n)} |")
    print(
        "\nAccuracy rows: not measured here; "
        "`python asv_benchmarks/studies/accuracy_gaps.py --seeds 3`."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--threads", type=int, default=2, help="NumPy, BLAS and torch threads")
    ap.add_argument("--quick", action="store_true", help="L = 256: a smoke test (seconds)")
    ap.add_argument("--calls", type=int, default=None, help="calls per round at L = 128")
    ap.add_argument(
        "--calls-mid", type=int, default=5, help="calls per round at L = 1024 (default 5)"
    )
    args = ap.parse_args(argv)
    args.calls = args.calls or (5 if args.quick else 50)
    command = " ".join(
        ["python asv_benchmarks/studies/cpu_gaps.py", *(sys.argv[1:] if argv is None else argv)]
    )
    os.environ[ENV_VAR] = str(args.threads)
    sdpa_array.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        print(header(args, command), flush=True)
        print("building and warming up the candidates ...", file=sys.stderr, flush=True)
        cands, shapes, calls = build(args)
        print(f"timing {len(cands)} candidates ...", file=sys.stderr, flush=True)
        times = interleaved_times(cands, lambda _: None, args.rounds)
    report(times, shapes, calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
