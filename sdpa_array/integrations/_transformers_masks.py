"""transformers' attention masks as this library's options, never as an ``(L, S)`` array.

transformers builds each layer type's mask once per forward pass through the function
registered for the attention implementation in its ``AttentionMaskInterface``, and hands
what it returns to every attention call of that type. :func:`build_restriction` is that
function for this library: from the mask pattern (``mask_function``), the 2-D padding mask
and the positions of the queries and keys (``q_offset``, ``kv_offset``) it returns a
:class:`LayerRestriction`, the call options that express the same mask:

* the pattern, where it is one of transformers' own (causal, bidirectional, and their
  sliding windows: :func:`recognize`), as ``is_causal`` and ``window`` with the diagonal at
  key ``i + q_offset - kv_offset``, which ``alignment="bottom_right"`` puts there once the
  keys past the last query's position are cut off (a static cache's unwritten slots:
  :attr:`LayerRestriction.kv_stop`);
* the padding, where every row's valid tokens are its last ones (left padding, as batched
  generation pads) or its first ones, as ``key_lengths`` with ``padding_side``;
* packed sequences that transformers finds from positions that restart (one of those
  patterns restricted to each sequence: :func:`recognize_packed`) as ``segment_ids``;
* anything else (a pattern of a model's own, padding with holes, positions the alignments
  cannot express) as a ``mask_mod``,
  :class:`TransformersMask`: transformers' own function, evaluated by the kernels tile by
  tile.

Recognising a pattern only chooses faster options: an unrecognised one is computed exactly
by its ``mask_mod``. The padding is read on the host once per layer type and forward pass
(as FlashAttention's unpadding reads it), to tell left from right padding and holes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "LayerRestriction",
    "Pattern",
    "TransformersMask",
    "build_restriction",
    "recognize",
    "recognize_packed",
]


@dataclass(frozen=True)
class Pattern:
    """One of transformers' own mask patterns.

    Attributes
    ----------
    causal : bool
        Keys after the query's position are excluded.
    window : int or None
        transformers' ``sliding_window``: with ``causal``, the query and the ``window - 1``
        keys before it (``kv > q - window``); without, the keys within ``window`` of the
        query on either side (``|q - kv| <= window``).
    """

    causal: bool
    window: int | None = None

    @property
    def restricts(self) -> bool:
        return self.causal or self.window is not None

    def window_option(self) -> tuple[int, int] | None:
        """The ``window`` option of :func:`sdpa_array.scaled_dot_product_attention`."""
        if self.window is None:
            return None
        return (self.window - 1, 0) if self.causal else (self.window, self.window)


def _closure(fn: Any, qualname: str) -> dict[str, Any] | None:
    """The closure values of ``fn`` where it is the inner function ``qualname`` of one of
    transformers' mask factories, else ``None``."""
    if getattr(fn, "__qualname__", None) != qualname or not inspect.isfunction(fn):
        return None
    return dict(inspect.getclosurevars(fn).nonlocals)


def recognize(mask_function: Callable[..., Any]) -> Pattern | None:
    """The :class:`Pattern` ``mask_function`` is, or ``None`` if it is none of them.

    transformers' causal and bidirectional functions are recognised by identity, their
    sliding windows (``and_masks`` of a window overlay and one of those) by the factories'
    inner functions and the window they hold.
    """
    from transformers import masking_utils as masking

    if mask_function is masking.causal_mask_function:
        return Pattern(causal=True)
    if mask_function is masking.bidirectional_mask_function:
        return Pattern(causal=False)
    parts = _closure(mask_function, "and_masks.<locals>.and_mask")
    functions = None if parts is None else parts.get("mask_functions")
    if not isinstance(functions, tuple) or len(functions) != 2:
        return None
    overlay, base = functions
    if base is masking.causal_mask_function:
        causal, factory, least = True, "sliding_window_overlay", 1
    elif base is masking.bidirectional_mask_function:
        causal, factory, least = False, "sliding_window_bidirectional_overlay", 0
    else:
        return None
    values = _closure(overlay, f"{factory}.<locals>.inner_mask")
    window = None if values is None else values.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window >= least:
        return Pattern(causal=causal, window=window)
    return None


