"""Restrictions: which (query, key) pairs may attend, behind one interface.

Every restriction of a call (causal and sliding-window positions, a dense boolean ``mask``,
query/key lengths and segment ids (:mod:`.sequences`), a mask function (:mod:`.mod_terms`),
and whatever comes next) is a member of
one :class:`Restrictions`, which the kernels ask two questions about a tile of queries
``rows`` and keys ``cols``:

* :meth:`Restrictions.classify`: is the tile :attr:`TileKind.EMPTY` (no pair admissible:
  the planners skip it), :attr:`TileKind.FULL` (every pair admissible: no ``where`` needed)
  or :attr:`TileKind.PARTIAL`;
* :meth:`Restrictions.tile_mask`: the boolean mask of the tile, built only when it is
  partial (``None`` for a full tile).

A member implements the :class:`Restriction` protocol. It describes itself by two key
ranges of a query block, answered in plain Python integers before any array work: the keys
*some* query of the block may reach (:meth:`~Restriction.key_range`, a superset) and the
keys *every* query of the block may reach (:meth:`~Restriction.full_range`, a subset); a
member that cannot know (a dense mask, whose values are data) answers ``(0, S)`` and an
empty range. A member whose admissible keys are not one range per query block (a mask
function's blocks) also answers :meth:`Restrictions.classify`'s question for a tile itself.
The combination is the logical *and* of its members.

Positions follow the call's alignment: query ``i`` has its *diagonal* at key ``i + offset``
(``offset = 0`` for ``"top_left"``, ``S - L`` for ``"bottom_right"``); ``is_causal`` admits
key ``j`` only if ``j <= i + offset`` and ``window=(left, right)`` only if
``i + offset - left <= j <= i + offset + right``.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from .._arrays.slicing import at_batch, tile_of
from .._arrays.typing import Array

__all__ = ["DenseMask", "Restriction", "Restrictions", "TileKind"]


class TileKind(enum.Enum):
    """How a restriction covers a (query block, key block) tile."""

    EMPTY = "empty"
    FULL = "full"
    PARTIAL = "partial"


class Restriction(Protocol):
    """One restriction of an attention call (see the module docstring)."""

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` outside which no query of ``[q_start, q_stop)`` may attend."""
        ...

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that every query of ``[q_start, q_stop)`` may attend."""
        ...

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array:
        """Boolean mask of the tile, broadcastable to ``(..., rows, cols)``."""
        ...

    def at(self, index: tuple[int, ...]) -> Restriction:
        """The restriction of the outer batch slice ``index`` of the kernel layout."""
        ...

    # A member may also define ``classify(rows, cols) -> TileKind`` when its admissible keys
    # are not one range per query block (a mask function's blocks): the ranges then bound
    # the tile plan, and ``classify`` says which tiles inside them are empty or full. A
    # member may define ``query_range(k_start, k_stop) -> (lo, hi)``, the queries outside
    # which none may attend a key of ``[k_start, k_stop)`` (a band's rows): tiles are then
    # cut to those rows. Without it every query may. A member may define
    # ``full_rows(k_start, k_stop) -> (lo, hi)``, queries that may attend every key of the
    # range (a band's): a tile's mask then leaves out a run of such rows at either end. A
    # member may define ``mask_key(rows, cols)``, a key equal for tiles with equal masks in
    # every batch slice (a band's): the kernels then build each such mask once per call. A
    # member may set ``same_for_every_head = True`` when it admits the same pairs in every
    # head of a sequence: the kernels then plan each sequence once.


def _member_kind(
    m: Restriction, rows: slice, cols: slice, key: tuple[int, int] | None = None
) -> TileKind:
    """How one member covers a tile: its own :meth:`classify` where it has one (a member
    whose admissible keys are not one range per query block), else from its two ranges
    (``key``: its key range of ``rows``, when the caller has it already)."""
    own = getattr(m, "classify", None)
    if own is not None:
        kind: TileKind = own(rows, cols)
        return kind
    if key is None:
        key = m.key_range(rows.start, rows.stop)
    return _classify(key, m.full_range(rows.start, rows.stop), cols)


def _without_end_run(span: slice, lo: int, hi: int) -> slice:
    """``span`` without its part in ``[lo, hi)`` where that part is a run at one end of it
    (empty where it is all of it); ``span`` itself otherwise."""
    a, b = max(lo, span.start), min(hi, span.stop)
    if a >= b:
        return span
    if a == span.start:
        return slice(b, span.stop)
    if b == span.stop:
        return slice(span.start, a)
    return span


def _classify(key: tuple[int, int], full: tuple[int, int], cols: slice) -> TileKind:
    lo, hi = max(key[0], cols.start), min(key[1], cols.stop)
    if lo >= hi:
        return TileKind.EMPTY
    if full[0] <= cols.start and cols.stop <= full[1]:
        return TileKind.FULL
    return TileKind.PARTIAL


@dataclass(frozen=True)
class DenseMask:
    """The caller's boolean ``mask``, in the kernel layout (``True`` = may attend).

    Its values are data, so it never makes a tile empty or full by itself.
    """

    mask: Array
    S: int

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        return 0, self.S

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        return 0, 0

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array:
        return tile_of(self.mask, rows, cols)

    def at(self, index: tuple[int, ...]) -> DenseMask:
        return DenseMask(at_batch(self.mask, index), self.S)


@dataclass(frozen=True)
class Restrictions:
    """Every restriction of a call; a pair is admissible when every member admits it.

    Attributes
    ----------
    members : tuple of Restriction
        The restrictions; none means every pair is admissible.
    L, S : int
        Query and key lengths.
    """

    members: tuple[Restriction, ...]
    L: int
    S: int

    @property
    def bounds_keys(self) -> bool:
        """Whether the first or the last query reaches fewer than all ``S`` keys.

        Then query blocks reach different keys, and the backward planner uses a finer key
        grid.
        """
        ends = [(0, 1), (self.L - 1, self.L)] if self.L > 0 else []
        return any(m.key_range(a, b) != (0, self.S) for m in self.members for a, b in ends)

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        """Keys outside which no query of ``[q_start, q_stop)`` may attend (intersection)."""
        lo, hi = 0, self.S
        for m in self.members:
            a, b = m.key_range(q_start, q_stop)
            lo, hi = max(lo, a), min(hi, b)
        return lo, max(lo, hi)

    def narrow_ends(self, rows: slice) -> tuple[int, int]:
        """``(a, b)``: the rows ``[rows.start, a)`` and ``[b, rows.stop)`` at either end of
        ``rows`` each admit at most one key, as the members' key ranges of single rows tell
        (a causal call's first row, every row of a window of width 0; ``a <= b``).

        Each run is found by doubling steps from its end and a bisection, which takes the
        rows' key ranges to widen away from the ends of ``rows`` (a band's do): a few key
        ranges per block. A row admitting one key that the ranges do not show (a dense
        mask's) is not found.
        """
        start, stop = rows.start, rows.stop

        def narrow(i: int) -> bool:
            lo, hi = self.key_range(i, i + 1)
            return hi - lo <= 1

        def run(first: int, step: int, end: int) -> int:
            """How many rows from ``first`` towards ``end`` (exclusive) are narrow."""
            limit = abs(end - first)
            if limit == 0 or not narrow(first):
                return 0
            known, n = 1, 2  # rows [0, known) narrow; row n - 1 is the next probe
            while n <= limit and narrow(first + step * (n - 1)):
                known, n = n, 2 * n
            wide = min(n, limit + 1)  # the first n with row n - 1 wide, or past the end
            while known + 1 < wide:
                mid = (known + wide) // 2
                if narrow(first + step * (mid - 1)):
                    known = mid
                else:
                    wide = mid
            return known

        a = start + run(start, 1, stop)
        b = stop - run(stop - 1, -1, a - 1)
        return a, max(a, b)

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        """Keys that every query of ``[q_start, q_stop)`` may attend (intersection)."""
        lo, hi = 0, self.S
        for m in self.members:
            a, b = m.full_range(q_start, q_stop)
            lo, hi = max(lo, a), min(hi, b)
        return lo, max(lo, hi)

    @property
    def same_for_every_head(self) -> bool:
        """Whether every member admits the same pairs in every head of a sequence (those
        that say so: lengths, segment ids, bands; a mask or a mask function may differ)."""
        return all(getattr(m, "same_for_every_head", False) for m in self.members)

    def query_range(self, k_start: int, k_stop: int) -> tuple[int, int]:
        """Queries outside which none may attend a key of ``[k_start, k_stop)``
        (intersection over the members that say, see :class:`Restriction`)."""
        lo, hi = 0, self.L
        for m in self.members:
            rows = getattr(m, "query_range", None)
            if rows is not None:
                a, b = rows(k_start, k_stop)
                lo, hi = max(lo, a), min(hi, b)
        return lo, max(lo, hi)

    def classify(self, rows: slice, cols: slice) -> TileKind:
        """Whether the tile is empty, full or partial.

        Empty when the members' key ranges do not meet inside the tile or one member finds
        it empty; full when every member finds it full.
        """
        keys = [m.key_range(rows.start, rows.stop) for m in self.members]
        lo = max([0, *(k[0] for k in keys)])
        hi = min([self.S, *(k[1] for k in keys)])
        if max(lo, cols.start) >= min(hi, cols.stop):
            return TileKind.EMPTY
        kinds = {
            _member_kind(m, rows, cols, key) for m, key in zip(self.members, keys, strict=True)
        }
        if TileKind.EMPTY in kinds:
            return TileKind.EMPTY
        return TileKind.PARTIAL if TileKind.PARTIAL in kinds else TileKind.FULL

    def partial_columns(self, rows: slice, cols: slice) -> slice:
        """The tile's columns that may need a mask: ``cols`` without a run of full columns
        at either end.

        Keys that every query of ``rows`` may attend (:meth:`full_range`) need no mask; when
        they cover one end of the tile, the rest of it is returned (empty when they cover
        all of it), else the whole tile.
        """
        return _without_end_run(cols, *self.full_range(rows.start, rows.stop))

    def partial_rows(self, rows: slice, cols: slice) -> slice:
        """The tile's rows that may need a mask: ``rows`` without a run of rows at either
        end that attend every key of ``cols``.

        The rows that may attend every key come from the members that do not admit the
        whole tile, each through its ``full_rows(k_start, k_stop)`` (a band's); a member
        without it keeps every row. As :meth:`partial_columns`, a run covering one end of
        ``rows`` is left out (all of them when it covers both).
        """
        lo, hi = rows.start, rows.stop
        for m in self.members:
            if _member_kind(m, rows, cols) is TileKind.FULL:
                continue
            full_rows = getattr(m, "full_rows", None)
            if full_rows is None:
                return rows
            a, b = full_rows(cols.start, cols.stop)
            lo, hi = max(lo, a), min(hi, b)
        return _without_end_run(rows, lo, hi)

    def mask_key(self, rows: slice, cols: slice) -> Hashable | None:
        """A key equal for tiles whose :meth:`tile_mask` is equal, from the members that
        do not admit the whole tile, each through its ``mask_key(rows, cols)`` (a band's);
        ``None`` when one of them has none."""
        keys = []
        for i, m in enumerate(self.members):
            if _member_kind(m, rows, cols) is TileKind.FULL:
                continue
            own = getattr(m, "mask_key", None)
            if own is None:
                return None
            keys.append((i, own(rows, cols)))
        return tuple(keys)

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array | None:
        """Boolean mask of a tile, or ``None`` when every pair of the tile is admissible.

        Members that admit the whole tile contribute nothing; the others are combined with
        a logical *and*.
        """
        allowed = None
        for m in self.members:
            if _member_kind(m, rows, cols) is TileKind.FULL:
                continue
            mine = m.tile_mask(xp, device, rows, cols)
            allowed = mine if allowed is None else xp.logical_and(allowed, mine)
        return allowed

    @property
    def per_sequence(self) -> bool:
        """Whether some member's tile classes differ between sequences of the batch.

        Then the kernels loop over the sequence batch axes and plan each slice with its
        own restrictions (:meth:`at`).
        """
        return any(getattr(m, "per_sequence", False) for m in self.members)

    def at(self, index: tuple[int, ...]) -> Restrictions:
        """The restrictions of the outer batch slice ``index``."""
        if not index:
            return self
        return Restrictions(tuple(m.at(index) for m in self.members), self.L, self.S)
