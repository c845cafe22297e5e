"""Dot-product versus additive (Bahdanau) attention: the function, its flops, their times."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._api.forward import scaled_dot_product_attention
from ..testing.backends import Backend
from ._plumbing import configured, namespace_of, normal
from .softmax_and_jacobian import softmax

__all__ = [
    "AttentionCost",
    "FlopCount",
    "additive_attention",
    "additive_attention_flops",
    "attention_cost",
    "dot_product_attention_flops",
]


def additive_attention(
    query: Any,
    key: Any,
    value: Any,
    w_query: Any,
    w_key: Any,
    v_a: Any,
    /,
    *,
    return_weights: bool = False,
) -> Any:
    """Additive (Bahdanau) attention: scores ``v_aᵀ tanh(W q_i + U k_j)``.

    Parameters
    ----------
    query : array, shape (..., L, Dq)
        Queries ``q_i``.
    key : array, shape (..., S, Dk)
        Keys ``k_j``, in the library of ``query``.
    value : array, shape (..., S, Dv)
        Values, averaged with the softmax weights.
    w_query : array, shape (Da, Dq)
        ``W``, applied to every query once.
    w_key : array, shape (Da, Dk)
        ``U``, applied to every key once.
    v_a : array, shape (Da,)
        The vector that reduces ``tanh(W q_i + U k_j)`` to a score.
    return_weights : bool, default False
        Also return the softmax weights ``(..., L, S)``.

    Returns
    -------
    out : array, shape (..., L, Dv)
        ``softmax(scores) V``.
    weights : array, shape (..., L, S)
        Only if ``return_weights``.

    Notes
    -----
    The projections are computed once per query and once per key (``O(L Dq Da + S Dk Da)``);
    only the ``L S`` sums ``W q_i + U k_j``, their ``tanh`` and the dot products with ``v_a``
    are pairwise (``O(L S Da)``), materialized as an ``(..., L, S, Da)`` array. See
    :func:`additive_attention_flops`.
    """
    xp = namespace_of(query=query, key=key, value=value, w_query=w_query, w_key=w_key, v_a=v_a)
    projected_q = xp.matmul(query, xp.matrix_transpose(w_query))  # (..., L, Da)
    projected_k = xp.matmul(key, xp.matrix_transpose(w_key))  # (..., S, Da)
    hidden = xp.tanh(projected_q[..., :, None, :] + projected_k[..., None, :, :])
    weights = softmax(xp.sum(hidden * v_a, axis=-1))
    out = xp.matmul(weights, value)
    return (out, weights) if return_weights else out


@dataclass(frozen=True)
class FlopCount:
    """Floating-point operations of one attention evaluation, term by term.

    A multiply-add counts 2, and ``exp``/``tanh`` count 1 each; the softmax counts 5 per
    score (max, subtract, exp, sum, divide). Made by :func:`dot_product_attention_flops` and
    :func:`additive_attention_flops`; the parameter is the field of the same name.

    Parameters
    ----------
    terms : tuple of (str, int)
        Named terms ``(name, flops)``, in evaluation order.
    """

    terms: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        """Sum of the terms."""
        return sum(count for _, count in self.terms)


def dot_product_attention_flops(n: int, m: int, d_k: int, d_v: int) -> FlopCount:
    """Flops of ``softmax(Q Kᵀ / sqrt(d_k)) V`` for ``n`` queries and ``m`` keys.

    ``2 n m d_k`` (``Q Kᵀ``) + ``n m`` (scale) + ``5 n m`` (softmax) + ``2 n m d_v``
    (``P V``): ``O(n m d)``.

    Parameters
    ----------
    n, m : int
        Numbers of queries and keys.
    d_k, d_v : int
        Widths of queries and keys, and of values.

    Returns
    -------
    FlopCount
        The four terms above, in that order.

    Examples
    --------
    >>> dot_product_attention_flops(128, 128, 64, 64).total
    4292608
    """
    return FlopCount(
        (
            ("Q Kᵀ", 2 * n * m * d_k),
            ("scale", n * m),
            ("softmax", 5 * n * m),
            ("P V", 2 * n * m * d_v),
        )
    )


def additive_attention_flops(
    n: int, m: int, d_q: int, d_k: int, d_a: int, d_v: int, *, project_once: bool = True
) -> FlopCount:
    """Flops of additive attention ``softmax(v_aᵀ tanh(W q_i + U k_j)) V``.

    Parameters
    ----------
    n, m : int
        Numbers of queries and keys.
    d_q, d_k, d_a, d_v : int
        Widths of queries, keys, the hidden ``tanh`` layer and values.
    project_once : bool, default True
        ``True``: ``W q_i`` and ``U k_j`` are computed once per query and per key
        (``2 n d_a d_q + 2 m d_a d_k``), as :func:`additive_attention` does. ``False``: they
        are recomputed for every pair (``2 n m d_a (d_q + d_k)``), the count behind the
        often quoted ``O(n² d²)``.

    Returns
    -------
    FlopCount
        The two projections, ``W q + U k``, ``tanh``, the products with ``v_a``, the softmax
        and ``P V``, in that order.

    Notes
    -----
    Projected once, the pairwise work is ``n m d_a`` additions, ``n m d_a`` tanh and
    ``2 n m d_a`` for the products with ``v_a``: ``O(n m d_a + (n + m) d²)``, the same order
    as dot-product attention's ``O(n m d)``. What stays worse is the constant (``4 n m d_a``
    pairwise against ``2 n m d_k``), the ``n m d_a`` transcendental ``tanh`` evaluations, and
    that this work is elementwise on an ``n × m × d_a`` array instead of one matrix product.

    Examples
    --------
    >>> additive_attention_flops(128, 128, 64, 64, 64, 64).total
    8470528
    >>> additive_attention_flops(128, 128, 64, 64, 64, 64, project_once=False).total
    274808832
    """
    if project_once:
        projections = (
            ("W q (once per query)", 2 * n * d_a * d_q),
            ("U k (once per key)", 2 * m * d_a * d_k),
        )
    else:
        projections = (
            ("W q (per pair)", 2 * n * m * d_a * d_q),
            ("U k (per pair)", 2 * n * m * d_a * d_k),
        )
    return FlopCount(
        (
            *projections,
            ("W q + U k", n * m * d_a),
            ("tanh", n * m * d_a),
            ("v_aᵀ ·", 2 * n * m * d_a),
            ("softmax", 5 * n * m),
            ("P V", 2 * n * m * d_v),
        )
    )


@dataclass(frozen=True)
class AttentionCost:
    """Measured time and counted flops of dot-product and additive attention against ``d``.

    Made by :func:`attention_cost`; each parameter is the field of the same name.

    Parameters
    ----------
    dims : numpy.ndarray of int
        ``d = d_k = d_v = d_a`` (and the query/key width of additive attention).
    n : int
        Queries and keys (self-attention length).
    backend : str
        Backend id the times were measured on.
    dot_seconds : numpy.ndarray
        Best time of one call of :func:`sdpa_array.scaled_dot_product_attention`, per width.
    additive_seconds : numpy.ndarray
        Best time of one call of :func:`additive_attention`, per width.
    dot_flops : numpy.ndarray of int
        Total of :func:`dot_product_attention_flops`, per width.
    additive_flops : numpy.ndarray of int
        Total of :func:`additive_attention_flops`, projections computed once.
    additive_naive_flops : numpy.ndarray of int
        Total of :func:`additive_attention_flops`, projections recomputed per pair.
    """

    dims: np.ndarray
    n: int
    backend: str
    dot_seconds: np.ndarray
    additive_seconds: np.ndarray
    dot_flops: np.ndarray
    additive_flops: np.ndarray
    additive_naive_flops: np.ndarray


def _best_time(run: Any, args: tuple[Any, ...], repeats: int) -> float:
    """Best wall time of ``run(*args)`` after one warm-up.

    Reducing the result to a Python float forces the work on every backend (computes Dask
    graphs, waits for GPU queues and JAX's asynchronous dispatch).
    """
    xp = namespace_of(first=args[0])
    float(xp.sum(run(*args)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        float(xp.sum(run(*args)))
        best = min(best, time.perf_counter() - start)
    return best


def attention_cost(
    dims: Sequence[int] = (16, 32, 64, 128, 256),
    n: int = 128,
    *,
    backend: Backend | str = "numpy",
    dtype: str = "float32",
    repeats: int = 5,
    seed: int = 0,
) -> AttentionCost:
    """Time dot-product and additive attention of width ``d``, and count their flops.

    Parameters
    ----------
    dims : sequence of int, default (16, 32, 64, 128, 256)
        Widths ``d`` (used for ``d_k``, ``d_v`` and ``d_a``).
    n : int, default 128
        Sequence length (``n`` queries attend ``n`` keys).
    backend : Backend or str, default "numpy"
        Where the inputs are placed and the calls are timed: a backend or its id in
        :data:`sdpa_array.testing.backends.BACKENDS`.
    dtype : str, default "float32"
        Floating dtype on the backend.
    repeats : int, default 5
        Timed calls per width, after one warm-up call; the best is kept.
    seed : int, default 0
        Seed of the NumPy generator.

    Returns
    -------
    AttentionCost
        Best times and flop counts of both kinds of attention, per width.
    """

    b = configured(backend)
    rng = np.random.default_rng(seed)
    dot_t, add_t, flops = [], [], []
    for d in dims:
        q, k, v = (normal(b, rng, (n, d), dtype) for _ in range(3))
        w_q = b.asarray(rng.standard_normal((d, d)) / math.sqrt(d), dtype)
        w_k = b.asarray(rng.standard_normal((d, d)) / math.sqrt(d), dtype)
        v_a = normal(b, rng, (d,), dtype)
        dot_t.append(_best_time(scaled_dot_product_attention, (q, k, v), repeats))
        add_t.append(_best_time(additive_attention, (q, k, v, w_q, w_k, v_a), repeats))
        flops.append(
            (
                dot_product_attention_flops(n, n, d, d).total,
                additive_attention_flops(n, n, d, d, d, d).total,
                additive_attention_flops(n, n, d, d, d, d, project_once=False).total,
            )
        )
    f = np.asarray(flops, dtype=np.int64).reshape(len(dims), 3)
    return AttentionCost(
        dims=np.asarray(dims, dtype=np.int64),
        n=n,
        backend=b.id,
        dot_seconds=np.asarray(dot_t),
        additive_seconds=np.asarray(add_t),
        dot_flops=f[:, 0],
        additive_flops=f[:, 1],
        additive_naive_flops=f[:, 2],
    )
