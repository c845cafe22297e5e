"""Safe softmax pieces: scores to probabilities and log-sum-exps without NaN.

A row with no admissible key has only ``-inf`` scores. These helpers never form
``inf - inf`` or ``log(0)`` for such a row, so it gets weights and output of exactly zero and
a log-sum-exp of ``-inf``. A row with a NaN score gets NaN in both.
"""

from __future__ import annotations

import math

from .._arrays import products
from .._arrays.typing import Array
from .._problem.problem import Problem

__all__ = ["exp_shift", "log_sum_exp", "row_sum", "safe_reciprocal", "safe_row_max"]


def exp_shift(p: Problem, x: Array) -> Array:
    """``x`` (a row maximum or log-sum-exp) with ``-inf`` replaced by 0, to subtract before ``exp``.

    A row whose reference is ``-inf`` has only ``-inf`` scores: ``exp(score - 0)`` gives its
    exact zeros, where ``exp(-inf - (-inf))`` would give NaN.
    """
    xp = p.xp
    return xp.where(x == -math.inf, xp.zeros_like(x), x)


def safe_row_max(p: Problem, s: Array) -> Array:
    """Row maximum ``(..., 1)`` of the scores, with ``-inf`` replaced by 0 (:func:`exp_shift`)."""
    return exp_shift(p, p.xp.max(s, axis=-1, keepdims=True))


def row_sum(p: Problem, e: Array, *, strided: bool = False) -> Array:
    """Row sums ``(..., 1)`` of ``e`` as a matrix product with a column of ones.

    The product is a single pass over ``e`` in the library's BLAS, where a reduction along
    the last axis is not always one (NumPy's pairwise sum of 256 x 1024 float32 takes 3.5x
    the time of the product on the development machine). ``strided``: ``e`` is the
    transposed view of a contiguous array (:func:`~sdpa_array._arrays.products.scores`),
    whose rows OpenBLAS would sum in one chain each: they are summed in runs of
    :data:`~sdpa_array._arrays.products.CHUNK` keys, one batched product, and the runs' sums
    added (:func:`_strided_row_sum`).
    """
    if strided:
        return _strided_row_sum(p, e)
    ones = p.xp.ones((int(e.shape[-1]), 1), dtype=e.dtype, device=p.device)
    return p.xp.matmul(e, ones)


def _strided_row_sum(p: Problem, e: Array) -> Array:
    xp = p.xp
    t = xp.matrix_transpose(e)  # (..., n, rows), contiguous
    n, rows, lead = int(t.shape[-2]), int(t.shape[-1]), tuple(t.shape[:-2])
    whole = n // products.CHUNK * products.CHUNK
    parts = []
    if whole:
        runs = xp.reshape(t[..., :whole, :], (*lead, whole // products.CHUNK, products.CHUNK, rows))
        ones = xp.ones((1, products.CHUNK), dtype=e.dtype, device=p.device)
        parts.append(xp.sum(xp.matmul(ones, runs), axis=-3))
    if whole < n:
        ones = xp.ones((1, n - whole), dtype=e.dtype, device=p.device)
        parts.append(xp.matmul(ones, t[..., whole:, :]))
    total = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return xp.matrix_transpose(total)


def safe_reciprocal(p: Problem, total: Array) -> Array:
    """``1 / total`` where ``total > 0``, else 0 (rows with no admissible key)."""
    xp = p.xp
    positive = total > 0
    return xp.where(positive, 1.0 / xp.where(positive, total, xp.ones_like(total)), 0.0)


def log_sum_exp(p: Problem, row_max: Array, total: Array) -> Array:
    """``row_max + log(total)``, and ``-inf`` where ``total == 0`` (no admissible key);
    drops the last axis. A NaN ``total`` (a NaN score) gives NaN, as the output does."""
    xp = p.xp
    empty = total == 0
    lse = row_max + xp.log(xp.where(empty, xp.ones_like(total), total))
    lse = xp.where(empty, xp.asarray(-math.inf, dtype=lse.dtype, device=p.device), lse)
    return lse[..., 0]
