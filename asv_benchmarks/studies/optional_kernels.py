"""What optional kernels would give the NumPy path: torch's on NumPy memory, numexpr, SciPy's BLAS.

NumPy float32, ``--threads`` threads (default 2) everywhere: our NumPy block pool
(:func:`sdpa_array.set_num_threads` and ``SDPA_ARRAY_NUM_THREADS``), NumPy's BLAS
(threadpoolctl), torch (``torch.set_num_threads``); numexpr runs on one thread per tile on
our pool, as the BLAS does there. Every candidate is timed in one loop of rounds
(:func:`sdpa_array.lab.cli.bench.interleaved_times`: one untimed warm-up round, then
``--rounds`` rounds that call each candidate once, in a new order each round). A ratio is
the median of its per-round ratios (both candidates ran in the same round), with their
min-max; the candidates' medians and min-max follow. Shapes are ``(B, H, L, E)``, ``S = L``.

(a) and (b), the whole call. Our :func:`sdpa_array.scaled_dot_product_attention` (``auto``)
at 1x8x4096x64 and :func:`sdpa_array.scaled_dot_product_attention_vjp` at 1x8x2048x64,
without and with ``is_causal``,
against what a route "torch's kernel on NumPy memory" would cost: torch's
``scaled_dot_product_attention`` on ``torch.from_numpy`` views of the same arrays, with the
result back as NumPy (``.numpy()``, no copy); for the VJP, the forward under autograd and
``torch.autograd.grad`` with the cotangent, as the library's native torch VJP does (the
forward recomputed, as our VJP recomputes the scores), the three gradients back as NumPy.
Both again at 1x8x128x64 to 1x8x1024x64 (:data:`SMALL`), several calls per round, where
the calls' fixed costs show.

(c) the forward's exponentials and row sums, on the tiles of our forward plan
(``choose_block_sizes``: 1024 x 256 at L = 4096; every (batch, head), query block and key
tile, on our call's pool, :func:`~sdpa_array._arrays.parallel.map_blocks`). Each tile's
scores are one of 16 stored score tiles (the values are the call's scaled scores in base
2); the exponentials go to a per-tile scratch (no restore of the scores is timed):

* *NumPy exp2 + ones product* (our kernel's step at this size, the fixed reference):
  ``np.exp2(s, out=e)``, row sums as ``e @ ones``;
* *NumPy exp(s - m) + sum*: the plain form, ``np.subtract(s, m, out=e)``,
  ``np.exp(e, out=e)``, ``e.sum(axis=1)``;
* *numexpr exp + ones product*: ``numexpr.evaluate("exp(s * ln2)", out=e)`` (numexpr has
  no ``exp2``), row sums as ours;
* *numexpr exp(s - m) + numexpr sum*: ``evaluate("exp(s - m)", out=e)`` and
  ``evaluate("sum(e, axis=1)")`` (numexpr cannot write ``e`` and reduce it in one
  expression: no fused form exists).

(d) the accumulating products: the forward's ``acc += P V`` per tile (1024 x 256 by 256 x 64
into 1024 x 64) and the VJP's ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` per block of its plan
(``plan_backward``: 128 query rows x 2048 keys, 2048 x 128 by 128 x 64 into each (batch,
head)'s 2048 x 64), on the pool:

* *NumPy product then +=*: ``acc += a @ b``; for the forward also with our split of the
  256-key sum into two 128-key chunks (``sdpa_array._arrays.products.matmul``), which our
  kernel does for accuracy;
* *SciPy sgemm beta=1*: ``scipy.linalg.blas.sgemm(1, ..., beta=1, c=accᵀ, overwrite_c=1)``
  on the Fortran-ordered transposes of the same C arrays (no copy), one 256-key chain.

The steps run once more on the calling thread alone (BLAS on one thread), over one head's
tiles (``1t``): numexpr's ``evaluate`` and SciPy's BLAS may not run in parallel on our pool
as NumPy's do, which these rows separate from the kernels' own speed.

For (c) and (d) the table gives each step's time as a fraction of our call's (same round),
and the most the whole call would save by the faster form: (NumPy step - optional step) /
our call. Usage::

    python asv_benchmarks/studies/optional_kernels.py --rounds 7
    python asv_benchmarks/studies/optional_kernels.py --quick --rounds 2   # a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numexpr
import numpy as np
import torch
from scipy.linalg.blas import sgemm
from threadpoolctl import threadpool_info, threadpool_limits

import sdpa_array
from sdpa_array._arrays.parallel import ENV_VAR, map_blocks
from sdpa_array._arrays.products import matmul
from sdpa_array._kernels.restrictions import Restrictions
from sdpa_array._kernels.tiling import choose_block_sizes, plan_backward, plan_blocks
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import validate
from sdpa_array.lab.cli.bench import interleaved_times, make_inputs
from sdpa_array.testing.backends import get_backend

Candidates = dict[str, Callable[[], Any]]

#: SIMD flags of /proc/cpuinfo worth naming in the header.
SIMD = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")

#: (figure, numerator, denominator): each figure is numerator time / denominator time.
RATIOS = [
    ("(b) torch on NumPy memory / ours, forward", "torch fwd", "ours fwd"),
    ("(b) torch on NumPy memory / ours, VJP", "torch VJP", "ours VJP"),
    ("(b) torch on NumPy memory / ours, forward, causal", "torch fwd causal", "ours fwd causal"),
    ("(b) torch on NumPy memory / ours, VJP, causal", "torch VJP causal", "ours VJP causal"),
    ("(c) NumPy exp2 + ones product / our forward", "np exp2", "ours fwd"),
    ("(c) NumPy exp(s - m) + sum / our forward", "np exp-m sum", "ours fwd"),
    ("(c) numexpr exp + ones product / our forward", "ne exp", "ours fwd"),
    ("(c) numexpr exp(s - m) + numexpr sum / our forward", "ne exp-m sum", "ours fwd"),
    ("(c) numexpr exp / NumPy exp2 (the step alone)", "ne exp", "np exp2"),
    ("(d) NumPy acc += P V, our 128-key split / our forward", "np PV split", "ours fwd"),
    ("(d) NumPy acc += P V, one chain / our forward", "np PV", "ours fwd"),
    ("(d) sgemm beta=1 P V / our forward", "sgemm PV", "ours fwd"),
    ("(d) sgemm beta=1 / NumPy, P V (the step alone, our split)", "sgemm PV", "np PV split"),
    ("(c) numexpr exp / NumPy exp2, one head on one thread", "ne exp 1t", "np exp2 1t"),
    ("(d) sgemm beta=1 / NumPy P V, one head on one thread", "sgemm PV 1t", "np PV split 1t"),
    ("(d) NumPy dV, dK += / our VJP", "np dKdV", "ours VJP"),
    ("(d) sgemm beta=1 dV, dK / our VJP", "sgemm dKdV", "ours VJP"),
    ("(d) sgemm beta=1 / NumPy, dV and dK (the step alone)", "sgemm dKdV", "np dKdV"),
]

#: (saving, NumPy step, optional step, our call): the most the call would save.
SAVINGS = [
    ("(c) numexpr exp for our exp2", "np exp2", "ne exp", "ours fwd"),
    (
        "(c) numexpr exp(s - m) + sum for our exp2 + ones product",
        "np exp2",
        "ne exp-m sum",
        "ours fwd",
    ),
    ("(d) sgemm beta=1 for our split P V and +=", "np PV split", "sgemm PV", "ours fwd"),
    ("(d) sgemm beta=1 for the VJP's dV, dK and +=", "np dKdV", "sgemm dKdV", "ours VJP"),
]


def torch_forward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False
) -> Callable[[], np.ndarray]:
    """torch's kernel on ``torch.from_numpy`` views, the output back as NumPy."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run() -> np.ndarray:
        views = (torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
        return sdpa(*views, is_causal=causal).numpy()

    return run


def torch_vjp(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, causal: bool = False
) -> Callable[[], Any]:
    """The forward under autograd and torch's backward, on NumPy memory, the grads as NumPy."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run() -> tuple[np.ndarray, ...]:
        leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            out = sdpa(*leaves, is_causal=causal)
            grads = torch.autograd.grad(out, leaves, torch.from_numpy(g))
        return tuple(x.numpy() for x in grads)

    return run


def forward_steps(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[Candidates, str]:
    """(c) and (d) on the tiles of our forward plan, and the tile size."""
    p = validate(q, k, v, Options())
    bq, bk = choose_block_sizes(p)
    blocks = plan_blocks(Restrictions((p.band,), p.L, p.S), bq, bk, cut_rows=True)
    heads = [(b, h) for b in range(q.shape[0]) for h in range(q.shape[1])]
    items = [(bh, blk) for bh in heads for blk in blocks]
    unit = np.float32(q.shape[-1] ** -0.5 * np.log2(np.e))
    # the call's scaled scores in base 2, for the first head's first query block
    rows = q[0, 0, :bq] * unit
    stored = [rows @ k[0, 0, t.start : t.stop].T for t in blocks[0].tiles]
    width = stored[0].shape[1]
    ones = np.ones((width, 1), dtype=q.dtype)
    ln2 = np.float32(np.log(2.0))
    # the row maxima (in base 2) of each stored tile, for the forms with a shift
    shifts = [s.max(axis=1, keepdims=True) for s in stored]
    weights = [np.exp2(s - m) for s, m in zip(stored, shifts, strict=True)]

    def tiles(
        step: Callable[[int, Any, np.ndarray, Any], Any], serial: bool = False
    ) -> Callable[[], Any]:
        def work(item: Any) -> Any:
            (b, h), block = item
            acc = np.zeros((block.stop - block.start, v.shape[-1]), dtype=q.dtype)
            e = np.empty_like(stored[0])
            for i, t in enumerate(block.tiles):
                step(i % len(stored), (b, h, t), e, acc)
            return acc

        def one_thread() -> Any:
            with threadpool_limits(limits=1, user_api="blas"):
                return [work(item) for item in items[: len(blocks)]]

        return one_thread if serial else lambda: map_blocks(np, work, items)

    def np_exp2(i: int, _: Any, e: np.ndarray, __: Any) -> Any:
        np.exp2(stored[i], out=e)
        return e @ ones

    def np_exp_sum(i: int, _: Any, e: np.ndarray, __: Any) -> Any:
        np.subtract(stored[i], shifts[i], out=e)
        np.exp(e, out=e)
        return e.sum(axis=1)

    def ne_exp(i: int, _: Any, e: np.ndarray, __: Any) -> Any:
        numexpr.evaluate("exp(s * ln2)", local_dict={"s": stored[i], "ln2": ln2}, out=e)
        return e @ ones

    def ne_exp_sum(i: int, _: Any, e: np.ndarray, __: Any) -> Any:
        numexpr.evaluate("exp(s - m)", local_dict={"s": stored[i], "m": shifts[i]}, out=e)
        return numexpr.evaluate("sum(e, axis=1)", local_dict={"e": e})

    def np_pv_split(i: int, where: Any, _: Any, acc: np.ndarray) -> None:
        b, h, t = where
        acc += matmul(np, weights[i], v[b, h, t.start : t.stop], whole=p.S)

    def np_pv(i: int, where: Any, _: Any, acc: np.ndarray) -> None:
        b, h, t = where
        acc += weights[i] @ v[b, h, t.start : t.stop]

    def sgemm_pv(i: int, where: Any, _: Any, acc: np.ndarray) -> None:
        # accᵀ += vᵀ Pᵀ: the C arrays' transposes are Fortran-ordered, no copy
        b, h, t = where
        sgemm(1.0, v[b, h, t.start : t.stop].T, weights[i].T, 1.0, acc.T, overwrite_c=1)

    cands = {
        "np exp2": tiles(np_exp2),
        "np exp-m sum": tiles(np_exp_sum),
        "ne exp": tiles(ne_exp),
        "ne exp-m sum": tiles(ne_exp_sum),
        "np PV split": tiles(np_pv_split),
        "np PV": tiles(np_pv),
        "sgemm PV": tiles(sgemm_pv),
        "np exp2 1t": tiles(np_exp2, serial=True),
        "ne exp 1t": tiles(ne_exp, serial=True),
        "np PV split 1t": tiles(np_pv_split, serial=True),
        "sgemm PV 1t": tiles(sgemm_pv, serial=True),
    }
    return cands, f"{bq}x{bk}"


def backward_steps(q: np.ndarray, k: np.ndarray, g: np.ndarray) -> tuple[Candidates, str]:
    """(d) for the VJP: ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` per block of its plan."""
    p = validate(q, k, k, Options())
    plan = plan_backward(p, Restrictions((p.band,), p.L, p.S))
    heads = [(b, h) for b in range(q.shape[0]) for h in range(q.shape[1])]
    rng = np.random.default_rng(2)
    n = plan.block_q
    probs = rng.random((n, p.S), dtype=np.float32)  # the block's P (and dS: same shape)
    dscores = rng.standard_normal((n, p.S), dtype=np.float32)

    def numpy_work(bh: Any) -> Any:
        b, h = bh
        dk, dv = np.zeros((p.S, p.E), q.dtype), np.zeros((p.S, p.E), q.dtype)
        for block in plan.blocks:
            rows, grads = q[b, h, block.start : block.stop], g[b, h, block.start : block.stop]
            dv += probs.T @ grads
            dk += dscores.T @ rows
        return dk, dv

    def sgemm_work(bh: Any) -> Any:
        b, h = bh
        dk, dv = np.zeros((p.S, p.E), q.dtype), np.zeros((p.S, p.E), q.dtype)
        for block in plan.blocks:
            rows, grads = q[b, h, block.start : block.stop], g[b, h, block.start : block.stop]
            # dVᵀ += dOᵀ P: P's transpose (S, n) is Fortran-ordered, taken transposed
            sgemm(1.0, grads.T, probs.T, 1.0, dv.T, overwrite_c=1, trans_b=1)
            sgemm(1.0, rows.T, dscores.T, 1.0, dk.T, overwrite_c=1, trans_b=1)
        return dk, dv

    cands = {
        "np dKdV": lambda: map_blocks(np, numpy_work, heads),
        "sgemm dKdV": lambda: map_blocks(np, sgemm_work, heads),
    }
    return cands, f"{plan.block_q}x{plan.width}"


#: (b) at smaller lengths: (L, calls per round), where the calls' fixed costs show.
SMALL = [(128, 50), (256, 20), (512, 10), (1024, 3)]


def _repeated(fn: Callable[[], Any], calls: int) -> Callable[[], Any]:
    def run() -> Any:
        for _ in range(calls):
            out = fn()
        return out

    return run


def small_calls(quick: bool) -> tuple[Candidates, dict[str, str], dict[str, int]]:
    """(a) and (b) at the lengths of :data:`SMALL`, ``calls`` calls per round each."""
    backend = get_backend("numpy")
    f = sdpa_array.scaled_dot_product_attention
    vjp = sdpa_array.scaled_dot_product_attention_vjp
    cands: Candidates = {}
    shapes: dict[str, str] = {}
    calls: dict[str, int] = {}
    for length, n in SMALL:
        n = 2 if quick else n
        q, k, v = make_inputs(backend, (1, 8, length, 64), "float32")
        g = make_inputs(backend, (1, 8, length, 64), "float32", seed=1)[0]
        pairs = {
            f"ours fwd {length}": lambda q=q, k=k, v=v: f(q, k, v),
            f"torch fwd {length}": torch_forward(q, k, v),
            f"ours VJP {length}": lambda q=q, k=k, v=v, g=g: vjp(q, k, v, g),
            f"torch VJP {length}": torch_vjp(q, k, v, g),
        }
        for name, fn in pairs.items():
            cands[name], shapes[name], calls[name] = _repeated(fn, n), f"1x8x{length}x64", n
    return cands, shapes, calls


def check(cands: Candidates) -> None:
    """The optional forms compute what the NumPy forms compute (same tiles, same sums)."""
    for a, b in [("np PV", "sgemm PV"), ("np dKdV", "sgemm dKdV")]:
        for x, y in zip(np.asarray(cands[a]()), np.asarray(cands[b]()), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-3)


def build(args: argparse.Namespace) -> tuple[Candidates, dict[str, str], dict[str, int]]:
    fwd, bwd = (256, 256) if args.quick else (4096, 2048)
    backend = get_backend("numpy")
    q, k, v = make_inputs(backend, (1, 8, fwd, 64), "float32")
    xq, xk, xv = make_inputs(backend, (1, 8, bwd, 64), "float32")
    xg = make_inputs(backend, (1, 8, bwd, 64), "float32", seed=1)[0]
    f = sdpa_array.scaled_dot_product_attention
    vjp = sdpa_array.scaled_dot_product_attention_vjp
    cands: Candidates = {
        "ours fwd": lambda: f(q, k, v),
        "torch fwd": torch_forward(q, k, v),
        "ours VJP": lambda: vjp(xq, xk, xv, xg),
        "torch VJP": torch_vjp(xq, xk, xv, xg),
        "ours fwd causal": lambda: f(q, k, v, is_causal=True),
        "torch fwd causal": torch_forward(q, k, v, causal=True),
        "ours VJP causal": lambda: vjp(xq, xk, xv, xg, is_causal=True),
        "torch VJP causal": torch_vjp(xq, xk, xv, xg, causal=True),
    }
    fwd_text, bwd_text = f"1x8x{fwd}x64", f"1x8x{bwd}x64"
    shapes = {name: fwd_text for name in cands if "fwd" in name}
    shapes.update({name: bwd_text for name in cands if "VJP" in name})
    for name in cands:
        shapes[name] += "-causal" if "causal" in name else ""
    steps, tile = forward_steps(q, k, v)
    cands.update(steps)
    shapes.update(dict.fromkeys(steps, f"{fwd_text}, {tile} tiles"))
    for name in steps:
        shapes[name] += ", one head, one thread" if name.endswith(" 1t") else ""
    steps, tile = backward_steps(xq, xk, xg)
    cands.update(steps)
    shapes.update(dict.fromkeys(steps, f"{bwd_text}, {tile} blocks"))
    check(cands)
    calls = dict.fromkeys(cands, 1)
    small, small_shapes, small_counts = small_calls(args.quick)
    cands.update(small)
    shapes.update(small_shapes)
    calls.update(small_counts)
    return cands, shapes, calls


def _cpu() -> tuple[str, str]:
    model, flags = platform.processor() or platform.machine(), "unknown"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = " ".join(flag for flag in SIMD if flag in have)
                    break
    except OSError:
        pass
    return model, flags


def header(args: argparse.Namespace, command: str) -> str:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    model, flags = _cpu()
    running = ", ".join(
        f"{os.path.basename(os.path.dirname(i['filepath']))}: {i['internal_api']} "
        f"{i.get('version')} {i.get('architecture', '')} ({i['num_threads']} threads)"
        for i in threadpool_info()
        if i["user_api"] == "blas"
    )
    return "\n".join(
        [
            f"# Optional kernels for the NumPy path: `{command}`",
            f"CPU: {model}, {os.cpu_count()} CPUs ({usable} usable), {platform.system()}; "
            f"SIMD flags: {flags}",
            f"NumPy {np.__version__}; BLAS loaded: {running}",
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; numexpr "
            f"{numexpr.__version__} (1 thread per tile on our pool); sdpa_array "
            f"{sdpa_array.__version__}, {sdpa_array.get_num_threads()} block threads; "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
            f"float32, {args.rounds} interleaved rounds after one warm-up round"
            + (" (--quick: small shapes, not the figures' shapes)" if args.quick else ""),
        ]
    )


def _ratio(times: dict[str, list[float]], num: str, den: str) -> list[float]:
    return [a / b for a, b in zip(times[num], times[den], strict=True)]


def report(times: dict[str, list[float]], shapes: dict[str, str], calls: dict[str, int]) -> None:
    print("\n| ratio | median | per-round min-max |\n|---|---|---|")
    small = [
        (
            f"(b) torch on NumPy memory / ours, {kind}, 1x8x{n}x64",
            f"torch {kind} {n}",
            f"ours {kind} {n}",
        )
        for n, _ in SMALL
        for kind in ("fwd", "VJP")
    ]
    for figure, num, den in RATIOS + small:
        r = _ratio(times, num, den)
        print(f"| {figure} | {statistics.median(r):.3f} | {min(r):.3f}-{max(r):.3f} |")
    print("\n| the most the call would save | median | per-round min-max |\n|---|---|---|")
    for figure, base, alt, call in SAVINGS:
        r = [(a - b) / c for a, b, c in zip(times[base], times[alt], times[call], strict=True)]
        print(f"| {figure} | {statistics.median(r):+.3f} | {min(r):+.3f} to {max(r):+.3f} |")
    print("\n| candidate | shape | ms per call, median (min-max) |\n|---|---|---|")
    for name, seconds in times.items():
        t = [s * 1e3 / calls[name] for s in seconds]
        med = statistics.median(t)
        shape = shapes[name] + (f", {calls[name]} calls per round" if calls[name] > 1 else "")
        print(f"| {name} | {shape} | {med:.2f} ({min(t):.2f}-{max(t):.2f}) |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--threads", type=int, default=2, help="NumPy, BLAS and torch threads")
    ap.add_argument("--quick", action="store_true", help="L = 256: a smoke test (seconds)")
    args = ap.parse_args(argv)
    command = " ".join(
        [
            "python asv_benchmarks/studies/optional_kernels.py",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    os.environ[ENV_VAR] = str(args.threads)
    sdpa_array.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    numexpr.set_num_threads(1)
    get_backend("torch").configure()  # pins matmul precision (no TF32)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        print(header(args, command), flush=True)
        print("building and checking the candidates ...", file=sys.stderr, flush=True)
        cands, shapes, calls = build(args)
        print(f"timing {len(cands)} candidates ...", file=sys.stderr, flush=True)
        times = interleaved_times(cands, lambda _: None, args.rounds)
    report(times, shapes, calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
