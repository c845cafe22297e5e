"""Restrictions from the sequence arguments: lengths, per-sequence diagonals, segment ids.

Three members of :class:`~sdpa_array._kernels.restrictions.Restrictions`, in the kernel
layout (the sequence batch axes, then heads axes of size 1, then the tile axes):

* :class:`SequenceLengths`: query ``i`` is padding when ``i >= query_lengths[b]`` (no key
  admissible: its output is zero and its log-sum-exp ``-inf``), key ``j`` is excluded when
  ``j >= key_lengths[b]``; padded on the left, when ``i < L - query_lengths[b]`` and
  ``j < S - key_lengths[b]``;
* :class:`ShiftedBand`: causal and window restrictions whose diagonal sits at
  ``i + key_lengths[b] - query_lengths[b]`` (``alignment="bottom_right"`` with lengths),
  or at ``i + (S - key_lengths[b]) - (L - query_lengths[b])`` (the top left of rows padded
  on the left; their bottom right is the plain band's ``i + S - L``);
* :class:`SegmentIds`: query ``i`` may attend key ``j`` only in the same segment.

Each answers the key-range questions from the host copy of its values when there is one, so
the planners skip the tiles those values exclude (a packed batch of 8 documents does about
1/8 of the dense work); without a host copy (lazy or traced values) it answers ``(0, S)``
and an empty full range, and the tiles are masked instead. Their ranges depend on the
sequence, so they say ``per_sequence``: the kernels then plan each batch slice apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.slicing import at_batch
from .._arrays.typing import Array
from .._problem.band import Band
from .._problem.problem import Problem
from .restrictions import Restriction

__all__ = ["SegmentIds", "SequenceLengths", "ShiftedBand", "sequence_members"]


def _place(p: Problem, module: Any, x: Any, kind: str) -> Any:
    """``x`` (sequence batch [+ one token axis]) reshaped to the kernel layout.

    ``kind`` is ``"lengths"`` (two trailing axes of size 1 are added), ``"query"`` (segment
    ids become ``(..., n, 1)``) or ``"key"`` (``(..., 1, n)``), where ``n`` is the token
    axis length of ``x`` (1 for a scalar).
    """
    if x is None:
        return None
    heads = (1,) * (len(p.kernel_batch) - len(p.sequence_batch))
    shape = tuple(x.shape)
    if kind == "lengths":
        new = (*shape, *heads, 1, 1)
    else:
        lead, n = (shape[:-1], shape[-1]) if shape else ((), 1)
        new = (*lead, *heads, *((n, 1) if kind == "query" else (1, n)))
    ndim = len(p.kernel_batch) + 2
    return module.reshape(x, (1,) * (ndim - len(new)) + new)


@dataclass(frozen=True)
class SequenceLengths:
    """Valid queries and keys per sequence (see the module docstring)."""

    #: The same pairs in every head of a sequence (:class:`Restrictions`).
    same_for_every_head = True

    q: Array
    k: Array
    q_host: np.ndarray | None
    k_host: np.ndarray | None
    known: bool
    S: int
    L: int = 0
    left: bool = False
    per_sequence: bool = True

    def _valid(self, host: np.ndarray | None, n: int, longest: bool) -> tuple[int, int]:
        """The positions ``[lo, hi)`` of a side of ``n`` tokens valid in the sequence with
        the most (``longest``) or fewest of them (all ``n`` without host lengths)."""
        if host is None:
            return 0, n
        length = int(host.max() if longest else host.min())
        return (n - length, n) if self.left else (0, length)

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        if not self.known:
            return 0, self.S
        lo, hi = self._valid(self.q_host, self.L, longest=True)
        if q_stop <= lo or q_start >= hi:
            return 0, 0  # only padding queries
        return self._valid(self.k_host, self.S, longest=True)

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        lo, hi = self._valid(self.q_host, self.L, longest=False)
        if not self.known or q_start < lo or q_stop > hi:
            return 0, 0
        return self._valid(self.k_host, self.S, longest=False)

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array:
        allowed = None
        if self.q is not None:
            i = xp.arange(rows.start, rows.stop, device=device)[:, None]
            allowed = i >= self.L - self.q if self.left else i < self.q
        if self.k is not None:
            j = xp.arange(cols.start, cols.stop, device=device)[None, :]
            keys = j >= self.S - self.k if self.left else j < self.k
            allowed = keys if allowed is None else xp.logical_and(allowed, keys)
        return allowed

    def at(self, index: tuple[int, ...]) -> SequenceLengths:
        return replace(
            self,
            q=at_batch(self.q, index),
            k=at_batch(self.k, index),
            q_host=at_batch(self.q_host, index),
            k_host=at_batch(self.k_host, index),
        )


@dataclass(frozen=True)
class ShiftedBand:
    """A causal/window :class:`Band` whose diagonal offset differs between sequences."""

    #: The same pairs in every head of a sequence (:class:`Restrictions`).
    same_for_every_head = True

    band: Band
    offset: Array
    host: np.ndarray | None
    per_sequence: bool = True

    def _bands(self) -> list[Band]:
        assert self.host is not None
        return [replace(self.band, offset=int(o)) for o in np.unique(self.host)]

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        if self.host is None:
            return 0, self.band.S
        ranges = [b.key_range(q_start, q_stop) for b in self._bands()]
        ranges = [(lo, hi) for lo, hi in ranges if lo < hi]
        if not ranges:
            return 0, 0
        return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        if self.host is None:
            return 0, 0
        ranges = [b.full_range(q_start, q_stop) for b in self._bands()]
        lo, hi = max(lo for lo, _ in ranges), min(hi for _, hi in ranges)
        return lo, max(lo, hi)

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array:
        return self.band.mask_with_offset(xp, device, rows, cols, self.offset)

    def at(self, index: tuple[int, ...]) -> ShiftedBand:
        return replace(self, offset=at_batch(self.offset, index), host=at_batch(self.host, index))


@dataclass(frozen=True)
class SegmentIds:
    """Segment ids of queries ``(..., L, 1)`` and keys ``(..., 1, S)`` in the kernel layout."""

    #: The same pairs in every head of a sequence (:class:`Restrictions`).
    same_for_every_head = True

    q: Array
    k: Array
    q_host: np.ndarray | None
    k_host: np.ndarray | None
    S: int
    per_sequence: bool = True
    L: int = 0

    def _ids(self, q_start: int, q_stop: int) -> np.ndarray:
        """The ids of queries ``[q_start, q_stop)`` in any sequence, sorted, each once."""
        assert self.q_host is not None
        if self.q_host.shape[-2] == 1:
            return np.unique(self.q_host)
        found = self._ids_found.get((q_start, q_stop))
        if found is None:
            queries, starts = self._query_runs
            first = int(np.searchsorted(starts, q_start, side="right")) - 1
            last = int(np.searchsorted(starts, q_stop, side="left"))
            columns = starts[first:last].copy()
            columns[0] = q_start  # runs begin at or before it
            found = self._ids_found[q_start, q_stop] = np.unique(queries[:, columns])
        return found

    @functools.cached_property
    def _ids_found(self) -> dict[tuple[int, int], np.ndarray]:
        """The ids of the query ranges asked for so far."""
        return {}

    @functools.cached_property
    def _query_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Query ids as ``(sequences, L)`` and the rows where a run of equal ids (in every
        sequence) starts, row 0 first."""
        assert self.q_host is not None
        queries = np.reshape(self.q_host, (-1, self.q_host.shape[-2]))
        changes = np.flatnonzero(np.any(queries[:, 1:] != queries[:, :-1], axis=0)) + 1
        return queries, np.concatenate([np.zeros(1, dtype=np.intp), changes])

    def _keys(self) -> np.ndarray:
        """Key ids as ``(sequences, S)``, broadcast along the key axis."""
        assert self.k_host is not None
        k = np.broadcast_to(self.k_host, (*self.k_host.shape[:-1], self.S))
        return np.reshape(k, (-1, self.S))

    @functools.cached_property
    def _key_spans(self) -> dict[Any, tuple[int, int]]:
        """Each key id's first key and last key + 1, in any sequence."""
        return _spans(self._keys())

    @functools.cached_property
    def _query_spans(self) -> dict[Any, tuple[int, int]]:
        """Each query id's first query and last query + 1, in any sequence."""
        assert self.q_host is not None
        queries = np.broadcast_to(self.q_host, (*self.q_host.shape[:-2], self.L, 1))
        return _spans(np.reshape(queries, (-1, self.L)))

    @functools.cached_property
    def _full_runs(self) -> dict[Any, tuple[int, int]]:
        """Found so far: each id's first run of consecutive keys that every sequence has
        in that segment (``(0, 0)``: none)."""
        return {}

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        if self.q_host is None or self.k_host is None:
            return 0, self.S
        return _hull(self._key_spans, self._ids(q_start, q_stop))

    def query_range(self, k_start: int, k_stop: int) -> tuple[int, int]:
        """Queries outside which none may attend a key of ``[k_start, k_stop)``: from the
        first to the last query, in any sequence, whose segment is one of those keys'."""
        if self.q_host is None or self.k_host is None:
            return 0, self.L
        keys = self.k_host[..., :, k_start:k_stop] if self.k_host.shape[-1] != 1 else self.k_host
        return _hull(self._query_spans, np.unique(keys))

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        if self.q_host is None or self.k_host is None:
            return 0, 0
        ids = self._ids(q_start, q_stop)
        if ids.size != 1:
            return 0, 0
        runs = self._full_runs
        found = runs.get(ids[0])
        if found is None:
            found = runs[ids[0]] = _first_full_run(self._keys(), ids[0])
        return found

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array:
        q = self.q[..., rows, :] if self.q.shape[-2] != 1 else self.q
        k = self.k[..., :, cols] if self.k.shape[-1] != 1 else self.k
        return q == k

    @functools.cached_property
    def _slices(self) -> dict[Any, SegmentIds]:
        """The batch slices made so far (:meth:`at`), by the entries they hold."""
        return {}

    def at(self, index: tuple[int, ...]) -> SegmentIds:
        """The ids of the batch slice ``index``: one object for the indices that hold the
        same entries (the heads of a sequence), so that what it finds (the ids of a range of
        queries, the keys every sequence has in a segment) is found once for all of them."""
        arrays = (self.q, self.k, self.q_host, self.k_host)
        entries = tuple(
            None
            if a is None
            else tuple(i if n != 1 else 0 for i, n in zip(index, a.shape, strict=False))
            for a in arrays
        )
        found = self._slices.get((len(index), entries))
        if found is None:
            found = self._slices[len(index), entries] = replace(
                self,
                q=at_batch(self.q, index),
                k=at_batch(self.k, index),
                q_host=at_batch(self.q_host, index),
                k_host=at_batch(self.k_host, index),
            )
        return found


