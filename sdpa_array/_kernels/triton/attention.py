"""The Triton implementation's forward and backward entries, in the kernel contracts.

:func:`triton_attention` and :func:`triton_vjp` take a validated
:class:`~sdpa_array._problem.problem.Problem` and the caller's
:class:`~sdpa_array._problem.problem.Inputs`
(as every row of :data:`sdpa_array._plan.dispatch.IMPLEMENTATIONS` does) and return an
:class:`~sdpa_array._kernels.result.AttentionResult` or
:class:`~sdpa_array._kernels.result.RawGrads`.
Outputs are allocated with the inputs' library on their device; the kernels write them.
:func:`run_forward` and :func:`run_backward` are the same with fixed block sizes and the
kernels' tile counts, for tests. Calls have ``L, S > 0`` (the public entries answer empty
calls before any kernel runs, as for the other implementations).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._arrays.typing import Array
from ..._problem.outputs import Outputs
from ..._problem.problem import Inputs, Problem
from ..layout import ungroup
from ..operands import prepare, prepare_rows, tile_scores
from ..result import AttentionResult, RawGrads
from ..softmax import exp_shift
from .configs import Blocks, default_blocks
from .operands import ForwardOperands, forward_operands, strided
from .plan import plan_triton

__all__ = [
    "BackwardRun",
    "ForwardRun",
    "run_backward",
    "run_forward",
    "triton_attention",
    "triton_vjp",
]


@dataclass(frozen=True)
class ForwardRun:
    """The forward kernel's results.

    ``out`` ``(..., Hq, L, Ev)`` in the inputs' dtype, ``lse`` ``(..., Hq, L)`` in float32,
    where asked for ``row_maxima`` ``(..., Hq, L)`` in float32 (each row's largest
    ``scale · q·k`` over its admissible keys) and, when counted, ``counts``: the key blocks
    each query block computed, ``(Z * H, blocks)`` with query blocks in order.
    """

    out: Array
    lse: Array
    counts: Array = None
    row_maxima: Array = None


@dataclass(frozen=True)
class BackwardRun:
    """The backward kernels' results: the raw gradients and, when counted, the key blocks
    each query block visited (``dQ`` kernel) and the query blocks each key block visited
    (``dK``/``dV`` kernel, over its group's heads)."""

    grads: RawGrads
    query_counts: Array = None
    key_counts: Array = None


def _reversed_blocks(p: Problem, counts: Array, programs: int, n: int) -> Array:
    """Per-program counts as ``(programs, n)`` with blocks in order (the forward and ``dQ``
    kernels run each batch element's query blocks last first)."""
    xp = p.xp
    c = xp.reshape(counts, (programs, n))
    return xp.flip(c, axis=1)


def _heads_shape(p: Problem) -> tuple[int, ...]:
    return p.batch_shape or (1,)


def run_forward(
    p: Problem,
    x: Inputs,
    *,
    blocks: Blocks | None = None,
    count: bool = False,
    ops: ForwardOperands | None = None,
    max_scores: bool = False,
) -> ForwardRun:
    """Run the forward kernel (``blocks``: fixed block sizes; ``count``: also the counts;
    ``ops``: the operands when the caller prepared them; ``max_scores``: also the rows'
    maxima)."""
    from .launch import device_context, launch_forward

    xp = p.xp
    ops = ops or forward_operands(p, x)
    s = ops.shape
    out = xp.empty(p.out_shape, dtype=p.dtype, device=p.device)
    lse = xp.empty(p.score_shape[:-1], dtype=xp.float32, device=p.device)
    rows = xp.empty(p.score_shape[:-1], dtype=xp.float32, device=p.device) if max_scores else None
    if s.Z * s.H == 0:
        return ForwardRun(out, lse, row_maxima=rows)
    lead = len(s.outer)
    out_view = strided(xp, out, (*s.heads, p.L, p.Ev), lead)
    lse_view = strided(xp, lse, (*s.heads, p.L), lead)
    rows_view = None if rows is None else strided(xp, rows, (*s.heads, p.L), lead)
    with device_context(x.query):
        counts = launch_forward(
            p, ops, out_view, lse_view, row_max=rows_view, blocks=blocks, count=count
        )
    if count:
        n = -(-p.L // (blocks.block_m if blocks else _default_m(p)))
        counts = _reversed_blocks(p, counts, s.Z * s.H, n)
    return ForwardRun(out, lse, counts, rows)


def _default_m(p: Problem) -> int:
    return default_blocks(p).block_m


def _gradient_dtype(
    p: Problem, raw_shape: tuple[int, ...], given: tuple[int, ...], *, feeds_scale: bool = False
) -> object:
    """The inputs' dtype when the kernel's gradient is final (its shape is the input's, and
    no scale gradient is formed from it: ``feeds_scale`` for ``dQ`` with an array scale),
    else float32, so that the sums after the kernel round once."""
    final = tuple(raw_shape) == tuple(given) and not (feeds_scale and p.scale_is_array)
    return p.dtype if final else p.xp.float32


def run_backward(
    p: Problem,
    x: Inputs,
    grad_output: Array,
    *,
    out: Array = None,
    lse: Array = None,
    grad_lse: Array = None,
    blocks: Blocks | None = None,
    key_blocks: Blocks | None = None,
    count: bool = False,
) -> BackwardRun:
    """Run the backward kernels (the forward first when ``out``/``lse`` are not given);
    ``blocks`` fixes the block sizes, ``key_blocks`` those of the ``dK``/``dV`` kernel."""
    from .launch import device_context, launch_backward

    xp = p.xp
    ops = forward_operands(p, x)
    s = ops.shape
    if out is None or lse is None:
        forward = run_forward(p, x, blocks=blocks, ops=ops)
        out, lse = forward.out, forward.lse
    lead = len(s.outer)
    heads = s.heads
    dq_shape = (*heads, p.L, p.E)
    dq_dtype = _gradient_dtype(p, dq_shape, tuple(x.query.shape), feeds_scale=True)
    dq = xp.empty(dq_shape, dtype=dq_dtype, device=p.device)
    dk_shape, dv_shape = (*s.kv_heads, p.S, p.E), (*s.kv_heads, p.S, p.Ev)
    dk = xp.empty(dk_shape, dtype=_gradient_dtype(p, dk_shape, tuple(x.key.shape)), device=p.device)
    dv = xp.empty(
        dv_shape, dtype=_gradient_dtype(p, dv_shape, tuple(x.value.shape)), device=p.device
    )
    dbias = None
    if x.bias is not None:
        dbias = xp.zeros((*heads, p.L, p.S), dtype=xp.float32, device=p.device)
    delta = xp.empty((*heads, p.L), dtype=xp.float32, device=p.device)
    lse = xp.astype(lse, xp.float32, copy=False)
    query_counts = key_counts = None
    if s.Z * s.H:
        with device_context(x.query):
            query_counts, key_counts = launch_backward(
                p,
                ops,
                out=strided(xp, out, (*heads, p.L, p.Ev), lead),
                lse=strided(xp, lse, (*heads, p.L), lead),
                d_out=strided(xp, grad_output, (*heads, p.L, p.Ev), lead),
                grad_lse=None if grad_lse is None else strided(xp, grad_lse, (*heads, p.L), lead),
                delta=strided(xp, delta, (*heads, p.L), lead),
                dq=strided(xp, dq, dq_shape, lead),
                dk=strided(xp, dk, dk_shape, lead),
                dv=strided(xp, dv, dv_shape, lead),
                dbias=None if dbias is None else strided(xp, dbias, (*heads, p.L, p.S), lead),
                blocks=blocks,
                key_blocks=key_blocks,
                count=count,
            )
    if count:
        b = blocks.block_m if blocks else _default_m(p)
        query_counts = _reversed_blocks(p, query_counts, s.Z * s.H, -(-p.L // b))
    grads = RawGrads(
        dq=_grouped(p, dq, p.L, p.E),
        dk=_without_batch(p, dk),
        dv=_without_batch(p, dv),
        dbias=None if dbias is None else _grouped(p, dbias, p.L, p.S),
        dsinks=None if x.sinks is None else _sink_gradient(p, x, lse, delta),
    )
    return BackwardRun(grads, query_counts, key_counts)


def _grouped(p: Problem, a: Array, n: int, m: int) -> Array:
    """A ``(*batch, Hq, n, m)`` array in the grouped kernel layout of the other kernels."""
    return p.xp.reshape(a, (*p.kernel_batch, n, m))


def _without_batch(p: Problem, a: Array) -> Array:
    """Drop the heads axis that inputs without a batch got."""
    return a if p.batch_shape else a[0]


def _sink_gradient(p: Problem, x: Inputs, lse: Array, delta: Array) -> Array:
    """``dSinks = -sum_i exp(sink - lse_i) D_i`` per batch element and head, in the grouped
    layout ``(..., 1, 1)`` (``D`` includes the log-sum-exp cotangent)."""
    xp = p.xp
    heads = _heads_shape(p)
    sink = xp.broadcast_to(xp.astype(x.sinks, xp.float32), p.batch_shape)
    sink = xp.reshape(sink, (*heads, 1))
    lse = xp.reshape(xp.broadcast_to(lse, p.score_shape[:-1]), (*heads, p.L))
    grad = -xp.sum(xp.exp(sink - lse) * delta, axis=-1)
    return xp.reshape(grad, (*p.kernel_batch, 1, 1))


def _weights(p: Problem, x: Inputs, lse: Array) -> Array:
    """The attention weights ``exp(scores - lse)`` (after dropout), formed once with the
    shared score builder of the other kernels."""
    xp = p.xp
    ops = prepare(p, x)
    rows, cols = slice(0, p.L), slice(0, p.S)
    s, _ = tile_scores(p, ops, ops.q, rows, cols)
    lse_rows = exp_shift(p, prepare_rows(p, lse, features=False))
    w = xp.exp(s - lse_rows)
    if ops.dropout is not None:
        w = ops.dropout.tile(xp, w, rows, cols, p.device, scaled=True)
    return ungroup(p, w)


def triton_attention(p: Problem, x: Inputs, outputs: Outputs) -> AttentionResult:
    """Attention fused in one Triton kernel (GPU); memory ``O(L)`` beyond the output.

    The contract of :class:`sdpa_array._plan.dispatch.ForwardKernel`. ``out`` comes in the
    inputs' dtype (float32 accumulation) and ``lse`` in float32. With ``return_weights``
    the weights are formed afterwards as ``exp(scores - lse)`` by the shared score code
    (the whole score matrix, as the weights are).

    Raises
    ------
    CannotUseTritonError
        Where :func:`~.plan.plan_triton` refuses the call.
    """
    plan_triton(p, x)
    r = run_forward(p, x, max_scores=outputs.max_scores)
    weights = _weights(p, x, r.lse) if outputs.weights else None
    lse = r.lse if outputs.lse else None
    return AttentionResult(out=r.out, weights=weights, lse=lse, row_maxima=r.row_maxima)


def triton_vjp(
    p: Problem,
    x: Inputs,
    grad_output: Array,
    *,
    out: Array = None,
    lse: Array = None,
    grad_lse: Array = None,
) -> RawGrads:
    """Gradients by the Triton backward kernels (the contract of
    :class:`sdpa_array._plan.dispatch.BackwardKernel`).

    ``out`` and ``lse`` are the forward's (both or neither: without them the forward kernel
    runs first); ``grad_lse`` is the log-sum-exp's cotangent. ``dq``, ``dk``, ``dv`` come in
    the inputs' dtype where no broadcast axis remains to be summed (else float32), ``dbias``
    as the full float32 score gradient ``(..., Hkv, G, L, S)``, which
    :func:`~sdpa_array._kernels.result.finish_gradients` sums to the bias's shape.

    Raises
    ------
    CannotUseTritonError
        Where :func:`~.plan.plan_triton` refuses the call.
    """
    plan_triton(p, x)
    return run_backward(p, x, grad_output, out=out, lse=lse, grad_lse=grad_lse).grads
