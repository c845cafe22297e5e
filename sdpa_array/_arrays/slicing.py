"""Cutting batch slices and tiles out of arrays in the kernel layout.

Axes of size 1 broadcast, so they are never indexed: a slice or tile of a broadcast axis is
the whole (single) entry.
"""

from __future__ import annotations

from .typing import Array

__all__ = ["at_batch", "tile_of"]


def at_batch(x: Array, index: tuple[int, ...]) -> Array:
    """``x`` at the outer batch ``index`` (its size-1 axes broadcast, so they stay at 0)."""
    if x is None or not index:
        return x
    at = tuple(i if n != 1 else 0 for i, n in zip(index, x.shape, strict=False))
    key = (*at, Ellipsis)
    return x[key]


def tile_of(x: Array, rows: slice, cols: slice) -> Array:
    """The ``[..., rows, cols]`` tile of a term broadcastable to the scores.

    Axes of size 1 (broadcast) are kept whole instead of sliced.
    """
    if x is None:
        return None
    r = rows if x.shape[-2] != 1 else slice(None)
    c = cols if x.shape[-1] != 1 else slice(None)
    return x[..., r, c]
