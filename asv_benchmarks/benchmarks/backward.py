"""Backward pass: the VJP's time, its time relative to torch's native backward, its memory.

Parametrized like the forward benchmarks (:mod:`.bench_attention`): backend (the registry's
ids), dtype, implementation and shape from :mod:`.common`. Ours are
``scaled_dot_product_attention_vjp`` with ``implementation`` ``"auto"``, ``"materialized"``
and ``"blocked"``; the peer ``torch-backward`` is torch's own backward pass of
``torch.nn.functional.scaled_dot_product_attention`` on the same memory (NumPy arrays viewed
as tensors), with the forward graph built in ``setup`` so that only the backward is timed,
as ``out.backward(grad)`` would be in training.

The VJP recomputes what it needs from ``query``, ``key`` and ``value`` (it is not given the
forward's output), so it is compared with a backward pass that had its forward for free.
"""

from __future__ import annotations

import statistics
from typing import Any, ClassVar

import numpy as np

from sdpa_array import scaled_dot_product_attention_vjp

from .common import (
    BACKEND_IDS,
    DTYPES,
    FULL,
    LONG_LENGTHS,
    MAX_SCORE_BYTES,
    TRACK_ROUNDS,
    Case,
    Shape,
    backend_for,
    interleaved_times,
    make_inputs,
    peak_rss_growth,
)

OURS = ["auto", "materialized", "blocked"]
PEER = "torch-backward"
IMPLEMENTATIONS = [*OURS, PEER]

#: The backward target's shape (B=1, H=8, L=S=2048, E=64), with and without ``is_causal``.
TARGET_SHAPES = ["1x8x2048x64", "1x8x2048x64-causal"]
#: The full profile: the target and L=S=4096; the quick profile: L=S=512, like the forward's.
SHAPES = (
    [*TARGET_SHAPES, "1x8x4096x64", "1x8x4096x64-causal"]
    if FULL
    else ["1x8x512x64", "1x8x512x64-causal"]
)

#: Matrix products of a backward pass (``dP``, ``dV``, ``dQ``, ``dK`` and the recomputed
#: scores) per product of a forward pass (scores, output).
BACKWARD_PRODUCTS_PER_FORWARD = 5 / 2


def _torch_backward(backend: Any, q: Any, k: Any, v: Any, g: Any, causal: bool):
    """torch's backward of its own attention on the same memory; the graph is built once."""
    if backend.library not in ("numpy", "torch"):
        raise NotImplementedError(f"torch's kernel cannot run on {backend.id} arrays in place")
    backend_for("torch", "float32")  # torch installed, matmul precision pinned
    import torch

    def as_torch(x: Any) -> Any:
        t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        return t.detach().requires_grad_(True)

    tq, tk, tv = (as_torch(x) for x in (q, k, v))
    tg = torch.from_numpy(g) if isinstance(g, np.ndarray) else g
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    def run() -> Any:
        grads = torch.autograd.grad(out, (tq, tk, tv), tg, retain_graph=True)
        return grads[0]

    return run


def make_backward_case(backend_id: str, dtype: str, implementation: str, shape_text: str) -> Case:
    """Inputs, cotangent and the warmed-up backward callable, or ``NotImplementedError``."""
    backend = backend_for(backend_id, dtype)
    shape = Shape.parse(shape_text)
    if implementation == "materialized" and shape.score_bytes(dtype) > MAX_SCORE_BYTES:
        raise NotImplementedError(f"{implementation} would form {shape.score_bytes(dtype)} bytes")
    q, k, v = make_inputs(backend, shape.dims, dtype)
    g = make_inputs(backend, shape.dims, dtype, seed=1)[0]  # the output's cotangent
    if implementation == PEER:
        run = _torch_backward(backend, q, k, v, g, shape.causal)
    else:

        def run() -> Any:
            grads = scaled_dot_product_attention_vjp(
                q, k, v, g, is_causal=shape.causal, implementation=implementation
            )
            return grads[0]

    case = Case(backend, shape, run)
    case()  # warm-up: imports, kernels, JIT caches, thread pools
    return case


