"""Causal and sliding-window restrictions, as index arithmetic.

Query ``i`` has its *diagonal* at key ``i + offset``: ``offset = 0`` for the ``"top_left"``
alignment and ``S - L`` for ``"bottom_right"``. Then

* ``is_causal`` admits key ``j`` only if ``j <= i + offset``;
* ``window=(left, right)`` admits ``j`` only if ``i + offset - left <= j <= i + offset + right``.

The same object answers two questions: the boolean mask of a (query block, key block) tile,
built with Array-API index arithmetic, and, in plain Python integers, which key blocks a query
block can touch at all, so that a blocked implementation skips the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Positions:
    """Positional restrictions of one attention call.

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

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        """Half-open range ``[lo, hi)`` of keys that queries ``[q_start, q_stop)`` may reach.

        Empty (``lo >= hi``) when none may; clipped to ``[0, S)``.
        """
        if q_start >= q_stop:
            return 0, 0
        lo, hi = 0, self.S
        if self.left is not None:
            lo = max(lo, q_start + self.offset - self.left)
        upper = self._upper()
        if upper is not None:
            hi = min(hi, q_stop - 1 + self.offset + upper + 1)
        return lo, max(lo, hi)

    def tile_is_full(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> bool:
        """Whether every (query, key) pair of the tile is admissible by position."""
        if not self.restricts or q_start >= q_stop or k_start >= k_stop:
            return True
        upper = self._upper()
        if upper is not None and k_stop - 1 > q_start + self.offset + upper:
            return False
        return not (self.left is not None and k_start < q_stop - 1 + self.offset - self.left)

    def tile_mask(
        self, xp: ModuleType, device: Any, q_start: int, q_stop: int, k_start: int, k_stop: int
    ) -> Any | None:
        """Boolean ``(q_stop - q_start, k_stop - k_start)`` mask of the tile, or ``None``.

        ``None`` means every pair is admissible, so callers can skip the ``where``.
        """
        if self.tile_is_full(q_start, q_stop, k_start, k_stop):
            return None
        rows = xp.arange(q_start, q_stop, device=device)[:, None]
        cols = xp.arange(k_start, k_stop, device=device)[None, :]
        rel = cols - rows - self.offset  # j - diag(i)
        allowed = None
        upper = self._upper()
        if upper is not None:
            allowed = rel <= upper
        if self.left is not None:
            lower_ok = rel >= -self.left
            allowed = lower_ok if allowed is None else xp.logical_and(allowed, lower_ok)
        return allowed
