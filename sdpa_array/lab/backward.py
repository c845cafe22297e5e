"""The backward pass of attention from the chain rule, and the one the experiments call."""

from __future__ import annotations

import math
from typing import Any

from .._api.vjp import scaled_dot_product_attention_vjp
from ._plumbing import namespace_of
from .softmax_and_jacobian import softmax

__all__ = ["attention_vjp", "attention_vjp_from_derivation", "score_gradient"]


def score_gradient(p: Any, grad_output: Any, value: Any) -> Any:
    """``dS = P ∘ (dP - rowsum(dP ∘ P))`` with ``dP = dO Vᵀ``: the cotangent of the scores."""
    xp = namespace_of(p=p, grad_output=grad_output, value=value)
    dp = xp.matmul(grad_output, xp.matrix_transpose(value))
    return p * (dp - xp.sum(dp * p, axis=-1, keepdims=True))


def attention_vjp_from_derivation(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    /,
    *,
    scale: float | None = None,
) -> tuple[Any, Any, Any]:
    """Gradients of ``softmax(scale · Q Kᵀ) V`` written out from the chain rule.

    Parameters
    ----------
    query : array, shape (..., L, E)
        Queries ``Q``.
    key : array, shape (..., S, E)
        Keys ``K``, in the library of ``query``.
    value : array, shape (..., S, Ev)
        Values ``V``.
    grad_output : array, shape (..., L, Ev)
        Cotangent ``dO`` of the output.
    scale : float, optional
        Score scale; default ``1 / sqrt(E)``.

    Returns
    -------
    grad_query, grad_key, grad_value : array
        ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q`` and ``dV = Pᵀ dO``, in the inputs'
        library, dtype and device.

    Notes
    -----
    With ``P = softmax(scale · Q Kᵀ)`` row-wise: ``dV = Pᵀ dO``, ``dP = dO Vᵀ``; the softmax
    Jacobian ``diag(p) - p pᵀ`` applied to each row of ``dP`` gives
    ``dS = P ∘ (dP - rowsum(dP ∘ P))``; and ``S = scale · Q Kᵀ`` gives ``dQ = scale · dS K``
    and ``dK = scale · dSᵀ Q`` (see :ref:`theory-backward`). No masks: the experiments do not need
    them.
    """
    xp = namespace_of(query=query, key=key, value=value, grad_output=grad_output)
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    p = softmax(xp.matmul(query, xp.matrix_transpose(key)) * s)
    ds = score_gradient(p, grad_output, value)
    grad_query = xp.matmul(ds, key) * s
    grad_key = xp.matmul(xp.matrix_transpose(ds), query) * s
    grad_value = xp.matmul(xp.matrix_transpose(p), grad_output)
    return grad_query, grad_key, grad_value


#: The VJP the gradient experiments call: the library's own backward pass
#: (:func:`sdpa_array.scaled_dot_product_attention_vjp`), which
#: :func:`attention_vjp_from_derivation` spells out step by step for the unmasked case.
attention_vjp = scaled_dot_product_attention_vjp