def sequence_members(p: Problem) -> tuple[list[Restriction], bool]:
    """The sequence restrictions of ``p``, and whether they replace ``p.band``.

    With lengths and ``alignment="bottom_right"``, a restricting band becomes a
    :class:`ShiftedBand` whose offsets are ``key_lengths[b] - query_lengths[b]``.
    """
    xp = p.xp
    members: list[Restriction] = []
    ql, kl = p.query_lengths, p.key_lengths
    if ql is not None or kl is not None:
        q_host = None if ql is None else ql.host
        k_host = None if kl is None else kl.host
        known = (ql is None or q_host is not None) and (kl is None or k_host is not None)
        members.append(
            SequenceLengths(
                q=None if ql is None else _place(p, xp, ql.array, "lengths"),
                k=None if kl is None else _place(p, xp, kl.array, "lengths"),
                q_host=None if q_host is None else _place(p, np, q_host, "lengths"),
                k_host=None if k_host is None else _place(p, np, k_host, "lengths"),
                known=known,
                S=p.S,
                L=p.L,
                left=p.left_padded,
            )
        )
    replaces_band = False
    if p.diagonal_per_sequence:
        k_arr = p.S if kl is None else _place(p, xp, kl.array, "lengths")
        q_arr = p.L if ql is None else _place(p, xp, ql.array, "lengths")
        host = None
        if known:
            k_h = p.S if kl is None else _place(p, np, kl.host, "lengths")
            q_h = p.L if ql is None else _place(p, np, ql.host, "lengths")
            host = np.asarray(k_h - q_h)
        offset, host_offset = k_arr - q_arr, host
        if p.left_padded:  # (S - key_lengths) - (L - query_lengths)
            offset = (p.S - p.L) - offset
            host_offset = None if host is None else (p.S - p.L) - host
        members.append(ShiftedBand(p.band, offset, host_offset))
        replaces_band = True
    seg = p.segments
    if seg is not None:
        members.append(
            SegmentIds(
                q=_place(p, xp, seg.query, "query"),
                k=_place(p, xp, seg.key, "key"),
                q_host=None if seg.query_host is None else _place(p, np, seg.query_host, "query"),
                k_host=None if seg.key_host is None else _place(p, np, seg.key_host, "key"),
                S=p.S,
                L=p.L,
            )
        )
    return members, replaces_band


