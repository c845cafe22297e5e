"""Building blocks shared by the generic implementations: operands, scores and softmax pieces.

The attention of one (query tile, key tile) pair is computed in these steps, each a function
below, so that the materialized path (one tile covering everything) and the blocked path
(many tiles with an online softmax) cannot drift apart:

1. :func:`prepare_operands` casts query/key/value to the compute dtype (at least float32),
   folds ``scale`` into the query and, with grouped-query attention, splits the query heads
   into ``(Hkv, groups)`` so that keys and values are never repeated in memory.
2. :func:`prepare_score_terms` brings ``mask`` and ``bias`` into the same grouped layout.
3. :func:`tile_scores` forms ``q kᵀ``, soft-caps it, adds the bias and writes ``-inf`` where
   the mask or the causal/window restrictions exclude a key.
4. :func:`safe_row_max`, :func:`safe_reciprocal` and :func:`log_sum_exp` turn scores into
   probabilities and log-sum-exps without ever computing ``inf - inf`` or ``log(0)``, so rows
   with no admissible key give zeros and ``-inf`` instead of NaN.
"""

from __future__ import annotations

import math
from typing import Any

from ._problem import Problem


def _grouped_operand(p: Problem, x: Any, length_axis_kind: str) -> Any:
    """Reshape ``(..., H, N, X)`` into the grouped ``(..., Hkv, G|1, N, X)`` layout."""
    xp = p.xp
    shape = tuple(x.shape)
    if length_axis_kind == "query":
        return xp.reshape(x, (*shape[:-3], p.heads_kv, p.groups, *shape[-2:]))
    return xp.reshape(x, (*shape[:-3], shape[-3], 1, *shape[-2:]))


def _grouped_score_term(p: Problem, x: Any) -> Any:
    """Reshape a mask/bias broadcastable to ``(..., Hq, L, S)`` into the grouped layout."""
    xp = p.xp
    full_ndim = len(p.score_shape)
    if x.ndim < full_ndim:
        x = xp.reshape(x, (1,) * (full_ndim - x.ndim) + tuple(x.shape))
    shape = tuple(x.shape)
    heads = (p.heads_kv, p.groups) if shape[-3] != 1 else (1, 1)
    return xp.reshape(x, (*shape[:-3], *heads, *shape[-2:]))


def ungroup(p: Problem, x: Any) -> Any:
    """Undo the grouped layout: ``(..., Hkv, G, L, X)`` back to ``(..., Hq, L, X)``."""
    if not p.grouped:
        return x
    shape = tuple(x.shape)
    return p.xp.reshape(x, (*shape[:-4], shape[-4] * shape[-3], *shape[-2:]))


def prepare_operands(p: Problem, query: Any, key: Any, value: Any) -> tuple[Any, Any, Any]:
    """Cast to the compute dtype, fold the scale into the query, group heads if needed."""
    xp = p.xp
    q = xp.astype(query, p.compute_dtype, copy=False)
    k = xp.astype(key, p.compute_dtype, copy=False)
    v = xp.astype(value, p.compute_dtype, copy=False)
    if p.softcap is None:
        q = q * p.scale
    if p.grouped:
        q = _grouped_operand(p, q, "query")
        k = _grouped_operand(p, k, "key")
        v = _grouped_operand(p, v, "key")
    return q, k, v


def prepare_score_terms(p: Problem, mask: Any, bias: Any) -> tuple[Any, Any]:
    """Cast ``bias`` to the compute dtype and group ``mask``/``bias`` heads if needed.

    Terms with fewer than two axes (a ``(S,)`` padding mask) get leading unit axes so that
    every term has its query and key axes at ``-2`` and ``-1``.
    """
    xp = p.xp
    if bias is not None:
        bias = xp.astype(bias, p.compute_dtype, copy=False)
    mask, bias = (
        xp.reshape(x, (1,) * (2 - x.ndim) + tuple(x.shape)) if x is not None and x.ndim < 2 else x
        for x in (mask, bias)
    )
    if p.grouped:
        mask = None if mask is None else _grouped_score_term(p, mask)
        bias = None if bias is None else _grouped_score_term(p, bias)
    return mask, bias


def tile_of(x: Any, rows: slice, cols: slice) -> Any:
    """The ``[..., rows, cols]`` tile of a term broadcastable to the scores.

    Axes of size 1 (broadcast) are kept whole instead of sliced.
    """
    if x is None:
        return None
    r = rows if x.shape[-2] != 1 else slice(None)
    c = cols if x.shape[-1] != 1 else slice(None)
    return x[..., r, c]


def tile_scores(
    p: Problem,
    q: Any,
    k: Any,
    mask: Any,
    bias: Any,
    rows: slice,
    cols: slice,
) -> Any:
    """Final scores of one tile: ``softcap(q kᵀ)`` + bias, ``-inf`` where excluded.

    ``q`` and ``k`` are the prepared operands already cut to ``rows`` and ``cols``;
    ``mask`` and ``bias`` are the prepared (uncut) terms.
    """
    s = p.xp.matmul(q, p.xp.matrix_transpose(k))
    if p.softcap is not None:
        s = p.xp.tanh(s * (p.scale / p.softcap)) * p.softcap
    return apply_score_terms(p, s, mask, bias, rows, cols)


def apply_score_terms(p: Problem, s: Any, mask: Any, bias: Any, rows: slice, cols: slice) -> Any:
    """Add the bias to a tile's (soft-capped) scores and write ``-inf`` where excluded.

    Excluded means: ``mask`` is False, or the causal/window restrictions rule the pair out.
    """
    xp = p.xp
    b = tile_of(bias, rows, cols)
    if b is not None:
        s = s + b
    allowed = tile_of(mask, rows, cols)
    positional = p.positions.tile_mask(xp, p.device, rows.start, rows.stop, cols.start, cols.stop)
    if positional is not None:
        allowed = positional if allowed is None else xp.logical_and(allowed, positional)
    if allowed is not None:
        s = xp.where(allowed, s, xp.asarray(-math.inf, dtype=s.dtype, device=p.device))
    return s


def safe_row_max(p: Problem, s: Any) -> Any:
    """Row maximum of the scores with ``-inf`` (no admissible key) replaced by 0.

    Subtracting it keeps ``exp`` in range and never forms ``-inf - (-inf)``.
    """
    return exp_shift(p, p.xp.max(s, axis=-1, keepdims=True))


def exp_shift(p: Problem, x: Any) -> Any:
    """``x`` (a row maximum or log-sum-exp) with ``-inf`` replaced by 0, to subtract before ``exp``.

    A row whose reference is ``-inf`` has only ``-inf`` scores: ``exp(score - 0)`` gives its
    exact zeros, where ``exp(-inf - (-inf))`` would give NaN.
    """
    xp = p.xp
    return xp.where(x == -math.inf, xp.zeros_like(x), x)


def safe_reciprocal(p: Problem, total: Any) -> Any:
    """``1 / total`` where ``total > 0``, else 0 (rows with no admissible key)."""
    xp = p.xp
    positive = total > 0
    return xp.where(positive, 1.0 / xp.where(positive, total, xp.ones_like(total)), 0.0)


def log_sum_exp(p: Problem, row_max: Any, total: Any) -> Any:
    """``row_max + log(total)``, and ``-inf`` where ``total == 0``; drops the last axis."""
    xp = p.xp
    positive = total > 0
    lse = row_max + xp.log(xp.where(positive, total, xp.ones_like(total)))
    lse = xp.where(positive, lse, xp.asarray(-math.inf, dtype=lse.dtype, device=p.device))
    return lse[..., 0]
