"""The value every implementation returns, and how it becomes the public return value."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ._problem import Problem


@dataclass(frozen=True)
class AttentionResult:
    """Output of an implementation, before dtype casting and broadcasting.

    Attributes
    ----------
    out : array
        ``(..., Hq, L, Ev)`` in the compute dtype (or already in the input dtype).
    weights : array or None
        ``(..., Hq, L, S)`` attention probabilities, when requested.
    lse : array or None
        ``(..., Hq, L)`` log-sum-exp of the final scores, when requested.
    """

    out: Any
    weights: Any = None
    lse: Any = None


def empty_result(p: Problem) -> AttentionResult:
    """The defined answer when there are no queries or no keys: zeros and ``-inf``.

    With ``S == 0`` every query has no admissible key; with ``L == 0`` the arrays are empty.
    Some libraries (Dask) cannot reduce over empty axes, so neither case reaches them.
    """
    xp = p.xp
    return AttentionResult(
        out=xp.zeros(p.out_shape, dtype=p.dtype, device=p.device),
        weights=xp.zeros(p.score_shape, dtype=p.dtype, device=p.device),
        lse=xp.full(p.score_shape[:-1], -math.inf, dtype=p.compute_dtype, device=p.device),
    )


def finalize(p: Problem, result: AttentionResult, *, return_weights: bool, return_lse: bool) -> Any:
    """Cast to the input dtype, broadcast to the full batch shape and pack the return value.

    ``out`` and ``weights`` take the input dtype; ``lse`` stays in the compute dtype (float32
    for float16/bfloat16 inputs, as FlashAttention returns it).
    """
    xp = p.xp
    out = xp.astype(result.out, p.dtype, copy=False)
    if tuple(out.shape) != p.out_shape:
        out = xp.broadcast_to(out, p.out_shape)
    if not (return_weights or return_lse):
        return out
    extras: list[Any] = [out]
    if return_weights:
        weights = xp.astype(result.weights, p.dtype, copy=False)
        if tuple(weights.shape) != p.score_shape:
            weights = xp.broadcast_to(weights, p.score_shape)
        extras.append(weights)
    if return_lse:
        lse = xp.astype(result.lse, p.compute_dtype, copy=False)
        if tuple(lse.shape) != p.score_shape[:-1]:
            lse = xp.broadcast_to(lse, p.score_shape[:-1])
        extras.append(lse)
    return tuple(extras)
