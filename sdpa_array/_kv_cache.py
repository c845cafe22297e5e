"""Decoding attention over a KV cache, contiguous or paged: write, split, attend, merge.

:func:`attention_with_kv_cache` is the public face. It checks every argument first
(:mod:`sdpa_array._kv_cache_args`), writes the new tokens into the caches (:func:`_write`),
cuts each sequence's attended tokens into chunks (:func:`_plan`), attends to every chunk with
:func:`~sdpa_array.scaled_dot_product_attention` on that chunk's keys only, on NumPy's
thread pool (:func:`~sdpa_array._arrays.parallel.map_blocks`), and merges each sequence's
chunks with :func:`~sdpa_array.merge_attention_states` (split-K "flash-decoding").

Everything is Array-API code; the only per-library choices are how the new tokens are written
(:data:`_FUNCTIONAL_WRITERS`, :data:`_COPIERS`) and how a small integer array is read on the
host (in :mod:`sdpa_array._kv_cache_args`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._api import scaled_dot_product_attention
from ._arrays.parallel import map_blocks
from ._kv_cache_args import CacheCall, check_call
from ._merge import merge_attention_states
from ._typing import Array

__all__ = ["CHUNK_BYTES", "CHUNK_MAX_TOKENS", "attention_with_kv_cache"]

#: The automatic number of splits gives chunks whose keys and values take at most this many
#: bytes (1024 tokens for Hkv=8, E=Ev=128 in float32). Measured on 2 cores (B=4, Hq=32,
#: paged, 32768 tokens): chunks of 256-1024 tokens ran 15-30% faster than 2048-8192, as a
#: gathered chunk then stays in the CPU's cache between its copy and its two products.
CHUNK_BYTES = 8 * 2**20

#: ... and of at most this many tokens, so that a long sequence is split even when its heads
#: are small (a single query over 32768 tokens then runs on at least 4 threads).
CHUNK_MAX_TOKENS = 8192


def _jax_set(cache: Array, pages: Any, rows: Any, values: Array) -> Array:
    """``cache`` with ``cache[pages[n], :, rows[n], :] = values[n]``, as a new JAX array."""
    return cache.at[pages, :, rows, :].set(values)


#: Libraries whose arrays are immutable: the update builds the new array natively.
_FUNCTIONAL_WRITERS: dict[str, Callable[[Array, Any, Any, Array], Array]] = {"jax": _jax_set}

#: How to copy an array before writing into the copy, where ``xp.asarray(x, copy=True)``
#: does not fit (torch: ``clone`` keeps the autograd graph and warns about nothing).
_COPIERS: dict[str, Callable[[Array], Array]] = {"torch": lambda x: x.clone()}

#: Libraries whose ``x[...] = y`` would rebind the caller's object rather than write memory.
_NOT_IN_PLACE = frozenset({"dask"})


def attention_with_kv_cache(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    /,
    *,
    cache_lengths: Array | list[int],
    new_key: Array | None = None,
    new_value: Array | None = None,
    block_table: Array | list[list[int]] | None = None,
    num_splits: int | None = None,
    **options: Any,
) -> tuple[Array, ...]:
    r"""Attention of a few new queries over a KV cache (decoding), contiguous or paged.

    Optionally writes ``new_key``/``new_value`` into the caches first, then attends each
    sequence's query to the tokens of its cache, without ever gathering a copy of the whole
    cache: the attended tokens are split into chunks, each chunk's partial attention is
    computed on that chunk's keys alone and the parts are merged by their log-sum-exps.

    Parameters
    ----------
    query : array, shape (B, Hq, L, E)
        ``L`` new queries per sequence (usually 1).
    key_cache : array
        Contiguous: ``(B, Hkv, S_max, E)``. Paged (``block_table`` given):
        ``(num_pages, Hkv, page_size, E)``. Same library and dtype as ``query``.
    value_cache : array
        ``(B, Hkv, S_max, Ev)`` or ``(num_pages, Hkv, page_size, Ev)``.
    cache_lengths : array or list of int, shape (B,)
        Tokens already in each sequence's cache: an integer array of the inputs' library, a
        NumPy array or a list of ints.
    new_key, new_value : array, shape (B, Hkv, L, E) and (B, Hkv, L, Ev), optional
        Both or neither. Written at token positions ``cache_lengths[b] ...
        cache_lengths[b] + L - 1`` before attending; the query then attends tokens
        ``[0, cache_lengths[b] + L)``. Without them the cache already holds the query's
        tokens and the query attends tokens ``[0, cache_lengths[b])``.
    block_table : array or list of lists of int, shape (B, max_pages), optional
        Makes the cache paged: sequence ``b``'s token ``t`` lives in page
        ``block_table[b, t // page_size]`` at row ``t % page_size``. Only the entries a
        sequence uses are read.
    num_splits : int, optional
        Into how many chunks the longest attended range is split (see Notes); by default
        chosen from its length. Chunks are whole pages, so fewer may result.
    **options
        ``mask``, ``bias``, ``is_causal``, ``window``, ``scale``, ``softcap``,
        ``enable_gqa``, ``return_lse``: as in :func:`scaled_dot_product_attention`.
        ``mask`` and ``bias`` are indexed by token position: broadcastable to
        ``(B, Hq, L, T)`` with ``T = S_max`` (contiguous) or ``max_pages * page_size``
        (paged). The alignment is always bottom-right over the attended tokens: with
        ``n_b`` of them, query ``i``'s diagonal is token ``n_b - L + i``, so
        ``is_causal=True`` is the usual decoding rule and ``window=(left, right)`` counts
        from that diagonal (``alignment="bottom_right"`` is accepted, nothing else).

    Returns
    -------
    out : array, shape (B, Hq, L, Ev)
        Same library, dtype and device as ``query``.
    lse : array, shape (B, Hq, L)
        Only with ``return_lse=True``; in the compute dtype (float32 for 16-bit inputs).
    key_cache, value_cache : array
        The caches holding the new tokens, unchanged elsewhere. Written in place, and the
        caller's own arrays returned, for NumPy (writable arrays), CuPy, array-api-strict and
        torch (when neither the cache nor the new tokens require grad). New arrays for JAX
        (``.at[].set``), Dask, read-only NumPy arrays and torch under autograd, and where
        the lengths or the block table cannot be read on the host (lazy Dask arrays: then
        the update is a ``where`` over the cache). Without new tokens the caller's arrays
        are returned as they are.

    Raises
    ------
    TypeError
        Arrays of different libraries, non-floating or different dtypes, a non-boolean
        ``mask``, non-integer ``cache_lengths`` or ``block_table``, a ``num_splits`` that is
        not an int, an unknown option (``return_weights`` included).
    ValueError
        Shapes that do not fit together, ``new_key`` without ``new_value`` (or the reverse),
        a cache too small for ``cache_lengths + L`` or negative lengths, a ``block_table``
        entry outside ``[0, num_pages)`` among the pages a sequence uses, a ``num_splits``
        below 1, out-of-range options; all before any work. Values that cannot be read
        (lazy Dask arrays, JAX tracers) are not checked; a block table entry outside the
        pages is then clipped to the nearest page, whose tokens the lengths exclude.

    Notes
    -----
    *Chunks.* Sequence ``b`` attends the tokens ``[lo_b, hi_b)`` that some query may attend
    (``[0, n_b)``, narrowed by ``window`` and ``is_causal``). The chunk length is ``ceil(n /
    num_splits)`` tokens, rounded up to whole pages for a paged cache, with ``n`` the
    longest such range over the batch. By default ``num_splits = ceil(n / target)`` with
    ``target = min(CHUNK_MAX_TOKENS, CHUNK_BYTES // token_bytes)``, ``token_bytes = Hkv * (E
    + Ev) * itemsize``, ``CHUNK_BYTES`` = 8 MiB and ``CHUNK_MAX_TOKENS`` = 8192: chunks of
    1024 tokens for ``Hkv = 8``, ``E = Ev = 128`` in float32, so that a single query over a
    32k-token cache is split 32 ways (at least 4 ways for any head size) and keeps every
    thread of NumPy's pool busy. Chunks start at multiples of the chunk length and are cut
    to ``[lo_b, hi_b)``; chunks outside it are never read or computed. A paged chunk is
    gathered page by page (consecutive pages as one view) and attended with its pages as a
    batch axis; a partly filled page is attended on its filled rows only, so cache slots
    beyond the lengths are never read, whatever they hold. Where the lengths cannot be read
    on the host, every chunk of ``[0, T)`` is computed, the lengths enter the mask, and
    values beyond them are zeroed first.

    *Accuracy.* Each chunk is a call of the main function (within its derived error
    bound); merging ``n`` parts adds the error of an attention over ``n`` keys whose
    scores are the parts' log-sum-exps (see :func:`merge_attention_states` and
    ``tests/test_kv_cache.py``).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array._kv_cache import attention_with_kv_cache
    >>> k_cache = np.zeros((1, 1, 4, 2))  # B=1, Hkv=1, S_max=4, E=2
    >>> v_cache = np.zeros((1, 1, 4, 1))
    >>> k_cache[0, 0, :2] = [[1.0, 0.0], [0.0, 1.0]]  # two tokens already cached
    >>> v_cache[0, 0, :2] = [[1.0], [2.0]]
    >>> q = np.array([[[[1.0, 1.0]]]])  # one new query
    >>> out, k_new, v_new = attention_with_kv_cache(
    ...     q, k_cache, v_cache, cache_lengths=[2],
    ...     new_key=np.array([[[[1.0, 1.0]]]]), new_value=np.array([[[[6.0]]]]),
    ...     is_causal=True)
    >>> k_new is k_cache, v_cache[0, 0, :, 0]  # written in place: token 2 is the new one
    (True, array([1., 2., 6., 0.]))
    >>> out.round(4)
    array([[[[3.7657]]]])

    The same tokens in a paged cache of pages of 2 tokens, stored out of order:

    >>> pages_k = np.zeros((3, 1, 2, 2))
    >>> pages_v = np.zeros((3, 1, 2, 1))
    >>> pages_k[2], pages_k[0] = k_cache[0, :, :2], k_cache[0, :, 2:]
    >>> pages_v[2], pages_v[0] = v_cache[0, :, :2], v_cache[0, :, 2:]
    >>> out_paged, _, _ = attention_with_kv_cache(
    ...     q, pages_k, pages_v, cache_lengths=[3], block_table=[[2, 0]], is_causal=True)
    >>> bool(np.allclose(out_paged, out))
    True
    """
    c = check_call(
        query,
        key_cache,
        value_cache,
        cache_lengths=cache_lengths,
        new_key=new_key,
        new_value=new_value,
        block_table=block_table,
        num_splits=num_splits,
        options=options,
    )
    caches = _write(c)
    out, lse = _attend(c, caches)
    return (out, lse, *caches) if c.return_lse else (out, *caches)


# --------------------------------------------------------------------------------------
# Writing the new tokens
# --------------------------------------------------------------------------------------


def _targets(c: CacheCall) -> tuple[Any, Any]:
    """Page index and row of every new token, ``(B * L,)`` each, sequence-major.

    Host NumPy arrays where lengths and block table are known, else arrays of the library.
    """
    xp, L, ps = c.xp, c.L, c.page_size
    lengths, table = c.host_lengths, c.host_table
    if lengths is not None and table is not None:
        t = np.asarray(lengths, dtype=np.int64)[:, None] + np.arange(L)
        pages = np.take_along_axis(table, t // ps, axis=1)
        return pages.reshape(-1), (t % ps).reshape(-1)
    dev = c.device
    n: Array = xp.asarray(lengths, device=dev) if lengths is not None else c.lengths
    t = xp.reshape(n, (c.B, 1)) + xp.reshape(xp.arange(L, dtype=n.dtype, device=dev), (1, L))
    on_device = xp.asarray(table, device=dev) if table is not None else c.table
    pages = xp.stack([xp.take(on_device[b, :], t[b, :] // ps, axis=0) for b in range(c.B)])
    return xp.reshape(pages, (-1,)), xp.reshape(t % ps, (-1,))


def _in_place(c: CacheCall, cache: Array, new: Array) -> bool:
    """Whether ``cache`` may be written into: writable, and no autograd graph involved."""
    if c.library in _NOT_IN_PLACE:
        return False
    if getattr(cache, "requires_grad", False) or getattr(new, "requires_grad", False):
        return False
    flags = getattr(cache, "flags", None)
    return flags is None or bool(getattr(flags, "writeable", True))


def _write_one(c: CacheCall, cache: Array, new: Array) -> Array:
    xp, L = c.xp, c.L
    pages, rows = _targets(c)
    writer = _FUNCTIONAL_WRITERS.get(c.library)
    if writer is not None:
        values = xp.reshape(xp.permute_dims(new, (0, 2, 1, 3)), (c.B * L, *new.shape[1:2], -1))
        return writer(cache, pages, rows, values)
    if not isinstance(pages, np.ndarray):  # positions known on the device only
        grid_p = xp.reshape(xp.arange(cache.shape[0], device=c.device), (-1, 1, 1, 1))
        grid_r = xp.reshape(xp.arange(c.page_size, device=c.device), (1, 1, -1, 1))
        for n in range(c.B * L):
            b, i = divmod(n, L)
            at = (grid_p == pages[n]) & (grid_r == rows[n])
            cache = xp.where(at, xp.expand_dims(new[b, :, i : i + 1, :], axis=0), cache)
        return cache
    if not _in_place(c, cache, new):
        copy = _COPIERS.get(c.library)
        cache = copy(cache) if copy is not None else xp.asarray(cache, copy=True)
    for b in range(c.B):  # runs of consecutive rows within one page
        i = 0
        while i < L:
            n = b * L + i
            page, row = int(pages[n]), int(rows[n])
            run = min(L - i, c.page_size - row)
            cache[page, :, row : row + run, :] = new[b, :, i : i + run, :]
            i += run
    return cache


def _write(c: CacheCall) -> tuple[Array, Array]:
    """The caches holding the new tokens (see Returns in the public docstring)."""
    if c.new_key is None or c.new_tokens == 0 or c.B == 0:
        return c.key_cache, c.value_cache
    return _write_one(c, c.key_cache, c.new_key), _write_one(c, c.value_cache, c.new_value)


# --------------------------------------------------------------------------------------
# Chunks
# --------------------------------------------------------------------------------------


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


def _bands(c: CacheCall, n: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last admissible token of each query (``lo > hi``: none) for ``n`` tokens."""
    diag = n - c.L + np.arange(c.L)
    left, right = c.window if c.window is not None else (None, None)
    lo = np.maximum(0, diag - left) if left is not None else np.zeros(c.L, dtype=np.int64)
    hi = np.full(c.L, n - 1)
    if c.is_causal:
        hi = np.minimum(hi, diag)
    if right is not None:
        hi = np.minimum(hi, diag + right)
    return lo, hi


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
        lo, hi = _bands(c, lengths[b] + c.new_tokens)
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