def recognize_packed(mask_function: Callable[..., Any]) -> tuple[Pattern, torch.Tensor] | None:
    """The pattern and the sequence ids ``(batch, tokens)`` of a packed batch's mask
    function (``create_causal_mask`` finds the sequences from positions that restart), or
    ``None`` if ``mask_function`` is not one.

    transformers' form: ``and_masks`` of the pattern with its positions remapped to each
    sequence's, and the sequence-ids function. Within a sequence the positions grow by
    one per token, so the pattern on the remapped positions is the pattern on the token
    indices, restricted to the sequence: the same pattern beside ``segment_ids``.
    """
    parts = _closure(mask_function, "and_masks.<locals>.and_mask")
    functions = None if parts is None else parts.get("mask_functions")
    if not isinstance(functions, tuple) or len(functions) != 2:
        return None
    remapped = _closure(functions[0], "remap_positions_for_packed_sequence.<locals>.inner_mask")
    ids = _closure(functions[1], "packed_sequence_mask_function.<locals>.inner_mask")
    if remapped is None or ids is None or not callable(remapped.get("mask_function")):
        return None
    pattern = recognize(remapped["mask_function"])
    segments = ids.get("packed_sequence_mask")
    if pattern is None or not isinstance(segments, torch.Tensor) or segments.ndim != 2:
        return None
    return pattern, segments


@dataclass(frozen=True, repr=False)
class TransformersMask:
    """transformers' mask function and padding mask as a ``mask_mod``.

    ``mask_mod(batch, head, q_idx, kv_idx)`` is ``mask_function`` at the absolute
    positions ``q_idx + q_offset`` and ``kv_idx + kv_offset``, and the key's entry of the
    2-D padding mask, as transformers' ``sdpa_mask`` combines them.
    """

    mask_function: Callable[..., Any]
    q_offset: int
    kv_offset: int
    padding: torch.Tensor | None = None

    def __repr__(self) -> str:
        name = getattr(self.mask_function, "__qualname__", repr(self.mask_function))
        return f"TransformersMask({name}, q_offset={self.q_offset}, kv_offset={self.kv_offset})"

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        kv = kv_idx + self.kv_offset
        allowed = self.mask_function(batch, head, q_idx + self.q_offset, kv)
        if self.padding is not None:
            allowed = allowed & self.padding[batch, kv]
        return allowed


@dataclass(frozen=True)
class LayerRestriction:
    """What the attention calls of one layer type get instead of an ``(L, S)`` mask.

    Attributes
    ----------
    options : dict
        Options of :func:`sdpa_array.scaled_dot_product_attention`: ``is_causal``,
        ``alignment``, ``window``, ``key_lengths`` and ``padding_side``, or ``mask_mod``.
    kv_stop : int or None
        The keys and values to keep, ``[:kv_stop]`` (``None``: all): the keys past the last
        query's position, which a causal pattern excludes (a static cache's unwritten
        slots).
    key_lengths : tuple of int or None
        ``options["key_lengths"]`` on the host (for the decoding route, which would
        otherwise read them back from the device).
    """

    options: dict[str, Any] = field(default_factory=dict)
    kv_stop: int | None = None
    key_lengths: tuple[int, ...] | None = None

    #: transformers reads a mask's ``ndim`` before building one: 4 says "prepared" (as
    #: its 4-D masks are), so that a restriction built ahead of a forward pass (generation
    #: with a static cache) comes back to :func:`build_restriction`, which returns it.
    ndim = 4


