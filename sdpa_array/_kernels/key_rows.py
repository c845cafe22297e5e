"""Sums of gradient rows over the keys (``dK``, ``dV``), kept by the range of keys they hold.

The blocked backward kernel adds each tile's ``dK`` and ``dV`` rows for the tile's keys
``[start, stop)``. :class:`KeyRows` keeps the first piece of a range as it is (no copy,
whatever its layout) and adds later pieces of the same range to it; ranges that do not
overlap stay separate pieces, so packed documents, whose tiles each hold one document's
keys, never build or add into an array of all ``S`` keys. Where two different ranges
overlap (a causal band, a window) every piece is added into one array of all ``S`` keys,
zeros where nothing was added, and later pieces are added into its rows.
:func:`covering` lists the pieces with the gaps between them, for writing the gradient.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import device

from .._arrays import inplace
from .._arrays.typing import Array

__all__ = ["KeyRows", "covering"]

Range = tuple[int, int]


class KeyRows(dict[Range, Array]):
    """Pieces of rows by key range ``(start, stop)``, pairwise disjoint; :attr:`owned` the
    ranges whose array was made here (and may be added into in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.owned: set[Range] = set()

    def add(self, xp: Any, x: Array, start: int, stop: int, keys: int) -> None:
        """Add ``x``, the rows of the keys ``[start, stop)`` of ``keys`` keys, without
        changing ``x`` in place."""
        key = (start, stop)
        if key not in self and not any(a < stop and start < b for a, b in self):
            self[key] = x
        elif key in self:
            if key in self.owned:
                self[key] = inplace.add(self[key], x)
            else:
                self[key] = self[key] + x
                self.owned.add(key)
        else:
            whole = self._whole(xp, x, keys)
            self[(0, keys)] = inplace.add_rows(xp, whole, start, stop, x)

    def _whole(self, xp: Any, like: Array, keys: int) -> Array:
        """The pieces added into one new array of all ``keys`` keys (zeros elsewhere),
        which becomes the only piece; the one made before, where there is one."""
        if list(self) == [(0, keys)] and (0, keys) in self.owned:
            return self[(0, keys)]
        shape = (*tuple(like.shape[:-2]), keys, int(like.shape[-1]))
        whole = xp.zeros(shape, dtype=like.dtype, device=device(like))
        for (a, b), piece in self.items():
            whole = inplace.add_rows(xp, whole, a, b, piece)
        self.clear()
        self.owned = {(0, keys)}
        return whole

    def merge(self, xp: Any, other: KeyRows, keys: int) -> None:
        """Add every piece of ``other``."""
        for (a, b), piece in other.items():
            self.add(xp, piece, a, b, keys)


def covering(rows: KeyRows | None, keys: int) -> list[tuple[Range | None, int, int]]:
    """``(range, start, stop)`` for each piece of ``rows`` in order, with ``(None, start,
    stop)`` for the keys between them that no piece holds (zeros), covering ``[0, keys)``."""
    out: list[tuple[Range | None, int, int]] = []
    at = 0
    for a, b in sorted(rows or ()):
        if a > at:
            out.append((None, at, a))
        out.append(((a, b), a, b))
        at = b
    if at < keys:
        out.append((None, at, keys))
    return out
