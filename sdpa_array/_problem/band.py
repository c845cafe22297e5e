"""The causal and sliding-window restrictions of a call, as index arithmetic.

A :class:`Band` is part of the problem (validation builds it from ``is_causal``, ``window``
and ``alignment``) and a member of the kernels'
:class:`~sdpa_array._kernels.restrictions.Restrictions`: it answers their key-range
questions in plain integers and builds a tile's mask on request.

Query ``i`` has its *diagonal* at key ``i + offset`` (``offset = 0`` for ``"top_left"``,
``S - L`` for ``"bottom_right"``); ``is_causal`` admits key ``j`` only if
``j <= i + offset`` and ``window=(left, right)`` only if
``i + offset - left <= j <= i + offset + right``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .._arrays.typing import Array

__all__ = ["Band", "window_bounds"]


def window_bounds(window: Any, extent: int) -> tuple[int | None, int | None]:
    """``(left, right)`` of a validated ``window`` (or ``None``) as bounds: a side of
    ``extent`` (``L + S``) or more excludes no key of any row, every diagonal lying in
    ``[-L, S)``, so it is no bound (``None``) and the kernels' index arithmetic never sees
    its size."""

    def bound(side: Any) -> int | None:
        return None if side is None or operator.index(side) >= extent else operator.index(side)

    left, right = window if window is not None else (None, None)
    return bound(left), bound(right)


@dataclass(frozen=True)
class Band:
    """Causal and sliding-window restrictions, as index arithmetic.

    Attributes
    ----------
    L, S : int
        Query and key lengths.
    is_causal : bool
        Whether keys after each query's diagonal are excluded.
    left, right : int or None
        Window sizes on each side of the diagonal (``None`` = unbounded).
    offset : int
        Key index of query 0's diagonal.
    """

    #: The same pairs in every head of a sequence (:class:`Restrictions`).
    same_for_every_head = True

    L: int
    S: int
    is_causal: bool
    left: int | None
    right: int | None
    offset: int

    @property
    def restricts(self) -> bool:
        """Whether any key is excluded by position."""
        return self.is_causal or self.left is not None or self.right is not None

    def _upper(self) -> int | None:
        """Largest admissible ``j - i - offset`` (``None`` = unbounded)."""
        bounds = [b for b in (0 if self.is_causal else None, self.right) if b is not None]
        return min(bounds) if bounds else None

    def _keys_of(self, i: int) -> tuple[int, int]:
        """Unclipped keys ``[lo, hi)`` of query ``i`` (both ends grow with ``i``)."""
        upper = self._upper()
        lo = i + self.offset - self.left if self.left is not None else 0
        hi = i + self.offset + upper + 1 if upper is not None else self.S
        return lo, hi

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        if q_start >= q_stop:
            return 0, 0
        lo = max(0, self._keys_of(q_start)[0])
        hi = min(self.S, self._keys_of(q_stop - 1)[1])
        return lo, max(lo, hi)

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        if q_start >= q_stop:
            return 0, self.S
        lo = max(0, self._keys_of(q_stop - 1)[0])
        hi = min(self.S, self._keys_of(q_start)[1])
        return lo, max(lo, hi)

    def full_rows(self, k_start: int, k_stop: int) -> tuple[int, int]:
        """Queries ``[lo, hi)`` that may attend every key of ``[k_start, k_stop)`` (all
        of them for no key)."""
        if k_start >= k_stop:
            return 0, self.L
        upper = self._upper()
        # query i reaches keys [i + offset - left, i + offset + upper]
        lo = 0 if upper is None else max(0, k_stop - 1 - self.offset - upper)
        hi = self.L if self.left is None else min(self.L, k_start - self.offset + self.left + 1)
        return lo, max(lo, hi)

    def query_range(self, k_start: int, k_stop: int) -> tuple[int, int]:
        """Queries ``[lo, hi)`` outside which none may attend a key of ``[k_start, k_stop)``."""
        if k_start >= k_stop:
            return 0, 0
        upper = self._upper()
        # query i reaches keys [i + offset - left, i + offset + upper]
        lo = 0 if upper is None else max(0, k_start - self.offset - upper)
        hi = self.L if self.left is None else min(self.L, k_stop - self.offset + self.left)
        return lo, max(lo, hi)

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array:
        return self.mask_with_offset(xp, device, rows, cols, self.offset)

    def mask_with_offset(
        self, xp: ModuleType, device: Any, rows: slice, cols: slice, offset: int | Array
    ) -> Array:
        """The tile's mask with the diagonal at ``i + offset`` (an int, or an array of
        per-sequence offsets shaped to broadcast against the tile)."""
        # one comparison of the key indices with each row's bound per side: the only
        # tile-sized arrays are the booleans; int32 (positions stay far below 2**31)
        # compares several times faster than int64 on NumPy
        i32 = xp.int32
        diag = xp.arange(rows.start, rows.stop, dtype=i32, device=device)[:, None] + offset
        diag = xp.astype(diag, i32, copy=False)
        col = xp.arange(cols.start, cols.stop, dtype=i32, device=device)[None, :]
        upper = self._upper()
        below = None if upper is None else col <= diag + upper
        if self.left is None:
            # a full-width tile is never asked for (Restrictions skips FULL tiles)
            if below is None:
                return xp.ones((*diag.shape[:-1], cols.stop - cols.start), dtype=xp.bool)
            return below
        above = col >= diag - self.left
        return above if below is None else xp.logical_and(below, above)

    def mask_key(self, rows: slice, cols: slice) -> tuple[int, int, int]:
        """What the tile's mask depends on: the diagonal's column in its first row and
        its shape (tiles with equal keys have equal masks)."""
        return rows.start + self.offset - cols.start, rows.stop - rows.start, cols.stop - cols.start

    def at(self, index: tuple[int, ...]) -> Band:
        return self