def _padding(
    attention_mask: torch.Tensor | None, kv_offset: int, n: int
) -> tuple[str, np.ndarray] | None:
    """The padding of keys ``[kv_offset, kv_offset + n)``: ``("none", ...)``, ``("left",
    lengths)`` or ``("right", lengths)``; ``None`` where some row has holes."""
    if attention_mask is None:
        return "none", np.zeros(0, np.int64)
    valid = attention_mask.detach().to(device="cpu", dtype=torch.bool).numpy()
    valid = valid[:, kv_offset : kv_offset + n]
    if valid.shape[1] < n:  # transformers pads a short mask with False
        valid = np.pad(valid, ((0, 0), (0, n - valid.shape[1])))
    counts = valid.sum(axis=1)
    positions = np.arange(n)
    if valid.all():
        return "none", counts
    if np.array_equal(valid, positions >= (n - counts)[:, None]):
        return "left", counts
    if np.array_equal(valid, positions < counts[:, None]):
        return "right", counts
    return None


def _alignment(pattern: Pattern, side: str, offset: int, L: int, S: int) -> str | None:
    """The alignment whose diagonal sits at key ``i + offset`` for these keys and padding
    (any without a positional rule), or ``None``: ``"bottom_right"`` puts it at
    ``i + S - L`` and takes left padding, ``"top_left"`` at ``i`` and takes right padding."""
    if not pattern.restricts:
        return "top_left" if side == "right" else "bottom_right"
    if side != "right" and offset == S - L:
        return "bottom_right"
    if side != "left" and offset == 0:
        return "top_left"
    return None


def build_restriction(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> LayerRestriction:
    """The :class:`LayerRestriction` of a layer type (transformers' mask-builder signature).

    Parameters
    ----------
    batch_size, q_length, kv_length : int
        The batch size and the query and key/value lengths of the attention calls.
    q_offset, kv_offset : int or 0-d tensor
        Absolute position of the first query and the first key.
    mask_function : callable, optional
        The pattern ``mask_function(batch, head, q_idx, kv_idx)`` at absolute positions
        (transformers' causal function when ``None``).
    attention_mask : torch.Tensor or LayerRestriction, optional
        The 2-D padding mask ``(batch, positions)``, True for real tokens; or the
        restriction built for this call ahead of the forward pass, returned as it is.
    **kwargs
        transformers' other arguments (``local_size``, ``allow_is_causal_skip``, ``dtype``,
        ``config``...), which change nothing here.

    Returns
    -------
    LayerRestriction
        The options expressing the mask.
    """
    from transformers import masking_utils as masking

    if isinstance(attention_mask, LayerRestriction):  # built ahead of this forward pass
        return attention_mask
    function = masking.causal_mask_function if mask_function is None else mask_function
    q0, k0 = int(q_offset), int(kv_offset)
    offset = q0 - k0  # the key index of query 0's position
    pattern = recognize(function)
    stop = q_length + offset if pattern is not None and pattern.causal else kv_length
    if pattern is not None and 0 < stop <= kv_length and offset >= 0:
        padding = _padding(attention_mask, k0, stop)
        if padding is not None:
            side, counts = padding
            alignment = _alignment(pattern, side, offset, q_length, stop)
            if alignment is not None:
                # one query at the last position: a causal rule excludes nothing
                causal = pattern.causal and not (q_length == 1 and offset == stop - 1)
                options: dict[str, Any] = {
                    "is_causal": causal,
                    "alignment": alignment,
                    "window": pattern.window_option(),
                }
                if side != "none":
                    device = attention_mask.device if attention_mask is not None else None
                    options["key_lengths"] = torch.as_tensor(counts, device=device)
                    options["padding_side"] = side
                host = None if side == "none" else tuple(int(n) for n in counts)
                return LayerRestriction(options, stop if stop < kv_length else None, host)
    packed = recognize_packed(function) if pattern is None else None
    if packed is not None and attention_mask is None and q0 == k0 == 0:
        found, segments = packed
        if segments.shape == (batch_size, q_length) and q_length == kv_length:
            options = {
                "is_causal": found.causal,
                "alignment": "top_left",
                "window": found.window_option(),
                "segment_ids": (segments, segments),
            }
            return LayerRestriction(options)
    padding_mask = None
    if attention_mask is not None:
        padding_mask = masking.prepare_padding_mask(attention_mask, kv_length, k0)
    mod = TransformersMask(function, q0, k0, padding_mask)
    return LayerRestriction({"mask_mod": mod})