# --------------------------------------------------------------------------------------
# Attending to one piece, and merging
# --------------------------------------------------------------------------------------


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


def _band_mask(c: CacheCall, piece: _Piece, n: Any) -> Array | None:
    """Which (query, token) pairs the lengths, ``is_causal`` and ``window`` admit, from
    global positions, ``(count, 1, L|1, rows)``; ``None`` where the piece is admissible
    for every query (known lengths only)."""
    xp, L = c.xp, c.L
    if isinstance(n, int):
        lo, hi = _bands(c, n)
        ps = c.page_size
        if bool(np.all(lo <= piece.first(ps))) and bool(np.all(hi >= piece.last(ps))):
            return None
    t = xp.expand_dims(_positions(c, piece), axis=1)  # (count, 1, rows)
    ok = t < n
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


def _attend_piece(c: CacheCall, caches: tuple[Array, Array], piece: _Piece) -> tuple[Array, Array]:
    """Partial attention of sequence ``piece.b``'s queries over the piece's tokens:
    ``(count, Hq, L, Ev)`` and ``(count, Hq, L)``."""
    xp = c.xp
    b = piece.b
    lengths = c.host_lengths
    n = lengths[b] + c.new_tokens if lengths is not None else c.lengths[b] + c.new_tokens
    k, v = _gather(c, caches[0], piece), _gather(c, caches[1], piece)
    mask = _band_mask(c, piece, n)
    if lengths is None:  # slots beyond the length may hold anything (NaN): 0 * NaN is NaN
        valid = xp.reshape(_positions(c, piece) < n, (piece.count, 1, piece.rows, 1))
        v = xp.where(valid, v, xp.zeros((), dtype=v.dtype, device=c.device))
    user = _term_piece(c, c.mask, piece)
    if user is not None:
        mask = user if mask is None else mask & user
    out, lse = scaled_dot_product_attention(
        c.query[b : b + 1, ...],
        k,
        v,
        mask=mask,
        bias=_term_piece(c, c.bias, piece),
        return_lse=True,
        **c.passed,
    )
    return out, lse


def _attend(c: CacheCall, caches: tuple[Array, Array]) -> tuple[Array, Array]:
    """Every piece on the thread pool, then one merge per sequence."""
    xp = c.xp
    dtype = c.query.dtype
    compute = dtype if xp.finfo(dtype).bits >= 32 else xp.float32
    Hq, L, Ev = int(c.query.shape[1]), c.L, int(c.value_cache.shape[-1])
    pieces = _plan(c) if L else []
    results = map_blocks(xp, lambda piece: _attend_piece(c, caches, piece), pieces)
    by_sequence: list[list[tuple[Array, Array]]] = [[] for _ in range(c.B)]
    for piece, result in zip(pieces, results, strict=True):
        by_sequence[piece.b].append(result)
    outs, lses = [], []
    for parts in by_sequence:
        if not parts:
            outs.append(xp.zeros((Hq, L, Ev), dtype=dtype, device=c.device))
            lses.append(xp.full((Hq, L), -math.inf, dtype=compute, device=c.device))
            continue
        part_outs = [o for o, _ in parts]
        part_lses = [s for _, s in parts]
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
        )
    return xp.stack(outs, axis=0), xp.stack(lses, axis=0)
