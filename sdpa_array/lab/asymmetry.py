"""``Q`` and ``K`` are not interchangeable: the two softmaxes and the gradients to each."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..testing.backends import Backend
from ._plumbing import configured, host, namespace_of, normal
from .backward import attention_vjp, score_gradient
from .softmax_and_jacobian import softmax

__all__ = ["QueryKeyAsymmetry", "query_key_asymmetry"]


@dataclass(frozen=True)
class QueryKeyAsymmetry:
    """Self-attention scores, their two softmaxes, and the gradients to ``Q`` and ``K``.

    Made by :func:`query_key_asymmetry`; each parameter is the field of the same name.

    Parameters
    ----------
    scores : numpy.ndarray, shape (n, n)
        ``S = scale · Q Kᵀ``; row ``i`` is query ``i``, column ``j`` key ``j``.
    weights : numpy.ndarray, shape (n, n)
        ``softmax(S)`` by rows: how each query distributes its attention (rows sum to 1).
    swapped_weights : numpy.ndarray, shape (n, n)
        ``softmax(Sᵀ)`` by rows, i.e. ``Q`` and ``K`` exchanged: row ``j`` is how key ``j``'s
        incoming attention splits over the queries (rows sum to 1).
    grad_scores : numpy.ndarray, shape (n, n)
        ``dS = P ∘ (dP - rowsum(dP ∘ P))`` for a random upstream gradient ``dO``.
    grad_query : numpy.ndarray, shape (n, d_k)
        ``dL/dQ = scale · dS K``, from :data:`attention_vjp`.
    grad_key : numpy.ndarray, shape (n, d_k)
        ``dL/dK = scale · dSᵀ Q``, from :data:`attention_vjp`.
    """

    scores: np.ndarray
    weights: np.ndarray
    swapped_weights: np.ndarray
    grad_scores: np.ndarray
    grad_query: np.ndarray
    grad_key: np.ndarray

    @property
    def received(self) -> np.ndarray:
        """Column sums of :attr:`weights`: the total attention each key receives."""
        return np.asarray(self.weights.sum(axis=0))

    @property
    def max_swap_difference(self) -> float:
        """``max |softmax(S) - softmax(Sᵀ)ᵀ|``: 0 only if both normalizations agree."""
        return float(np.max(np.abs(self.weights - self.swapped_weights.T)))

    @property
    def grad_query_sum(self) -> np.ndarray:
        """``Σ_i dL/dQ_i``: nothing forces it to 0."""
        return np.asarray(self.grad_query.sum(axis=0))

    @property
    def grad_key_sum(self) -> np.ndarray:
        """``Σ_j dL/dK_j = scale · Qᵀ (dS 1) = 0``, since every row of ``dS`` sums to 0.

        Adding one vector to every key adds a constant to each row of scores, which the
        row softmax ignores; this is the gradient of that invariance.
        """
        return np.asarray(self.grad_key.sum(axis=0))


def query_key_asymmetry(
    n: int = 8,
    d_k: int = 16,
    d_v: int = 16,
    *,
    backend: Backend | str = "numpy",
    dtype: str = "float64",
    seed: int = 0,
) -> QueryKeyAsymmetry:
    """Compare ``softmax(S)`` with ``softmax(Sᵀ)`` and ``dL/dQ`` with ``dL/dK`` on one problem.

    Parameters
    ----------
    n : int, default 8
        Sequence length (``n`` queries and ``n`` keys, as in self-attention).
    d_k, d_v : int, default 16
        Query/key and value widths.
    backend : Backend or str, default "numpy"
        Where the inputs are placed and the arithmetic runs: a backend or its id in
        :data:`sdpa_array.testing.backends.BACKENDS`.
    dtype : str, default "float64"
        Floating dtype on the backend.
    seed : int, default 0
        Seed of the NumPy generator.

    Returns
    -------
    QueryKeyAsymmetry
        The scores with ``scale = 1 / sqrt(d_k)``, both softmaxes, ``dS`` and the gradients
        to ``Q`` and ``K`` for a random upstream gradient.

    Notes
    -----
    :ref:`theory-asymmetry`: the softmax normalizes over keys, so ``softmax(S)`` has unit row
    sums but arbitrary column sums, and exchanging ``Q`` and ``K`` normalizes over queries
    instead. In the backward pass the rows of ``dS`` sum to 0 (the Jacobian
    ``diag(p) - p pᵀ`` annihilates constants), so ``dL/dQ_i = scale · Σ_j dS_ij k_j`` is a
    zero-sum contrast of keys, while ``dL/dK_j = scale · Σ_i dS_ij q_i`` weights queries by
    column entries of ``dS`` that need not sum to 0; consequently
    ``Σ_j dL/dK_j = 0`` exactly and ``Σ_i dL/dQ_i`` is not.
    """
    b = configured(backend)
    rng = np.random.default_rng(seed)
    query = normal(b, rng, (n, d_k), dtype)
    key = normal(b, rng, (n, d_k), dtype)
    value = normal(b, rng, (n, d_v), dtype)
    grad_output = normal(b, rng, (n, d_v), dtype)
    xp = namespace_of(query=query, key=key)
    scale = 1.0 / math.sqrt(d_k)
    scores = xp.matmul(query, xp.matrix_transpose(key)) * scale
    weights = softmax(scores)
    grad_query, grad_key, _ = attention_vjp(query, key, value, grad_output, scale=scale)
    return QueryKeyAsymmetry(
        scores=host(scores),
        weights=host(weights),
        swapped_weights=host(softmax(xp.matrix_transpose(scores))),
        grad_scores=host(score_gradient(weights, grad_output, value)),
        grad_query=host(grad_query),
        grad_key=host(grad_key),
    )
