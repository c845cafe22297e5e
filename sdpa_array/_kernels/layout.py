"""Array layout helpers shared by every kernel: axes, batch slices, tiles and groups.

The kernels work on the *kernel layout*: every operand has ``len(batch) + 2`` axes, where
``batch`` is the broadcast batch shape with, under grouped-query attention, the query heads
split into ``(Hkv, G)`` (:attr:`Problem.kernel_batch`). Axes of size 1 broadcast. The helpers
below move arrays into and out of that layout, cut tiles and batch slices out of it, and
put results back together; none of them computes anything.
"""

from __future__ import annotations

from types import ModuleType

from .._arrays.slicing import at_batch, tile_of
from .._arrays.typing import Array
from .._problem.problem import Problem

__all__ = [
    "at_batch",
    "broadcast_if_needed",
    "concat",
    "grouped_operand",
    "grouped_score_term",
    "leading_axes",
    "merge_groups",
    "sum_to_shape",
    "tile_of",
    "ungroup",
]


def leading_axes(xp: ModuleType, x: Array, ndim: int) -> Array:
    """``x`` with leading axes of size 1 added up to ``ndim`` axes (``None`` stays ``None``)."""
    if x is None or x.ndim >= ndim:
        return x
    return xp.reshape(x, (1,) * (ndim - x.ndim) + tuple(x.shape))


def broadcast_if_needed(xp: ModuleType, x: Array, shape: tuple[int, ...]) -> Array:
    """``x`` broadcast to ``shape``, or ``x`` itself when it already has that shape."""
    return x if tuple(x.shape) == tuple(shape) else xp.broadcast_to(x, shape)


def concat(xp: ModuleType, parts: list[Array], axis: int) -> Array:
    """Concatenate ``parts`` along ``axis``; a single part is returned as it is."""
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=axis)


def grouped_operand(p: Problem, x: Array, *, query: bool) -> Array:
    """Reshape ``(..., H, N, X)`` into the grouped ``(..., Hkv, G|1, N, X)`` layout.

    Query-shaped arrays (``query=True``: queries, outputs, their cotangents) split their
    ``Hq`` heads into ``(Hkv, G)``; key-shaped arrays get a group axis of size 1.
    """
    shape = tuple(x.shape)
    heads = (p.heads_kv, p.groups) if query else (shape[-3], 1)
    return p.xp.reshape(x, (*shape[:-3], *heads, *shape[-2:]))


def grouped_score_term(p: Problem, x: Array) -> Array:
    """Reshape a mask/bias broadcastable to ``(..., Hq, L, S)`` into the grouped layout."""
    x = leading_axes(p.xp, x, len(p.score_shape))
    shape = tuple(x.shape)
    heads = (p.heads_kv, p.groups) if shape[-3] != 1 else (1, 1)
    return p.xp.reshape(x, (*shape[:-3], *heads, *shape[-2:]))


def ungroup(p: Problem, x: Array) -> Array:
    """Undo the grouped layout: ``(..., Hkv, G, L, X)`` back to ``(..., Hq, L, X)``."""
    if not p.grouped:
        return x
    shape = tuple(x.shape)
    return p.xp.reshape(x, (*shape[:-4], shape[-4] * shape[-3], *shape[-2:]))


def sum_to_shape(xp: ModuleType, x: Array, shape: tuple[int, ...]) -> Array:
    """Adjoint of broadcasting ``shape`` to ``x.shape``: sum the broadcast axes away."""
    shape = tuple(shape)
    extra = x.ndim - len(shape)
    if extra > 0:
        x = xp.sum(x, axis=tuple(range(extra)))
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 != n)
    if axes:
        x = xp.sum(x, axis=axes, keepdims=True)
    return x


def merge_groups(p: Problem, x: Array) -> Array:
    """Merge the group and row axes: ``(..., Hkv, G, n, X)`` to ``(..., Hkv, G * n, X)``.

    A product ``xᵀ y`` of two merged arrays then sums over the query heads of each group,
    which is the adjoint of sharing one key/value head among ``G`` query heads.
    """
    if not p.grouped:
        return x
    shape = tuple(x.shape)
    return p.xp.reshape(x, (*shape[:-3], shape[-3] * shape[-2], shape[-1]))
