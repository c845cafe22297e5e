"""The materialized backward kernel: one tile holding the whole ``(..., L, S)`` score matrix.

The backward counterpart of :mod:`.materialized`: the probabilities are the softmax of the
full score matrix (or ``exp(Z - lse)`` when the forward pass's log-sum-exp is at hand), and
every product runs once over all queries and keys. Memory is ``O(L * S)`` per batch element;
:mod:`.vjp_blocked` is the ``O(block)`` version.
"""

from __future__ import annotations

from .._arrays.typing import Array
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .gradients import prepare_backward, sink_gradient, tile_gradients
from .materialized import materialized_attention
from .operands import prepare
from .result import RawGrads
from .score_bound import chunks_from_bound

__all__ = ["materialized_vjp"]


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
    ops, _ = chunks_from_bound(p, prepare(p, x))  # products cut where the scores may be large
    b = prepare_backward(p, x, grad_output, ops=ops, out=out, lse=lse, grad_lse=grad_lse)
    rows = slice(0, p.L)
    t = tile_gradients(p, b.ops, b.rows(p, rows), rows, slice(0, p.S), need_dz=x.bias is not None)
    dsinks = t.dsink if x.sinks is None or b.lse is None else sink_gradient(p, b)
    return RawGrads(dq=t.dq, dk=t.dk, dv=t.dv, dbias=t.dz, dsinks=dsinks, dtables=t.dtables)
