"""Running the forward over the cache: one call over a slice, or chunk by chunk.

:func:`attend_single` runs the plan's ``"single"`` choice: one call of
:func:`~sdpa_array.scaled_dot_product_attention` over the tokens ``[lo, n)`` that every
sequence of a contiguous cache attends (views, nothing copied), so that a decoding step
costs what the forward costs on that slice. :func:`attend_chunks` runs ``"split"``: it
attends every piece of the plan (:func:`~sdpa_array._plan.splits.pieces`) with the forward
on that piece's keys only, on NumPy's thread pool
(:func:`~sdpa_array._arrays.parallel.map_blocks`), and merges each sequence's pieces with
:func:`~sdpa_array.merge_attention_states`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..._arrays.merge import merge_attention_states
from ..._arrays.parallel import map_blocks
from ..._arrays.typing import Array
from ..._plan.decode import DecodePlan
from ..._plan.kv_call import CacheCall
from ..._plan.splits import CHUNK_BYTES, CHUNK_MAX_TOKENS, Piece, bands, host_start
from ..forward import scaled_dot_product_attention

__all__ = ["CHUNK_BYTES", "CHUNK_MAX_TOKENS", "attend_chunks", "attend_single", "single_call"]


def _start(c: CacheCall, b: int) -> Any:
    """Sequence ``b``'s first token: an int, or a 0-d array where it cannot be read."""
    if c.starts is None or isinstance(c.starts, tuple):
        return host_start(c, b)
    return c.starts[b]


def _gather(c: CacheCall, cache: Array, piece: Piece) -> Array:
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


def _positions(c: CacheCall, piece: Piece) -> Array:
    """Token position of every (page, row) of the piece, ``(count, rows)``."""
    xp, dev = c.xp, c.device
    pages = xp.reshape(xp.arange(piece.count, device=dev), (-1, 1))
    rows = xp.reshape(xp.arange(piece.rows, device=dev), (1, -1))
    return (pages + piece.j0) * c.page_size + piece.r0 + rows


def _band_mask(c: CacheCall, piece: Piece, n: Any, first: Any) -> Array | None:
    """Which (query, token) pairs the lengths, the start ``first``, ``is_causal`` and
    ``window`` admit, from global positions, ``(count, 1, L|1, rows)``; ``None`` where the
    piece is admissible for every query (known lengths and start only)."""
    xp, L = c.xp, c.L
    if isinstance(n, int) and isinstance(first, int):
        lo, hi = bands(c, n, first)
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


def _term_piece(c: CacheCall, term: Array | None, piece: Piece) -> Array | None:
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


def _attend_piece(c: CacheCall, caches: tuple[Array, Array], piece: Piece) -> tuple[Array, ...]:
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


def attend_chunks(plan: DecodePlan, caches: tuple[Array, Array]) -> tuple[Array, Array, Array]:
    """The ``"split"`` choice: every piece of the plan on the thread pool, then one merge
    per sequence: output, log-sum-exp and, where asked for, the maximum scores ``(B, Hq)``
    (the largest of the pieces'), else ``None``."""
    c = plan.call
    xp = c.xp
    dtype = c.query.dtype
    compute = dtype if xp.finfo(dtype).bits >= 32 else xp.float32
    Hq, L, Ev = int(c.query.shape[1]), c.L, int(c.value_cache.shape[-1])
    pieces = plan.pieces
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


def _cut(term: Array | None, lo: int, n: int) -> Array | None:
    """The caller's mask or bias ``(B|1, Hq|1, L|1, T|1)`` for the tokens ``[lo, n)``."""
    if term is None or term.shape[-1] == 1:
        return term
    return term[..., lo:n]


def single_call(plan: DecodePlan, caches: tuple[Array, Array]) -> tuple[Any, ...]:
    """``(query, key, value, keywords)`` of the ``"single"`` choice's forward call: the
    cache's tokens ``[lo, n)`` as views, and the options.

    The keys are the cache's own, so the bottom-right diagonal stays on token ``n - 1``;
    one query on it admits every token under ``is_causal``, so such a call is the forward's
    plain call (whose plan the forward keeps: it costs what the forward costs on the
    slice)."""
    c = plan.call
    lo, n = plan.span or (0, 0)
    keywords = dict(c.passed)
    causal = c.is_causal and c.L > 1
    if causal or c.window is not None:
        keywords.update(is_causal=causal, window=c.window, alignment="bottom_right")
    if c.mask is not None:
        keywords["mask"] = _cut(c.mask, lo, n)
    if c.bias is not None:
        keywords["bias"] = _cut(c.bias, lo, n)
    if c.return_lse:
        keywords["return_lse"] = True
    if c.return_max_scores:
        keywords["return_max_scores"] = True
    return c.query, caches[0][:, :, lo:n, :], caches[1][:, :, lo:n, :], keywords


def attend_single(plan: DecodePlan, caches: tuple[Array, Array]) -> tuple[Array, Any, Any]:
    """The ``"single"`` choice: output, log-sum-exp (where asked for, else ``None``) and
    maximum scores (likewise) of one forward call over the cache's tokens ``[lo, n)``
    (:func:`single_call`)."""
    c = plan.call
    query, key, value, keywords = single_call(plan, caches)
    result = scaled_dot_product_attention(query, key, value, **keywords)
    if not (c.return_lse or c.return_max_scores):
        return result, None, None
    return (
        result[0],
        result[1] if c.return_lse else None,
        result[-1] if c.return_max_scores else None,
    )
