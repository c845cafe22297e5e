"""``mask_mod`` and ``bias_mod`` (FlexAttention-style functions) against their dense peers.

NumPy, float32, B=1, H=8, E=64, L = S = :data:`LENGTHS` (1024; the ``full`` profile adds
the issue's 4096), the default implementation (blocked at these sizes):

* :class:`DocumentMask`: ``mask_mod=mods.document(segments, segments)`` with 8 documents of
  L/8 tokens, the same mod as a prebuilt :class:`~sdpa_array.BlockMask`, and the equivalent
  dense boolean ``mask`` of shape ``(L, S)``; forward and VJP.
* :class:`AlibiBias`: ``bias_mod=mods.alibi(mods.alibi_slopes(8))`` with ``is_causal=True``
  against a dense precomputed float32 ``bias`` of shape ``(H, L, S)``.
* :class:`CreateBlockMask`: :func:`~sdpa_array.create_block_mask` of the document mod.
* :class:`ModRatios`: the issue's ratios, medians of :data:`ROUNDS` interleaved rounds in one
  process: the document mod's speed-up over the dense mask (target at least 4x, goal 6x at
  L=4096) and the alibi mod's time over the dense bias's (target at most 1.3, goal 1.1).

``track_peak_traced_memory`` is the peak of the allocations :mod:`tracemalloc` sees (NumPy's
buffers) during one call, in MiB: the call's own working memory, without the inputs and the
dense mask or bias made in ``setup`` (which asv's ``peakmem_*``, the process's peak RSS,
includes). The memory targets compare it with ``L*S`` bytes (one bool ``(L, S)``).
"""

from __future__ import annotations

import statistics
import tracemalloc
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from sdpa_array import (
    create_block_mask,
    mods,
    scaled_dot_product_attention,
    scaled_dot_product_attention_vjp,
)

from .common import FULL, interleaved_times

DOCUMENTS, HEADS, E = 8, 8, 64
LENGTHS = [1024, 4096] if FULL else [1024]
#: Interleaved rounds of the ``track_*`` ratios (median).
ROUNDS = 5


class _Inputs:
    """The inputs of one length, the mods and their dense peers."""

    def __init__(self, length: int) -> None:
        rng = np.random.default_rng(0)
        shape = (1, HEADS, length, E)
        self.length = length
        self.q, self.k, self.v, self.g = (
            rng.standard_normal(shape, dtype=np.float32) for _ in range(4)
        )
        segments = np.repeat(np.arange(DOCUMENTS), length // DOCUMENTS)
        self.document = mods.document(segments, segments)
        self.dense_mask = segments[:, None] == segments[None, :]  # (L, S) bool
        self.slopes = mods.alibi_slopes(HEADS)
        self.alibi = mods.alibi(self.slopes)

    def block_mask(self) -> Any:
        return create_block_mask(self.document, None, None, self.length, self.length)

    def dense_bias(self) -> np.ndarray:
        """The alibi mod's values, float32 ``(H, L, S)`` (made one head at a time)."""
        n = self.length
        distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]).astype(np.float64)
        out = np.empty((HEADS, n, n), dtype=np.float32)
        for h, slope in enumerate(self.slopes):
            np.multiply(distance, -slope, out=out[h], casting="same_kind")
        return out

    def forward(self, **kw: Any) -> Callable[[], Any]:
        return lambda: scaled_dot_product_attention(self.q, self.k, self.v, **kw)

    def vjp(self, **kw: Any) -> Callable[[], Any]:
        return lambda: scaled_dot_product_attention_vjp(self.q, self.k, self.v, self.g, **kw)


def _peak_traced_mib(call: Callable[[], Any]) -> float:
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / 2**20


def _median_ratio(numerator: Callable[[], Any], denominator: Callable[[], Any]) -> float:
    """Median time of ``numerator`` / that of ``denominator``, interleaved in one process."""
    times = interleaved_times({"n": numerator, "d": denominator}, lambda _: None, ROUNDS)
    return statistics.median(times["n"]) / statistics.median(times["d"])


