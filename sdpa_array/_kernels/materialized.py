"""The materialized forward kernel: the whole ``(..., L, S)`` score matrix at once.

The textbook computation (scores, stable softmax, product with V) in the compute dtype, as
one tile covering every query and key: the simplest kernel, and the fastest for small calls.
Sinks add ``exp(sink - m)`` to each row's denominator (``m`` the larger of the row maximum and
the sink); dropout zeroes weights after the softmax, so the log-sum-exp ignores it. The rows'
largest scaled products (for the maximum scores) come from the same tile. Where a row's
largest scaled product is large (beyond the fixed reference's limit, :mod:`.score_bound`),
the scores are computed again with their contraction in chunks on NumPy and
array-api-strict (:mod:`sdpa_array._arrays.products`).
"""

from __future__ import annotations

import dataclasses
import math

from .._arrays import products
from .._arrays.compat import known_value
from .._arrays.typing import Array
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .layout import ungroup
from .operands import prepare, tile_scores_and_maxima
from .result import AttentionResult
from .score_bound import beyond_limit
from .softmax import exp_shift, log_sum_exp, safe_reciprocal

__all__ = ["materialized_attention"]


def _large(p: Problem, row_max: Array, softcap: float | None = None) -> bool:
    """Whether a row's largest scaled product ``scale · q·k`` lies outside ``±T``
    (:func:`~.score_bound.beyond_limit`; a ``softcap`` at most ``T`` keeps the final scores
    small): the scores are then computed again with their contraction in chunks
    (:func:`~sdpa_array._arrays.products.score_chunks`), whose own rounding is otherwise
    most of the output's error. Rows without an admissible key (``-inf``) do not count; a
    value that cannot be read counts as large."""
    xp = p.xp
    if math.prod(row_max.shape) == 0:
        return False
    finite = xp.where(xp.isfinite(row_max), xp.abs(row_max), xp.zeros_like(row_max))
    largest = known_value(xp.max(finite))
    return beyond_limit(p, math.nan if largest is None else largest, softcap)


def materialized_attention(p: Problem, x: Inputs, outputs: Outputs) -> AttentionResult:
    """Attention with the full score matrix; memory ``O(L * S)`` per batch and head."""
    xp = p.xp
    ops = prepare(p, x)
    rows, cols = slice(0, p.L), slice(0, p.S)
    later = ops.score_chunks > 1  # one product first; in chunks again where they are large
    first = dataclasses.replace(ops, score_chunks=1) if later else ops
    s, tile_max, maxima = tile_scores_and_maxima(
        p, first, ops.q, rows, cols, maxima=outputs.max_scores or later
    )
    if later and _large(p, maxima, ops.terms.softcap):
        s, tile_max, maxima = tile_scores_and_maxima(
            p, ops, ops.q, rows, cols, maxima=outputs.max_scores
        )
    elif not outputs.max_scores:
        maxima = None
    row_max = exp_shift(p, ops.terms.row_max(xp, tile_max))
    e = xp.exp(s - row_max)
    total = xp.sum(e, axis=-1, keepdims=True)
    sink = ops.terms.sink_total(xp, row_max)
    if sink is not None:
        total = total + sink
    inv = safe_reciprocal(p, total)
    if ops.dropout is not None:
        e = ops.dropout.tile(xp, e, rows, cols, p.device, scaled=False)
        inv = inv * ops.dropout.factor
    out = ungroup(p, products.matmul(xp, e, ops.v) * inv)
    weights = ungroup(p, e * inv) if outputs.weights else None
    lse = ungroup(p, log_sum_exp(p, row_max, total)[..., None])[..., 0] if outputs.lse else None
    row_maxima = None if maxima is None else ungroup(p, maxima)[..., 0]
    return AttentionResult(out=out, weights=weights, lse=lse, row_maxima=row_maxima)
