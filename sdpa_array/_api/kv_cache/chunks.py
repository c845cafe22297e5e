"""Attending chunk by chunk: each sequence's tokens cut into chunks, attended, merged.

:func:`attend_chunks` cuts each sequence's attended tokens into chunks (:func:`_plan`),
attends to every chunk with :func:`~sdpa_array.scaled_dot_product_attention` on that
chunk's keys only, on NumPy's thread pool (:func:`~sdpa_array._arrays.parallel.map_blocks`),
and merges each sequence's chunks with :func:`~sdpa_array.merge_attention_states`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._arrays.merge import merge_attention_states
from ..._arrays.parallel import map_blocks
from ..._arrays.typing import Array
from ..forward import scaled_dot_product_attention
from .args import CacheCall

__all__ = ["CHUNK_BYTES", "CHUNK_MAX_TOKENS", "attend_chunks"]

#: bytes (1024 tokens for Hkv=8, E=Ev=128 in float32). Measured on 2 cores (B=4, Hq=32,
#: paged, 32768 tokens): chunks of 256-1024 tokens ran 15-30% faster than 2048-8192, as a
#: gathered chunk then stays in the CPU's cache between its copy and its two products.
CHUNK_BYTES = 8 * 2**20

#: ... and of at most this many tokens, so that a long sequence is split even when its heads
#: are small (a single query over 32768 tokens then runs on at least 4 threads).
CHUNK_MAX_TOKENS = 8192


@dataclass(frozen=True)
class _Piece:
    """Tokens of sequence ``b`` stored alike in ``count`` pages: rows ``r0 .. r0 + rows - 1``
    of the pages at block-table entries ``j0 .. j0 + count - 1``. Token position of (page
    ``p``, row ``r``): ``(j0 + p) * page_size + r0 + r``."""

    b: int
    j0: int
    count: int
    r0: int
    rows: int

    def first(self, page_size: int) -> int:
        return self.j0 * page_size + self.r0

    def last(self, page_size: int) -> int:
        return (self.j0 + self.count - 1) * page_size + self.r0 + self.rows - 1


def _pieces_of_range(b: int, start: int, stop: int, ps: int) -> list[_Piece]:
    """Tokens ``[start, stop)`` as at most three pieces: a partial page, whole pages, a
    partial page."""
    pieces = []
    if start % ps:
        end = min(stop, (start // ps + 1) * ps)
        pieces.append(_Piece(b, start // ps, 1, start % ps, end - start))
        start = end
    full = (stop - start) // ps
    if full:
        pieces.append(_Piece(b, start // ps, full, 0, ps))
        start += full * ps
    if start < stop:
        pieces.append(_Piece(b, start // ps, 1, 0, stop - start))
    return pieces


def _bands(c: CacheCall, n: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """First and last admissible token of each query (``lo > hi``: none) for ``n`` tokens
    of which those from ``first`` on are the sequence's (``cache_leftpad``)."""
    diag = n - c.L + np.arange(c.L)
    left, right = c.window if c.window is not None else (None, None)
    lo = np.maximum(first, diag - left) if left is not None else np.full(c.L, first)
    hi = np.full(c.L, n - 1)
    if c.is_causal:
        hi = np.minimum(hi, diag)
    if right is not None:
        hi = np.minimum(hi, diag + right)
    return lo, hi


def _host_start(c: CacheCall, b: int) -> int:
    """Sequence ``b``'s first token where ``cache_leftpad`` is known on the host (else 0:
    the start then enters the masks)."""
    return c.starts[b] if isinstance(c.starts, tuple) else 0


def _start(c: CacheCall, b: int) -> Any:
    """Sequence ``b``'s first token: an int, or a 0-d array where it cannot be read."""
    if c.starts is None or isinstance(c.starts, tuple):
        return _host_start(c, b)
    return c.starts[b]


def _itemsize(c: CacheCall) -> int:
    return int(c.xp.finfo(c.query.dtype).bits) // 8


