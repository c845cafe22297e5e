"""Packed documents against the same documents as a batch, forward and backward.

NumPy float32, 8 heads, E = 64: ``n`` documents of ``length`` tokens packed into one
sequence of 4096, expressed four ways (``mask_mod=mods.document(...)`` with its
classification in the call, a ``BlockMask`` made once, ``segment_ids``, and
``scaled_dot_product_attention_varlen`` on the packed tokens), each timed interleaved with
our own call on the same documents as a batch ``(n, 8, length, 64)``. The backward is each
way's VJP against the batched VJP. Every figure is ours-packed / ours-batched, lower is
better: good is at or below 1.3 (1.15 for varlen), FlexAttention's compiled ``BlockMask``
reaching 1.2 on such documents. ``sdpa_array.explain(...).forward_tiles`` tells how many
tiles each way visits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

import sdpa_array
from sdpa_array import mods

from .history import _interleaved, _ratio

#: Rounds per figure (each candidate once per round, in a new order), after a warm-up.
ROUNDS = 5

#: (documents, tokens each): the packed sequence is 4096 long.
LAYOUTS = {"8x512": (8, 512), "16x256": (16, 256), "4x1024": (4, 1024)}
HEADS, E = 8, 64


def _calls(layout: str, direction: str, way: str) -> dict[str, Callable[[], Any]]:
    """The packed call of ``way`` and the batched call, forward or VJP."""
    n, length = LAYOUTS[layout]
    total = n * length
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, HEADS, total, E), dtype=np.float32) for _ in range(4))
    doc = np.repeat(np.arange(n, dtype=np.int32), length)
    vjp = direction == "vjp"

    def batch(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x.reshape(HEADS, n, length, E).swapaxes(0, 1))

    def tokens(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[0].swapaxes(0, 1))

    forward, backward = (
        sdpa_array.scaled_dot_product_attention,
        sdpa_array.scaled_dot_product_attention_vjp,
    )
    batched = [batch(x) for x in (q, k, v, g)]
    calls: dict[str, Callable[[], Any]] = {
        "batched": (lambda: backward(*batched)) if vjp else (lambda: forward(*batched[:3]))
    }
    if way == "varlen":
        packed = [tokens(x) for x in (q, k, v, g)]
        offsets = np.arange(0, total + 1, length)
        if vjp:
            varlen_vjp = sdpa_array.scaled_dot_product_attention_varlen_vjp
            calls[way] = lambda: varlen_vjp(*packed, offsets, offsets)
        else:
            varlen = sdpa_array.scaled_dot_product_attention_varlen
            calls[way] = lambda: varlen(*packed[:3], offsets, offsets)
        return calls
    if way == "mask_mod":
        options: dict[str, Any] = {"mask_mod": mods.document(doc, doc)}
    elif way == "block_mask":
        made = sdpa_array.create_block_mask(mods.document(doc, doc), None, None, total, total)
        options = {"mask_mod": made}
    else:
        options = {"segment_ids": (doc, doc)}
    if vjp:
        calls[way] = lambda: backward(q, k, v, g, **options)
    else:
        calls[way] = lambda: forward(q, k, v, **options)
    return calls


class PackedDocuments:
    """Packed documents / the same documents as a batch (see the module docstring)."""

    params: ClassVar = (
        list(LAYOUTS),
        ["forward", "vjp"],
        ["mask_mod", "block_mask", "segment_ids", "varlen"],
    )
    param_names: ClassVar = ["documents", "direction", "way"]
    timeout = 600

    def setup(self, layout: str, direction: str, way: str) -> None:
        sdpa_array.set_num_threads(2)
        self.calls = _calls(layout, direction, way)

    def track_packed_over_batched(self, layout: str, direction: str, way: str) -> float:
        """The packed call's time / the batched call's, median of per-round ratios; lower
        is better, good is <= 1.3 (varlen: <= 1.15)."""
        return _ratio(_interleaved(self.calls, ROUNDS), way, "batched")

    track_packed_over_batched.unit = "ratio"  # type: ignore[attr-defined]
