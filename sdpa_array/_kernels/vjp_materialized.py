"""The materialized backward kernel: one tile holding the whole ``(..., L, S)`` score matrix.

The backward counterpart of :mod:`.materialized`: the probabilities are the softmax of the
full score matrix (or ``exp(Z - lse)`` when the forward pass's log-sum-exp is at hand), and
every product runs once over all queries and keys. Memory is ``O(L * S)`` per batch element;
:mod:`.vjp_blocked` is the ``O(block)`` version.
"""

from __future__ import annotations

import dataclasses

from .._arrays.typing import Array
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .gradients import prepare_backward, sink_gradient, tile_gradients
from .materialized import materialized_attention
from .operands import Operands, prepare
from .result import RawGrads
from .score_bound import chunks_from_bound

__all__ = ["materialized_vjp"]


#: Fewest score pairs per batch slice for which the materialized VJP reads the score bound
#: (:func:`~.score_bound.chunks_from_bound`, a dozen small calls: about 50 us, 5 % of a
#: float32 VJP at 128 x 128 x 64 with 8 heads); smaller calls keep one product.
MIN_BOUND_PAIRS = 128 * 128


def _chunked_where_large(p: Problem, ops: Operands) -> Operands:
    """``ops`` with the scores' contraction in chunks where the call's score bound says
    they may be large (:mod:`sdpa_array._arrays.products`), for calls of at least
    :data:`MIN_BOUND_PAIRS` pairs per batch slice; one product otherwise."""
    if ops.score_chunks == 1:
        return ops
    if p.L * p.S < MIN_BOUND_PAIRS:
        return dataclasses.replace(ops, score_chunks=1)
    return chunks_from_bound(p, ops)[0]


def materialized_vjp(
    p: Problem,
    x: Inputs,
    grad_output: Array,
    *,
    out: Array = None,
    lse: Array = None,
    grad_lse: Array = None,
) -> RawGrads:
    """Gradients with the full score matrix; memory ``O(L * S)`` per batch element.

    ``out`` and ``lse`` (the forward pass's, either both or neither) let the probabilities
    come from the log-sum-exp; without them they are the softmax of the scores, and
    ``D = rowsum(P * dP)`` (the sink in the softmax's denominator); ``grad_lse`` is a
    log-sum-exp cotangent ``(..., Hq, L)``.
    """
    if x.sinks is not None and out is None and grad_lse is not None:  # g needs O and lse
        forward = materialized_attention(p, x, Outputs(lse=True))
        out, lse = forward.out, forward.lse
    ops = _chunked_where_large(p, prepare(p, x))
    b = prepare_backward(p, x, grad_output, ops=ops, out=out, lse=lse, grad_lse=grad_lse)
    rows = slice(0, p.L)
    t = tile_gradients(p, b.ops, b.rows(p, rows), rows, slice(0, p.S), need_dz=x.bias is not None)
    dsinks = t.dsink if x.sinks is None or b.lse is None else sink_gradient(p, b)
    return RawGrads(dq=t.dq, dk=t.dk, dv=t.dv, dbias=t.dz, dsinks=dsinks, dtables=t.dtables)