class Backward:
    """One backward pass per implementation and the torch peer."""

    param_names: ClassVar = ["backend", "dtype", "implementation", "shape"]
    params: ClassVar = [BACKEND_IDS, DTYPES, IMPLEMENTATIONS, SHAPES]
    timeout = 600

    def setup(self, backend, dtype, implementation, shape):
        self.case = make_backward_case(backend, dtype, implementation, shape)

    def time_backward(self, backend, dtype, implementation, shape):
        self.case()

    def track_gflops(self, backend, dtype, implementation, shape):
        """Flops of the five matrix products over the admissible pairs, per second."""
        flops = self.case.shape.flops * BACKWARD_PRODUCTS_PER_FORWARD
        return flops / self.case.median_seconds() / 1e9

    track_gflops.unit = "GFLOP/s"


class BackwardVersusTorch:
    """The issue's target: our VJP's time over torch's native backward (at most 1.5)."""

    param_names: ClassVar = ["backend", "dtype", "implementation", "shape"]
    params: ClassVar = [BACKEND_IDS, DTYPES, OURS, SHAPES]
    timeout = 600

    def setup(self, backend, dtype, implementation, shape):
        self.ours = make_backward_case(backend, dtype, implementation, shape)
        self.torch = make_backward_case(backend, dtype, PEER, shape)

    def track_time_ratio_to_torch_backward(self, backend, dtype, implementation, shape):
        """Our median time / torch's, interleaved in one process (< 1: ours is faster)."""
        times = interleaved_times(
            {"ours": self.ours.run, "torch": self.torch.run},
            self.ours.backend.synchronize,
            TRACK_ROUNDS,
        )
        return statistics.median(times["ours"]) / statistics.median(times["torch"])

    track_time_ratio_to_torch_backward.unit = "ratio"


class LongSequenceBackward:
    """One head, long sequences: the backward's memory beyond the inputs (float32, E=64)."""

    param_names: ClassVar = ["backend", "implementation", "length"]
    params: ClassVar = [BACKEND_IDS, ["auto", "blocked", PEER], LONG_LENGTHS]
    timeout = 600

    def setup(self, backend, implementation, length):
        self.case = make_backward_case(backend, "float32", implementation, f"1x1x{length}x64")

    def peakmem_backward(self, backend, implementation, length):
        self.case()

    def track_peak_rss_growth(self, backend, implementation, length):
        """Peak resident memory above the process's size before the call (Linux)."""
        growth = peak_rss_growth(self.case)
        if growth is None:
            raise NotImplementedError("needs Linux /proc/self/clear_refs")
        return growth / 2**20

    track_peak_rss_growth.unit = "MiB"


def main(argv: list[str] | None = None) -> None:
    """The issue's figures without asv: ``python -m benchmarks.backward [ROUNDS]``.

    Run from ``asv_benchmarks/``. Prints, for NumPy float32 at the target shape, the median
    time of the VJP (``auto``) and of torch's native backward, interleaved ``ROUNDS``
    (default 15) times in this process, their ratio, and the peak resident memory growth of
    the blocked VJP on one long head next to the size of one score matrix.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    rounds = int(args[0]) if args else 15
    for shape in TARGET_SHAPES:
        ours = make_backward_case("numpy", "float32", "auto", shape)
        peer = make_backward_case("numpy", "float32", PEER, shape)
        times = interleaved_times(
            {"ours": ours.run, "torch": peer.run}, ours.backend.synchronize, rounds
        )
        a, b = statistics.median(times["ours"]), statistics.median(times["torch"])
        print(f"{shape}: VJP {a:.3f} s, torch backward {b:.3f} s, ratio {a / b:.2f}")
    for length in LONG_LENGTHS:
        for implementation in ("blocked", PEER):
            case = make_backward_case("numpy", "float32", implementation, f"1x1x{length}x64")
            growth = peak_rss_growth(case)
            shown = "n/a" if growth is None else f"{growth / 2**20:.0f} MiB"
            scores = length * length * 4 / 2**20
            print(
                f"1x1x{length}x64 {implementation}: peak RSS growth {shown} "
                f"(one score matrix: {scores:.0f} MiB)"
            )


if __name__ == "__main__":
    main()
