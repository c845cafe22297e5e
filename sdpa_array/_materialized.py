"""The materialized implementation: the whole ``(..., L, S)`` score matrix at once.

It is the textbook computation (scores, stable softmax, product with V) in the compute dtype,
and the simplest generic path: every other implementation is checked against it and against
:mod:`sdpa_array.reference`.
"""

from __future__ import annotations

from typing import Any

from ._problem import Problem
from ._result import AttentionResult
from ._scores import (
    log_sum_exp,
    prepare_operands,
    prepare_score_terms,
    safe_reciprocal,
    safe_row_max,
    tile_scores,
    ungroup,
)


def materialized_attention(
    p: Problem,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    *,
    return_weights: bool,
    return_lse: bool,
) -> AttentionResult:
    """Attention with the full score matrix; memory ``O(L * S)`` per batch and head."""
    xp = p.xp
    q, k, v = prepare_operands(p, query, key, value)
    mask, bias = prepare_score_terms(p, mask, bias)
    s = tile_scores(p, q, k, mask, bias, slice(0, p.L), slice(0, p.S))
    row_max = safe_row_max(p, s)
    e = xp.exp(s - row_max)
    total = xp.sum(e, axis=-1, keepdims=True)
    inv = safe_reciprocal(p, total)
    out = ungroup(p, xp.matmul(e, v) * inv)
    weights = ungroup(p, e * inv) if return_weights else None
    lse = ungroup(p, log_sum_exp(p, row_max, total)[..., None])[..., 0] if return_lse else None
    return AttentionResult(out=out, weights=weights, lse=lse)
