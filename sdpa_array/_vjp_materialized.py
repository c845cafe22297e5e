"""The materialized VJP: one tile holding the whole ``(..., L, S)`` score matrix.

It is the backward counterpart of :mod:`sdpa_array._materialized`: the probabilities are
the softmax of the full score matrix (or ``exp(Z - lse)`` when the forward pass's
log-sum-exp is at hand), and every product runs once over all queries and keys. Memory is
``O(L * S)`` per batch element; :mod:`sdpa_array._vjp_blocked` is the ``O(block)`` version.
"""

from __future__ import annotations

from typing import Any

from ._problem import Problem
from ._vjp_tiles import (
    RawGrads,
    prepare_backward,
    prepare_grad_lse,
    prepare_saved,
    row_delta,
    tile_gradients,
)


def materialized_vjp(
    p: Problem,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    grad_output: Any,
    *,
    out: Any | None = None,
    lse: Any | None = None,
    grad_lse: Any | None = None,
) -> RawGrads:
    """Gradients with the full score matrix; memory ``O(L * S)`` per batch element.

    ``out`` and ``lse`` (the forward pass's, either both or neither) let the probabilities
    come from the log-sum-exp; without them they are the softmax of the scores, and
    ``D = rowsum(P * dP)``; ``grad_lse`` is a log-sum-exp cotangent ``(..., Hq, L)``.
    """
    ops = prepare_backward(p, query, key, value, mask, bias, grad_output)
    g_lse = prepare_grad_lse(p, grad_lse)
    rows, cols = slice(0, p.L), slice(0, p.S)
    if out is None:
        lse_rows = delta = None
    else:
        saved = prepare_saved(p, out, lse)
        lse_rows, delta = saved.lse, row_delta(p, ops.d_out, saved.out, g_lse)
    t = tile_gradients(
        p,
        ops.q,
        ops.k,
        ops.v,
        ops.mask,
        ops.bias,
        ops.d_out,
        rows,
        cols,
        lse_rows=lse_rows,
        delta_rows=delta,
        grad_lse_rows=g_lse,
        need_dz=bias is not None,
    )
    return RawGrads(dq=t.dq, dk=t.dk, dv=t.dv, dbias=t.dz)