class DocumentMask:
    """Packed documents: the document mod (plain or prebuilt block mask) vs the dense mask."""

    params: ClassVar = (["dense-mask", "mask_mod", "block-mask"], LENGTHS)
    param_names: ClassVar = ["mask", "length"]
    timeout = 600

    def setup(self, mask: str, length: int) -> None:
        x = _Inputs(length)
        if mask == "dense-mask":
            kw: dict[str, Any] = {"mask": x.dense_mask}
        elif mask == "mask_mod":
            kw = {"mask_mod": x.document}
        else:
            kw = {"mask_mod": x.block_mask()}
        self.forward, self.backward = x.forward(**kw), x.vjp(**kw)
        self.forward()  # warm-up

    def time_forward(self, mask: str, length: int) -> None:
        self.forward()

    def time_vjp(self, mask: str, length: int) -> None:
        self.backward()

    def track_peak_traced_memory(self, mask: str, length: int) -> float:
        return _peak_traced_mib(self.forward)

    track_peak_traced_memory.unit = "MiB"  # type: ignore[attr-defined]

    def track_peak_traced_memory_vjp(self, mask: str, length: int) -> float:
        return _peak_traced_mib(self.backward)

    track_peak_traced_memory_vjp.unit = "MiB"  # type: ignore[attr-defined]


class AlibiBias:
    """Causal ALiBi: the bias mod vs a dense precomputed float32 ``(H, L, S)`` bias."""

    params: ClassVar = (["dense-bias", "bias_mod"], LENGTHS)
    param_names: ClassVar = ["bias", "length"]
    timeout = 600

    def setup(self, bias: str, length: int) -> None:
        x = _Inputs(length)
        kw = {"bias": x.dense_bias()} if bias == "dense-bias" else {"bias_mod": x.alibi}
        self.forward = x.forward(is_causal=True, **kw)
        self.forward()  # warm-up

    def time_forward(self, bias: str, length: int) -> None:
        self.forward()

    def track_peak_traced_memory(self, bias: str, length: int) -> float:
        return _peak_traced_mib(self.forward)

    track_peak_traced_memory.unit = "MiB"  # type: ignore[attr-defined]


class CreateBlockMask:
    """Classifying the document mod's 128 x 128 blocks on the host."""

    params: ClassVar = (LENGTHS,)
    param_names: ClassVar = ["length"]

    def setup(self, length: int) -> None:
        self.x = _Inputs(length)

    def time_create_block_mask(self, length: int) -> None:
        self.x.block_mask()

    def track_peak_traced_memory(self, length: int) -> float:
        return _peak_traced_mib(self.x.block_mask)

    track_peak_traced_memory.unit = "MiB"  # type: ignore[attr-defined]


class ModRatios:
    """The issue's ratios, interleaved in one process (medians of :data:`ROUNDS` rounds)."""

    params: ClassVar = (LENGTHS,)
    param_names: ClassVar = ["length"]
    timeout = 900

    def setup(self, length: int) -> None:
        self.x = _Inputs(length)

    def track_document_speedup_over_dense_mask(self, length: int) -> float:
        """Dense mask's median / the plain document mod's (target >= 4, goal 6 at 4096)."""
        x = self.x
        return _median_ratio(x.forward(mask=x.dense_mask), x.forward(mask_mod=x.document))

    track_document_speedup_over_dense_mask.unit = "x"  # type: ignore[attr-defined]

    def track_block_mask_speedup_over_dense_mask(self, length: int) -> float:
        """Dense mask's median / the prebuilt block mask's."""
        x = self.x
        bm = x.block_mask()
        return _median_ratio(x.forward(mask=x.dense_mask), x.forward(mask_mod=bm))

    track_block_mask_speedup_over_dense_mask.unit = "x"  # type: ignore[attr-defined]

    def track_vjp_document_speedup_over_dense_mask(self, length: int) -> float:
        """The VJP's: dense mask's median / the plain document mod's."""
        x = self.x
        return _median_ratio(x.vjp(mask=x.dense_mask), x.vjp(mask_mod=x.document))

    track_vjp_document_speedup_over_dense_mask.unit = "x"  # type: ignore[attr-defined]

    def track_alibi_time_ratio_to_dense_bias(self, length: int) -> float:
        """Causal alibi mod's median / the dense bias's (target <= 1.3, goal 1.1)."""
        x = self.x
        dense = x.dense_bias()
        return _median_ratio(
            x.forward(bias_mod=x.alibi, is_causal=True), x.forward(bias=dense, is_causal=True)
        )

    track_alibi_time_ratio_to_dense_bias.unit = "ratio"  # type: ignore[attr-defined]
