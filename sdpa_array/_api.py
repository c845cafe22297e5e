"""The public entry point: validate, choose an implementation, run it, pack the result."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

from ._autograd import differentiable
from ._blocked import TILE_BYTES, blocked_attention
from ._materialized import materialized_attention
from ._native import CannotDelegateError, Request, native_attention, plan_native
from ._problem import Problem, validate
from ._result import AttentionResult, empty_result, finalize

Implementation = Callable[..., AttentionResult]

#: Implementations by name; each takes ``(problem, query, key, value, mask, bias,
#: return_weights=..., return_lse=...)`` and returns an :class:`AttentionResult`.
IMPLEMENTATIONS: dict[str, Implementation] = {
    "materialized": materialized_attention,
    "blocked": blocked_attention,
    "native": native_attention,
}

ImplementationName = Literal["auto", "materialized", "blocked", "native"]

#: ``"auto"`` runs the blocked implementation when the score matrix of the whole call (in
#: the compute dtype) would exceed this many bytes, i.e. more than one tile: then the
#: materialized path's passes run from main memory instead of cache (measured with NumPy:
#: blocked is 2 to 5 times faster from 2 MiB of scores on), and its memory grows as
#: ``L * S``.
AUTO_BLOCKED_BYTES = TILE_BYTES


def _score_bytes(p: Problem) -> int:
    return math.prod(p.score_shape) * (p.xp.finfo(p.compute_dtype).bits // 8)


def _choose(
    p: Problem, implementation: str, request: Request, blocks: tuple[int | None, int | None]
) -> Implementation:
    """The implementation that runs the call (see ``implementation`` in the public docs)."""
    choices = ("auto", *IMPLEMENTATIONS)
    if implementation not in choices:
        raise ValueError(f"implementation must be one of {choices}, got {implementation!r}")
    sized = any(b is not None for b in blocks)
    if sized and implementation not in ("auto", "blocked"):
        raise ValueError(
            f"block_q/block_k apply to the blocked implementation, not {implementation!r}"
        )
    blocked = functools.partial(blocked_attention, block_q=blocks[0], block_k=blocks[1])
    if implementation == "blocked" or (implementation == "auto" and sized):
        return blocked
    if implementation != "auto":
        return IMPLEMENTATIONS[implementation]
    if request.return_weights:  # the weights are the score matrix: form it once
        return materialized_attention
    large = _score_bytes(p) > AUTO_BLOCKED_BYTES
    try:
        delegation = plan_native(p, request)
    except CannotDelegateError:
        delegation = None
    if delegation is not None and not (
        large and (delegation.builds_mask or not delegation.memory_efficient)
    ):
        return native_attention
    return blocked if large else materialized_attention


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    /,
    *,
    mask: Any | None = None,
    bias: Any | None = None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: Literal["top_left", "bottom_right"] = "top_left",
    scale: float | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    return_weights: bool = False,
    return_lse: bool = False,
    implementation: ImplementationName | str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
) -> Any:
    r"""Scaled dot-product attention on any Array-API array library.

    Computes ``softmax(softcap(Q Kᵀ · scale) + bias, masked) · V`` row by row, in at least
    float32, and returns an array of the inputs' library, dtype and device.

    Parameters
    ----------
    query : array, shape (..., Hq, L, E) or (..., L, E)
        Queries. Leading axes broadcast against those of ``key`` and ``value``.
    key : array, shape (..., Hkv, S, E) or (..., S, E)
        Keys; same dtype and library as ``query``.
    value : array, shape (..., Hkv, S, Ev) or (..., S, Ev)
        Values; ``Ev`` may differ from ``E``.
    mask : boolean array, optional
        Broadcastable to ``(..., Hq, L, S)``. ``True`` means the query **may attend** to the
        key (the polarity of torch, JAX and ONNX).
    bias : floating array, optional
        Added to the scores; broadcastable to ``(..., Hq, L, S)``. ``-inf`` excludes a key.
        May be combined with ``mask``.
    is_causal : bool, default False
        Query ``i`` may attend key ``j`` only if ``j`` is at or before its diagonal.
    window : (int or None, int or None), optional
        ``(left, right)``: query ``i`` may attend only keys ``diag(i) - left ... diag(i) +
        right``; ``None`` leaves a side unbounded. Combines with every other restriction.
    alignment : {"top_left", "bottom_right"}, default "top_left"
        Where query ``i``'s diagonal sits when ``L != S``: key ``i`` (torch and JAX
        ``is_causal``) or key ``i + S - L`` (FlashAttention, KV-cache decoding).
    scale : float, optional
        Positive finite multiplier of ``Q Kᵀ``; default ``1 / sqrt(E)``.
    softcap : float, optional
        If given (> 0), scaled scores become ``softcap * tanh(scores / softcap)`` before the
        bias and the masks are applied.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` must be a multiple of ``Hkv`` and query head ``h``
        uses key/value head ``h // (Hq // Hkv)``.
    return_weights : bool, default False
        Also return the attention weights ``(..., Hq, L, S)``.
    return_lse : bool, default False
        Also return the log-sum-exp of the final scores ``(..., Hq, L)`` (in the compute
        dtype: float32 for float16/bfloat16 inputs).
    implementation : {"auto", "materialized", "blocked", "native"}, default "auto"
        Which implementation runs; all give the same results within rounding.

        * ``"materialized"`` forms the full ``(..., L, S)`` score matrix: the simplest path,
          and the fastest for small calls.
        * ``"blocked"`` visits keys in blocks with an online softmax (FlashAttention-style),
          and queries in blocks, so its extra memory is ``O(block_q * block_k)`` per batch
          element; key blocks that causal or window restrictions exclude are skipped. With
          ``return_weights`` it falls back to the materialized path (the weights are the
          score matrix).
        * ``"native"`` hands the call to the library's own fused kernel
          (``torch.nn.functional.scaled_dot_product_attention``, torch's CPU
          flash-attention kernel when the log-sum-exp is wanted, or
          ``jax.nn.dot_product_attention``) where that computes it exactly, and raises
          :class:`~sdpa_array._native.CannotDelegateError` (a ``ValueError``) naming the
          reason otherwise (e.g. ``softcap``, NumPy arrays).
        * ``"auto"``: the materialized path when ``return_weights`` is asked; otherwise
          native when it applies, unless the score matrix would be large (over
          ``AUTO_BLOCKED_BYTES``, 1 MiB) and the kernel would form it or need a
          positional mask built for it; otherwise blocked when the score matrix would be
          large, materialized when not. Giving ``block_q``/``block_k`` selects blocked.
    block_q, block_k : int, optional
        Query and key block sizes of the blocked implementation. By default they are
        chosen from the shapes and dtype so that one score tile is about 1 MiB (key blocks
        up to 1024, the query block filling the rest).

    Returns
    -------
    out : array, shape (..., Hq, L, Ev)
        The attention output, same dtype, library and device as ``query``.
    weights : array, shape (..., Hq, L, S)
        Only if ``return_weights``.
    lse : array, shape (..., Hq, L)
        Only if ``return_lse``.

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating or mismatched dtypes, a non-boolean
        ``mask``, a non-floating ``bias``.
    ValueError
        Shapes that do not fit together, out-of-range ``scale``, ``softcap`` or ``window``,
        unknown ``alignment`` or ``implementation``, block sizes that are not positive
        ints or are given to an implementation other than blocked.
    CannotDelegateError
        ``implementation="native"`` for a call no native kernel computes exactly (a
        subclass of ``ValueError``).

    Notes
    -----
    A query with no admissible key (all excluded, or ``S == 0``) gets an output row of
    zeros, weights of zeros and a log-sum-exp of ``-inf``, never NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention
    >>> q = np.array([[1.0, 2.0], [3.0, 4.0]])
    >>> k = np.array([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])
    >>> v = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    >>> scaled_dot_product_attention(q, k, v).round(4)
    array([[0.9858, 0.9998, 0.0002],
           [1.    , 1.    , 0.    ]])
    """
    p = validate(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        window=window,
        alignment=alignment,
        scale=scale,
        softcap=softcap,
        enable_gqa=enable_gqa,
    )
    for flag_name, flag in (("return_weights", return_weights), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
    request = Request(query, key, value, mask, bias, return_weights, return_lse)
    run = _choose(p, implementation, request, (block_q, block_k))
    if p.S == 0 or p.L == 0:
        result = empty_result(p)
    else:
        result = differentiable(run)(
            p,
            query,
            key,
            value,
            mask,
            bias,
            return_weights=return_weights,
            return_lse=return_lse,
        )
    return finalize(p, result, return_weights=return_weights, return_lse=return_lse)
