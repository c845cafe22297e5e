"""Softmax and its Jacobian ``diag(p) - p pᵀ``, in the arrays' own library."""

from __future__ import annotations

from typing import Any

from .._arrays.compat import device
from ._plumbing import namespace_of

__all__ = ["softmax", "softmax_jacobian"]


def softmax(x: Any, /, *, axis: int = -1) -> Any:
    """Numerically stable softmax along ``axis``: ``exp(x - max) / sum(exp(x - max))``.

    Parameters
    ----------
    x : array
        Finite logits of a real floating dtype.
    axis : int, default -1
        Axis along which the result sums to 1.

    Returns
    -------
    array
        Same shape, dtype, library and device as ``x``.
    """
    xp = namespace_of(x=x)
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


def softmax_jacobian(p: Any, /) -> Any:
    """Jacobian ``J = diag(p) - p pᵀ`` of softmax at probabilities ``p``.

    ``J[..., j, k] = ∂p_j / ∂z_k = p_j (δ_jk - p_k)`` (see :ref:`theory-softmax`).

    Parameters
    ----------
    p : array, shape (..., n)
        Probability vectors (rows summing to 1).

    Returns
    -------
    array, shape (..., n, n)
        Symmetric; its rows and columns sum to 0.

    Notes
    -----
    Its Frobenius norm has the closed form ``||J||_F² = Σ p_j² - 2 Σ p_j³ + (Σ p_j²)²``, so for
    ``p`` uniform over ``m`` positions ``||J||_F = sqrt(m - 1) / m`` (0 when one-hot). The
    sum of absolute entries is ``2 (1 - Σ p_j²)``, which bounds ``||J||_F`` and goes to 0 as
    ``p`` becomes one-hot.
    """
    xp = namespace_of(p=p)
    n = p.shape[-1]
    eye = xp.eye(n, dtype=p.dtype, device=device(p))
    return eye * p[..., :, None] - p[..., :, None] * p[..., None, :]