def _spans(ids: np.ndarray) -> dict[Any, tuple[int, int]]:
    """``id -> (first column, last column + 1)`` of ``ids`` ``(sequences, n)``, where any
    sequence (row) holds that id."""
    rows = ids.shape[0]
    by_column = np.ascontiguousarray(ids.T).ravel()  # column-major: position // rows
    values, first = np.unique(by_column, return_index=True)
    _, last = np.unique(by_column[::-1], return_index=True)
    starts = first // max(rows, 1)
    stops = (by_column.size - 1 - last) // max(rows, 1) + 1
    return dict(
        zip(values.tolist(), zip(starts.tolist(), stops.tolist(), strict=True), strict=True)
    )


def _hull(spans: dict[Any, tuple[int, int]], ids: np.ndarray) -> tuple[int, int]:
    """From the first start to the last stop of ``ids``' spans (``(0, 0)``: none has one)."""
    found = [spans[i] for i in ids.tolist() if i in spans]
    if not found:
        return 0, 0
    return min(a for a, _ in found), max(b for _, b in found)


def _first_full_run(keys: np.ndarray, id_: Any) -> tuple[int, int]:
    """The first run of consecutive columns of ``keys`` ``(sequences, S)`` where every
    sequence holds ``id_`` (``(0, 0)``: none)."""
    same = np.flatnonzero(np.all(keys == id_, axis=0))
    if not same.size:
        return 0, 0
    breaks = np.flatnonzero(np.diff(same) != 1)
    stop = same[breaks[0]] + 1 if breaks.size else same[-1] + 1
    return int(same[0]), int(stop)
