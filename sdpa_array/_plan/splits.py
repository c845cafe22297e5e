"""Split-KV planning of a KV-cache call: how many splits, and the pieces each one reads.

Sequence ``b`` attends the tokens ``[lo_b, hi_b)`` that some query may attend
(:func:`bands`); the longest such range is cut into :func:`split_count` chunks, and each
sequence's chunks into :class:`Piece` s, runs of tokens stored alike in consecutive
block-table entries (:func:`pieces`). The face attends every piece with the forward and
merges each sequence's pieces (``sdpa_array._api.kv_cache.chunks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .kv_call import CacheCall

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_MAX_TOKENS",
    "Piece",
    "bands",
    "chunk_target",
    "host_start",
    "pieces",
    "split_count",
]

#: bytes (1024 tokens for Hkv=8, E=Ev=128 in float32). Measured on 2 cores (B=4, Hq=32,
#: paged, 32768 tokens): chunks of 256-1024 tokens ran 15-30% faster than 2048-8192, as a
#: gathered chunk then stays in the CPU's cache between its copy and its two products.
CHUNK_BYTES = 8 * 2**20

#: ... and of at most this many tokens, so that a long sequence is split even when its heads
#: are small (a single query over 32768 tokens then runs on at least 4 threads).
CHUNK_MAX_TOKENS = 8192


@dataclass(frozen=True)
class Piece:
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


def _pieces_of_range(b: int, start: int, stop: int, ps: int) -> list[Piece]:
    """Tokens ``[start, stop)`` as at most three pieces: a partial page, whole pages, a
    partial page."""
    found = []
    if start % ps:
        end = min(stop, (start // ps + 1) * ps)
        found.append(Piece(b, start // ps, 1, start % ps, end - start))
        start = end
    full = (stop - start) // ps
    if full:
        found.append(Piece(b, start // ps, full, 0, ps))
        start += full * ps
    if start < stop:
        found.append(Piece(b, start // ps, 1, 0, stop - start))
    return found


def bands(c: CacheCall, n: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
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


def host_start(c: CacheCall, b: int) -> int:
    """Sequence ``b``'s first token where ``cache_leftpad`` is known on the host (else 0:
    the start then enters the masks)."""
    return c.starts[b] if isinstance(c.starts, tuple) else 0


def chunk_target(c: CacheCall) -> int:
    """Tokens per chunk when ``num_splits`` is not given: :data:`CHUNK_BYTES` of keys and
    values, at most :data:`CHUNK_MAX_TOKENS`."""
    k, v = c.key_cache, c.value_cache
    itemsize = int(c.xp.finfo(c.query.dtype).bits) // 8
    token_bytes = int(k.shape[1]) * (int(k.shape[3]) + int(v.shape[3])) * itemsize
    return min(CHUNK_MAX_TOKENS, max(1, CHUNK_BYTES // max(token_bytes, 1)))


def split_count(c: CacheCall, longest: int) -> int:
    """Into how many chunks the longest attended range of ``longest`` tokens is cut: the
    caller's ``num_splits``, else enough chunks of :func:`chunk_target` tokens."""
    return c.num_splits or math.ceil(longest / chunk_target(c))


def pieces(c: CacheCall) -> tuple[Piece, ...]:
    """Every piece to attend, sequence by sequence: chunks of ``ceil(longest /
    split_count)`` tokens (whole pages of a paged cache) starting at multiples of the chunk
    length, cut to each sequence's attended range; chunks outside it are not listed."""
    lengths, ps = c.host_lengths, c.page_size
    ranges: list[tuple[int, int]] = []
    for b in range(c.B):
        if lengths is None:
            ranges.append((0, c.capacity))
            continue
        lo, hi = bands(c, lengths[b] + c.new_tokens, host_start(c, b))
        some = lo <= hi
        ranges.append((int(lo[some].min()), int(hi[some].max()) + 1) if some.any() else (0, 0))
    longest = max((stop - start for start, stop in ranges), default=0)
    if longest == 0:
        return ()
    chunk = math.ceil(longest / split_count(c, longest))
    if c.paged:
        chunk = math.ceil(chunk / ps) * ps
    found: list[Piece] = []
    for b, (start, stop) in enumerate(ranges):
        for edge in range(start - start % chunk, stop, chunk):
            found += _pieces_of_range(b, max(edge, start), min(edge + chunk, stop), ps)
    return tuple(found)
