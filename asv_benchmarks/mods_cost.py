"""What ``mask_mod`` and ``bias_mod`` cost on NumPy against their dense peers (the issue's targets).

Usage::

    python asv_benchmarks/mods_cost.py --repeat 5          # B=1, H=8, L=S=4096, E=64, float32
    python asv_benchmarks/mods_cost.py --quick --repeat 3  # L=S=1024, a smoke test in seconds
    python asv_benchmarks/mods_cost.py --repeat 5 --no-vjp --threads 1

Groups of cases, each timed in the same process, one untimed warm-up round and then
``--repeat`` rounds in which the cases of a group are interleaved (each round starting with
the next case, :func:`sdpa_array.lab.cli.bench.interleaved_times`):

* ``document``: ``mask_mod=mods.document(segments, segments)`` (8 documents of L/8 tokens)
  against the same call with the equivalent dense boolean ``mask`` of shape ``(L, S)``; also
  the same mod passed as a prebuilt :class:`~sdpa_array.BlockMask` (the plain function makes
  the blocked kernel classify it on the host at every call) and
  :func:`~sdpa_array.create_block_mask` alone. Target: at least 4x faster than the dense
  mask (goal 6x), without any ``(L, S)`` array.
* ``alibi``: ``bias_mod=mods.alibi(mods.alibi_slopes(H))`` with ``is_causal=True`` against a
  dense precomputed float32 ``bias`` of shape ``(H, L, S)`` (the same values). Target: within
  1.3x of the dense bias (goal 1.1x), without its ``H*L*S`` memory.
* ``vjp``: :func:`~sdpa_array.scaled_dot_product_attention_vjp` with the document mod against
  the dense mask (no target); ``--no-vjp`` leaves it out.

Each row: the median time, its min-max over the rounds, the ratio of the medians to the
group's dense peer (``> 1``: slower than the peer) and the peak of the Python-traced
allocations during one more call (:mod:`tracemalloc`, which sees NumPy's buffers; measured
apart from the timed rounds, tracing slows allocation down). Inputs (and the dense mask or
bias) are made before tracing, so the peak is the call's own working memory; compare it with
``L*S`` bytes (a bool ``(L, S)`` mask) and ``4*L*S`` (one float32 ``(L, S)`` matrix). The max
abs difference of each case against its dense peer is printed once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

import sdpa_array
from sdpa_array import create_block_mask, mods
from sdpa_array.lab.cli.bench import interleaved_times

DOCUMENTS = 8


def peak_traced(call: Callable[[], Any]) -> int:
    """Peak bytes traced by :mod:`tracemalloc` during one call."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def max_diff(a: Any, b: Any) -> float:
    if isinstance(a, tuple):  # VJP: (dq, dk, dv), the peer's extra gradients left out
        return max(max_diff(x, y) for x, y in zip(a, b[: len(a)], strict=True))
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def dense_alibi(slopes: np.ndarray, L: int, S: int) -> np.ndarray:
    """The alibi mod's values as a float32 ``(H, L, S)`` array (rounded as the mod's float64
    values cast to float32, the kernel's cast), one head at a time."""
    distance = np.abs(np.arange(L)[:, None] - np.arange(S)[None, :]).astype(np.float64)
    out = np.empty((len(slopes), L, S), dtype=np.float32)
    for h, slope in enumerate(slopes):
        np.multiply(distance, -slope, out=out[h], casting="same_kind")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--quick", action="store_true", help="L=S=1024: a smoke test")
    parser.add_argument("--length", type=int, default=None, help="L = S (default 4096)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--implementation", default="auto", choices=["auto", "blocked"])
    parser.add_argument("--no-vjp", action="store_true", help="leave the VJP group out")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc calls")
    args = parser.parse_args(argv)
    if args.threads is not None:
        sdpa_array.set_num_threads(args.threads)
    L = args.length or (1024 if args.quick else 4096)
    if L % DOCUMENTS:
        parser.error(f"--length must be a multiple of {DOCUMENTS}")
    H, E, impl = args.heads, args.dim, args.implementation
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, H, L, E), dtype=np.float32) for _ in range(4))
    segments = np.repeat(np.arange(DOCUMENTS), L // DOCUMENTS)
    dense_mask = segments[:, None] == segments[None, :]  # (L, S) bool
    doc = mods.document(segments, segments)
    slopes = mods.alibi_slopes(H)
    alibi = mods.alibi(slopes)
    dense_bias = dense_alibi(slopes, L, L)  # (H, L, S) float32
    block_mask = create_block_mask(doc, None, None, L, L)

    def attn(**kw: Any) -> Callable[[], Any]:
        return lambda: sdpa_array.scaled_dot_product_attention(q, k, v, implementation=impl, **kw)

    def vjp(**kw: Any) -> Callable[[], Any]:
        return lambda: sdpa_array.scaled_dot_product_attention_vjp(
            q, k, v, g, implementation=impl, **kw
        )

    # group -> {case: (callable, peer case or None, compares with the peer's output)}
    groups: dict[str, dict[str, tuple[Callable[[], Any], str | None, bool]]] = {
        "document": {
            "dense bool mask (L,S)": (attn(mask=dense_mask), None, False),
            "mask_mod=document": (attn(mask_mod=doc), "dense bool mask (L,S)", True),
            "mask_mod=BlockMask (prebuilt)": (
                attn(mask_mod=block_mask),
                "dense bool mask (L,S)",
                True,
            ),
            # its ratio is to the plain mod's call (the classification's share of a call)
            "create_block_mask(document)": (
                lambda: create_block_mask(doc, None, None, L, L),
                "mask_mod=document",
                False,
            ),
        },
        "alibi, causal": {
            "dense f32 bias (H,L,S)": (attn(bias=dense_bias, is_causal=True), None, False),
            "bias_mod=alibi": (
                attn(bias_mod=alibi, is_causal=True),
                "dense f32 bias (H,L,S)",
                True,
            ),
        },
    }
    if not args.no_vjp:
        groups["vjp, document"] = {
            "VJP dense bool mask (L,S)": (vjp(mask=dense_mask), None, False),
            "VJP mask_mod=document": (vjp(mask_mod=doc), "VJP dense bool mask (L,S)", True),
            "VJP mask_mod=BlockMask": (
                vjp(mask_mod=block_mask),
                "VJP dense bool mask (L,S)",
                True,
            ),
        }

    print(
        f"NumPy {np.__version__}, float32, B=1 H={H} L=S={L} E={E}, implementation={impl!r}, "
        f"{sdpa_array.get_num_threads()} threads; {args.repeat} interleaved rounds after one "
        "warm-up round"
    )
    print(
        f"block mask: {block_mask.kinds.shape} blocks of {block_mask.block_q}, "
        f"sparsity {block_mask.sparsity:.3f}; L*S = {L * L / 2**20:.1f} MiB (bool), "
        f"4*L*S = {4 * L * L / 2**20:.1f} MiB (float32 (L,S)), dense bias "
        f"{dense_bias.nbytes / 2**20:.0f} MiB"
    )

    # correctness, once (also a warm-up)
    diffs: dict[str, float] = {}
    for cases in groups.values():
        outputs = {name: fn() for name, (fn, _, _) in cases.items()}
        for name, (_, peer, compare) in cases.items():
            if peer is not None and compare:
                diffs[name] = max_diff(outputs[name], outputs[peer])
        del outputs

    header = (
        f"{'case':<32}{'median ms':>11}{'min-max ms':>17}{'x peer':>8}"
        f"{'peak MiB':>10}{'/ L*S':>8}{'max |diff|':>12}"
    )
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    summary: list[str] = []
    for group, cases in groups.items():
        times = interleaved_times(
            {name: fn for name, (fn, _, _) in cases.items()}, lambda _: None, args.repeat, warmup=0
        )
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"[{group}]")
        for name, (fn, peer, _) in cases.items():
            ts = [t * 1e3 for t in times[name]]
            ratio = f"{medians[name] / medians[peer]:.3f}" if peer else "1"
            if args.no_memory:
                mem = rel = "-"
            else:
                peak = peak_traced(fn)
                mem, rel = f"{peak / 2**20:.1f}", f"{peak / (L * L):.2f}"
            diff = f"{diffs[name]:.1e}" if name in diffs else "-"
            print(
                f"{name:<32}{statistics.median(ts):>11.1f}"
                f"{f'{min(ts):.1f}-{max(ts):.1f}':>17}{ratio:>8}{mem:>10}{rel:>8}{diff:>12}"
            )
        for name, (_, peer, _) in cases.items():
            if peer is None or name not in diffs:
                continue
            paired = [p / t for p, t in zip(times[peer], times[name], strict=True)]
            summary.append(
                f"  {name}: {medians[peer] / medians[name]:.2f}x faster than {peer} "
                f"(ratio of medians; per-round ratios {min(paired):.2f}-{max(paired):.2f})"
            )
    print(
        "speed-ups (peer median / case median; issue targets: document >= 4x, goal 6x; "
        "alibi >= 1/1.3 = 0.77x, goal 1/1.1 = 0.91x):"
    )
    print("\n".join(summary))
    print(f"(timing and memory took {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