def _plan(c: CacheCall) -> list[_Piece]:
    """Every piece to attend, sequence by sequence (see Notes in the public docstring)."""
    lengths, ps = c.host_lengths, c.page_size
    ranges: list[tuple[int, int]] = []
    for b in range(c.B):
        if lengths is None:
            ranges.append((0, c.capacity))
            continue
        lo, hi = _bands(c, lengths[b] + c.new_tokens, _host_start(c, b))
        some = lo <= hi
        ranges.append((int(lo[some].min()), int(hi[some].max()) + 1) if some.any() else (0, 0))
    longest = max((stop - start for start, stop in ranges), default=0)
    if longest == 0:
        return []
    k, v = c.key_cache, c.value_cache
    token_bytes = int(k.shape[1]) * (int(k.shape[3]) + int(v.shape[3])) * _itemsize(c)
    target = min(CHUNK_MAX_TOKENS, max(1, CHUNK_BYTES // max(token_bytes, 1)))
    splits = c.num_splits or math.ceil(longest / target)
    chunk = math.ceil(longest / splits)
    if c.paged:
        chunk = math.ceil(chunk / ps) * ps
    pieces = []
    for b, (start, stop) in enumerate(ranges):
        for edge in range(start - start % chunk, stop, chunk):
            pieces += _pieces_of_range(b, max(edge, start), min(edge + chunk, stop), ps)
    return pieces


def _gather(c: CacheCall, cache: Array, piece: _Piece) -> Array:
    """The piece's rows of its pages, ``(count, Hkv, rows, X)``: views where they can be."""
    xp, rows = c.xp, slice(piece.r0, piece.r0 + piece.rows)
    table = c.host_table
    if table is None:
        ids = xp.clip(c.table[piece.b, piece.j0 : piece.j0 + piece.count], 0, cache.shape[0] - 1)
        return xp.take(cache, ids, axis=0)[:, :, rows, :]
    ids = table[piece.b, piece.j0 : piece.j0 + piece.count].tolist()
    runs, first = [], 0
    for k in range(1, len(ids) + 1):  # consecutive page ids: one slice, no copy
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            runs.append(cache[ids[first] : ids[k - 1] + 1, :, rows, :])
            first = k
    return runs[0] if len(runs) == 1 else xp.concat(runs, axis=0)


def _positions(c: CacheCall, piece: _Piece) -> Array:
    """Token position of every (page, row) of the piece, ``(count, rows)``."""
    xp, dev = c.xp, c.device
    pages = xp.reshape(xp.arange(piece.count, device=dev), (-1, 1))
    rows = xp.reshape(xp.arange(piece.rows, device=dev), (1, -1))
    return (pages + piece.j0) * c.page_size + piece.r0 + rows


def _band_mask(c: CacheCall, piece: _Piece, n: Any, first: Any) -> Array | None:
    """Which (query, token) pairs the lengths, the start ``first``, ``is_causal`` and
    ``window`` admit, from global positions, ``(count, 1, L|1, rows)``; ``None`` where the
    piece is admissible for every query (known lengths and start only)."""
    xp, L = c.xp, c.L
    if isinstance(n, int) and isinstance(first, int):
        lo, hi = _bands(c, n, first)
        ps = c.page_size
        if bool(np.all(lo <= piece.first(ps))) and bool(np.all(hi >= piece.last(ps))):
            return None
    t = xp.expand_dims(_positions(c, piece), axis=1)  # (count, 1, rows)
    ok = (t < n) & (t >= first)
    diag = n - L + xp.reshape(xp.arange(L, device=c.device), (L, 1))
    left, right = c.window if c.window is not None else (None, None)
    if c.is_causal:
        ok = ok & (t <= diag)
    if left is not None:
        ok = ok & (t >= diag - left)
    if right is not None:
        ok = ok & (t <= diag + right)
    return xp.expand_dims(ok, axis=1)


def _term_piece(c: CacheCall, term: Array | None, piece: _Piece) -> Array | None:
    """The caller's mask or bias for the piece's tokens, ``(count|1, Hq|1, L|1, rows|1)``."""
    if term is None:
        return None
    xp = c.xp
    t = term[piece.b if term.shape[0] != 1 else 0, ...]  # (Hq|1, L|1, T|1)
    if t.shape[-1] == 1:
        return xp.expand_dims(t, axis=0)
    start = piece.first(c.page_size)
    if piece.count == 1:
        return xp.expand_dims(t[..., start : start + piece.rows], axis=0)
    span = t[..., start : start + piece.count * c.page_size]
    span = xp.reshape(span, (*span.shape[:2], piece.count, c.page_size))
    return xp.permute_dims(span, (2, 0, 1, 3))


def _attend_piece(c: CacheCall, caches: tuple[Array, Array], piece: _Piece) -> tuple[Array, ...]:
    """Partial attention of sequence ``piece.b``'s queries over the piece's tokens:
    ``(count, Hq, L, Ev)``, ``(count, Hq, L)`` and, where asked for, the maximum scores
    ``(count, Hq)``."""
    xp = c.xp
    b = piece.b
    lengths = c.host_lengths
    n = lengths[b] + c.new_tokens if lengths is not None else c.lengths[b] + c.new_tokens
    first = _start(c, b)
    k, v = _gather(c, caches[0], piece), _gather(c, caches[1], piece)
    mask = _band_mask(c, piece, n, first)
    if lengths is None or not isinstance(first, int):
        # slots outside the tokens may hold anything (NaN): 0 * NaN is NaN
        t = _positions(c, piece)
        valid = xp.reshape((t < n) & (t >= first), (piece.count, 1, piece.rows, 1))
        v = xp.where(valid, v, xp.zeros((), dtype=v.dtype, device=c.device))
    user = _term_piece(c, c.mask, piece)
    if user is not None:
        mask = user if mask is None else mask & user
    return scaled_dot_product_attention(
        c.query[b : b + 1, ...],
        k,
        v,
        mask=mask,
        bias=_term_piece(c, c.bias, piece),
        return_lse=True,
        return_max_scores=c.return_max_scores,
        **c.passed,
    )


def attend_chunks(c: CacheCall, caches: tuple[Array, Array]) -> tuple[Array, Array, Array]:
    """Every piece on the thread pool, then one merge per sequence: output, log-sum-exp
    and, where asked for, the maximum scores ``(B, Hq)`` (the largest of the pieces'),
    else ``None``."""
    xp = c.xp
    dtype = c.query.dtype
    compute = dtype if xp.finfo(dtype).bits >= 32 else xp.float32
    Hq, L, Ev = int(c.query.shape[1]), c.L, int(c.value_cache.shape[-1])
    pieces = _plan(c) if L else []
    results = map_blocks(xp, lambda piece: _attend_piece(c, caches, piece), pieces)
    by_sequence: list[list[tuple[Array, ...]]] = [[] for _ in range(c.B)]
    for piece, result in zip(pieces, results, strict=True):
        by_sequence[piece.b].append(result)
    outs, lses, maxima = [], [], []
    for parts in by_sequence:
        if not parts:
            outs.append(xp.zeros((Hq, L, Ev), dtype=dtype, device=c.device))
            lses.append(xp.full((Hq, L), -math.inf, dtype=compute, device=c.device))
            maxima.append(xp.full((Hq,), -math.inf, dtype=compute, device=c.device))
            continue
        part_outs = [part[0] for part in parts]
        part_lses = [part[1] for part in parts]
        if c.return_max_scores:
            part_maxima = xp.concat([part[2] for part in parts], axis=0)  # (pieces, Hq)
            maxima.append(xp.max(part_maxima, axis=0))
        out, lse = merge_attention_states(
            part_outs[0] if len(parts) == 1 else xp.concat(part_outs, axis=0),
            part_lses[0] if len(parts) == 1 else xp.concat(part_lses, axis=0),
        )
        outs.append(out)
        lses.append(lse)
    if not outs:  # B == 0
        return (
            xp.zeros((0, Hq, L, Ev), dtype=dtype, device=c.device),
            xp.zeros((0, Hq, L), dtype=compute, device=c.device),
            xp.zeros((0, Hq), dtype=compute, device=c.device) if c.return_max_scores else None,
        )
    stacked = xp.stack(maxima, axis=0) if c.return_max_scores else None
    return xp.stack(outs, axis=0), xp.stack(lses, axis=0), stacked
