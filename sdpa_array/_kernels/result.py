"""What the kernels return, and how it becomes the public return value.

:class:`AttentionResult` (forward) and :class:`RawGrads` (backward) are in the compute dtype
and the kernels' layout; :func:`finalize` and :func:`finish_gradients` cast, broadcast or sum
them to the shapes and dtypes the caller's arrays promise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._arrays.compat import on_device_of
from .._arrays.typing import Array
from .._problem.mod_parameters import declared_parameters
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .layout import broadcast_if_needed, sum_to_shape, ungroup

__all__ = [
    "AttentionResult",
    "RawGrads",
    "empty_result",
    "finalize",
    "finish_gradients",
    "zero_gradients",
]


@dataclass(frozen=True)
class AttentionResult:
    """Output of a forward kernel, before dtype casting and broadcasting.

    Attributes
    ----------
    out : array
        ``(..., Hq, L, Ev)`` in the compute dtype (or already in the input dtype).
    weights : array or None
        ``(..., Hq, L, S)`` attention probabilities, when requested.
    lse : array or None
        ``(..., Hq, L)`` log-sum-exp of the final scores, when requested.
    row_maxima : array or None
        ``(..., Hq, L)``, when the maximum scores are requested: each query row's largest
        ``scale · q·k`` over its admissible keys (``-inf`` where it has none), or that of
        the rows of its query block (the blocked kernel's fixed reference): their maximum
        over the rows is the same; :func:`finalize` reduces them over the rows.
    """

    out: Array
    weights: Array = None
    lse: Array = None
    row_maxima: Array = None


@dataclass(frozen=True)
class RawGrads:
    """Gradients of a backward kernel, before they are summed to the inputs' shapes.

    ``dq`` is in the grouped query layout; ``dk`` and ``dv`` are ``(..., Hkv, S, E|Ev)``
    with the query heads of each group already summed; ``dbias`` is the score gradient,
    reduced at least to something that broadcasts to the grouped scores (``None`` without
    a bias). ``dsinks`` is the sinks' gradient ``(..., 1, 1)`` in the grouped layout
    (``None`` without sinks). ``dtables`` holds the gradients of the parameters of
    ``score_mod`` and ``bias_mod`` (in that order), each of its parameter's shape, when they
    are asked for (``Problem.mod_gradients``).
    Leading axes may still be those of the broadcast batch.
    """

    dq: Array
    dk: Array
    dv: Array
    dbias: Array = None
    dsinks: Array = None
    dtables: tuple[Array, ...] | None = None


def empty_result(p: Problem, sinks: Array | None = None) -> AttentionResult:
    """The defined answer when there are no queries or no keys: zeros and ``-inf``.

    With ``S == 0`` every query has no admissible key; with ``L == 0`` the arrays are empty.
    Some libraries (Dask) cannot reduce over empty axes, so neither case reaches a kernel.
    With ``sinks`` each row's softmax holds only its sink, so its log-sum-exp is the sink
    (differentiable: autograd passes the log-sum-exp's gradient to it).
    """
    xp = p.xp
    rows = p.score_shape[:-1]
    if sinks is None:
        lse = xp.full(rows, -math.inf, dtype=p.compute_dtype, device=p.device)
    else:
        lse = xp.broadcast_to(xp.astype(sinks, p.compute_dtype)[..., None], rows)
    return AttentionResult(
        out=xp.zeros(p.out_shape, dtype=p.dtype, device=p.device),
        weights=xp.zeros(p.score_shape, dtype=p.dtype, device=p.device),
        lse=lse,
        row_maxima=xp.full(p.score_shape[:-1], -math.inf, dtype=p.compute_dtype, device=p.device),
    )


def finalize(p: Problem, result: AttentionResult, outputs: Outputs) -> Array | tuple[Array, ...]:
    """Cast to the input dtype, broadcast to the full batch shape and pack the return value:
    ``out``, then the weights, the log-sum-exp and the maximum scores that ``outputs``
    asks for, in that order.

    ``out`` and ``weights`` take the input dtype; ``lse`` and the maximum scores stay in the
    compute dtype (float32 for float16/bfloat16 inputs, as FlashAttention returns the
    log-sum-exp). The maximum scores are the rows' maxima reduced over the query axis
    (``-inf`` without queries).
    """
    xp = p.xp
    out = broadcast_if_needed(xp, xp.astype(result.out, p.dtype, copy=False), p.out_shape)
    if not (outputs.weights or outputs.lse or outputs.max_scores):
        return out
    extras: list[Array] = [out]
    if outputs.weights:
        weights = xp.astype(result.weights, p.dtype, copy=False)
        extras.append(broadcast_if_needed(xp, weights, p.score_shape))
    if outputs.lse:
        lse = xp.astype(result.lse, p.compute_dtype, copy=False)
        extras.append(broadcast_if_needed(xp, lse, p.score_shape[:-1]))
    if outputs.max_scores:
        rows = xp.astype(result.row_maxima, p.compute_dtype, copy=False)
        rows = broadcast_if_needed(xp, rows, p.score_shape[:-1])
        if p.L == 0:
            maxima = xp.full(p.score_shape[:-2], -math.inf, dtype=rows.dtype, device=p.device)
        else:
            # keepdims, then an ellipsis index: NumPy reduces 1-D arrays to scalars
            maxima = xp.max(rows, axis=-1, keepdims=True)[..., 0]
        extras.append(maxima)
    return tuple(extras)


def _mod_parameters(p: Problem) -> tuple[Array, ...]:
    """The parameters of ``score_mod`` and ``bias_mod`` whose gradients are asked for
    (none otherwise)."""
    return declared_parameters(p.score_mod, p.bias_mod) if p.mod_gradients else ()


def zero_gradients(p: Problem, x: Inputs) -> tuple[Array, ...]:
    """Gradients when nothing reaches the output (``L == 0`` or ``S == 0``): zeros (those
    of the mods' parameters too, when asked for)."""
    arrays = (*x.differentiable, *_mod_parameters(p))
    return tuple(p.xp.zeros(a.shape, dtype=a.dtype, device=p.device) for a in arrays)


def finish_gradients(p: Problem, x: Inputs, raw: RawGrads) -> tuple[Array, ...]:
    """Sum each gradient to its input's shape and cast it to that input's dtype.

    Returns ``(grad_query, grad_key, grad_value)``, then ``grad_bias`` when there is a bias,
    ``grad_sinks`` when there are sinks, ``grad_scale`` when ``scale`` is an array and the
    gradients of the parameters of ``score_mod`` and ``bias_mod`` when they are asked for.
    ``grad_scale`` comes from ``dQ``: every score is ``scale · q·k``, so
    ``dL/dscale = Σ dS ⊙ (Q Kᵀ) = Σ Q ⊙ dQ / scale``.
    """
    xp = p.xp
    grads = [ungroup(p, raw.dq), raw.dk, raw.dv]
    if x.bias is not None:
        grads.append(ungroup(p, raw.dbias))
    if x.sinks is not None:
        grads.append(ungroup(p, raw.dsinks)[..., 0, 0])
    summed = [
        sum_to_shape(xp, g, tuple(a.shape)) for g, a in zip(grads, x.differentiable, strict=False)
    ]
    if x.scale is not None:
        q = xp.astype(x.query, summed[0].dtype, copy=False)
        scale = xp.astype(x.scale, summed[0].dtype)
        summed.append(xp.sum(q * summed[0], keepdims=True) / scale)
    grads = [
        xp.astype(g, a.dtype, copy=False) for g, a in zip(summed, x.differentiable, strict=True)
    ]
    if x.scale is not None:  # summed with keepdims: NumPy's 0-d arithmetic gives scalars
        grads[-1] = xp.reshape(grads[-1], ())
    parameters = _mod_parameters(p)
    if parameters:
        tables = raw.dtables or tuple(
            xp.zeros(a.shape, dtype=p.compute_dtype, device=p.device) for a in parameters
        )
        for g, a in zip(tables, parameters, strict=True):  # on the parameter's device
            grads.append(on_device_of(xp, xp.astype(g, a.dtype), a))
    return tuple(grads)
