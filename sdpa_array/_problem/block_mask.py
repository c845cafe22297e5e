"""Block masks: a ``mask_mod`` evaluated once on the host, tile by tile, as empty/full/partial.

:func:`create_block_mask` calls the mask function on NumPy index arrays, a chunk of query
rows at a time (never the whole ``(L, S)`` grid at once), and records for each
``(block_q, block_k)`` block of every batch element and head whether no pair, every pair or
some pairs may attend. Passed as ``mask_mod``, the :class:`BlockMask` lets the blocked
kernel skip the empty blocks and evaluate the function only on the partial ones; it is also
a mask function itself (calling it calls the original).

The blocked kernel builds the same classification by itself for a plain mask function
(:func:`classify_in`: with index arrays of the inputs' library, or NumPy ones for the
ready-made functions, :func:`classify_on_host`), and masks tile by tile where it cannot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import device, host_values, numpy_namespace
from .._arrays.typing import Array
from .mod_calls import call_mod, check_mod_callable, index_grid
from .mods_data import check_index

__all__ = [
    "BLOCK_MASK_BLOCK",
    "HOST_BLOCK",
    "BlockMask",
    "classify_in",
    "classify_on_host",
    "create_block_mask",
    "segment_classes",
]

#: Default block size of :func:`create_block_mask` along queries and keys (FlexAttention's).
BLOCK_MASK_BLOCK = 128

#: Block size of the classes the blocked kernel builds itself (:func:`classify_on_host`):
#: fine enough that tiles of the kernel's aligned block sizes (multiples of 16) are classified
#: exactly, while the classes stay ``L * S / 256`` bytes.
HOST_BLOCK = 16

#: Most mask values evaluated at once on the host (a chunk of query rows of every batch
#: element and head the function depends on).
CHUNK_ELEMENTS = 2**22

EMPTY, PARTIAL, FULL = 0, 1, 2

#: Most (batch element, head, query, key) pairs :func:`create_block_mask` evaluates.
MAX_PAIRS = 2**40


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A mask function with the empty/full/partial class of each of its blocks.

    Made by :func:`create_block_mask`; pass it as ``mask_mod``.

    Attributes
    ----------
    mask_mod : callable
        The mask function ``mask_mod(batch, head, q_idx, kv_idx) -> bool array``.
    batch_size, heads : int or None
        What it was evaluated for; ``None``: the function was evaluated at index 0 only,
        and the classification holds for every batch element (heads) only if the function
        does not depend on ``batch`` (``head``).
    L, S : int
        Query and key lengths.
    block_q, block_k : int
        Block sizes along queries and keys (the last block of each axis may be shorter).
    kinds : numpy.ndarray of int8, shape (B', H', ceil(L / block_q), ceil(S / block_k))
        ``BlockMask.EMPTY`` (0), ``PARTIAL`` (1) or ``FULL`` (2) for each block. ``B'`` is
        ``batch_size`` if the function depends on ``batch``, else 1; ``H'`` likewise.

    Examples
    --------
    >>> from sdpa_array import create_block_mask
    >>> bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 4, 4, block_q=2, block_k=2)
    >>> bm.kinds[0, 0]
    array([[1, 0],
           [2, 1]], dtype=int8)
    >>> bm.sparsity
    0.25
    """

    EMPTY = EMPTY
    PARTIAL = PARTIAL
    FULL = FULL

    mask_mod: Callable[..., Any]
    batch_size: int | None
    heads: int | None
    L: int
    S: int
    block_q: int
    block_k: int
    kinds: np.ndarray = field(repr=False)

    def __call__(self, batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        """Evaluate the mask function (a block mask is a mask function too)."""
        return self.mask_mod(batch, head, q_idx, kv_idx)

    @property
    def sparsity(self) -> float:
        """Fraction of the blocks (over every batch element and head) that are empty."""
        return float(np.mean(self.kinds == EMPTY)) if self.kinds.size else 0.0

    def __repr__(self) -> str:
        counts = {name: int(np.sum(self.kinds == k)) for name, k in _NAMES.items()}
        return (
            f"BlockMask({getattr(self.mask_mod, '__qualname__', self.mask_mod)!r}, "
            f"batch_size={self.batch_size}, heads={self.heads}, L={self.L}, S={self.S}, "
            f"block_q={self.block_q}, block_k={self.block_k}, blocks={counts})"
        )


_NAMES = {"empty": EMPTY, "partial": PARTIAL, "full": FULL}


def _classes(counts: np.ndarray, rows: int, cols: int, block_q: int, block_k: int) -> np.ndarray:
    """Block classes from the admissible pairs ``counts`` of each block of a ``(rows, cols)``
    grid (the last block of each axis may be shorter)."""
    heights = np.minimum(block_q, rows - np.arange(0, rows, block_q))
    widths = np.minimum(block_k, cols - np.arange(0, cols, block_k))
    sizes = heights[:, None] * widths[None, :]
    return np.where(counts == sizes, FULL, np.where(counts > 0, PARTIAL, EMPTY)).astype(np.int8)


def _reduce_blocks(chunk: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """Classes of the blocks of ``chunk`` (``(B', H', rows, S)``, rows a block multiple or the
    end of the grid), from the number of admissible pairs in each block."""
    rows, cols = chunk.shape[-2:]
    ones = chunk.view(np.uint8)
    if rows % block_q == 0:  # a sum over an axis of a reshape: no reduceat over every row
        shape = (*ones.shape[:-2], rows // block_q, block_q, cols)
        per_rows = np.sum(np.reshape(ones, shape), axis=-2, dtype=np.int32)
    else:
        per_rows = np.add.reduceat(ones, np.arange(0, rows, block_q), axis=-2, dtype=np.int32)
    counts = np.add.reduceat(per_rows, np.arange(0, cols, block_k), axis=-1)
    return _classes(counts, rows, cols, block_q, block_k)


def _block_counts(xp: ModuleType, values: Array, block_q: int, block_k: int) -> np.ndarray:
    """:func:`_reduce_blocks` for ``values`` of another library: the admissible pairs of each
    block counted there, the classes (a small array) formed on the host."""
    *outer, rows, cols = values.shape
    nq, nk = -(-rows // block_q), -(-cols // block_k)
    ones = xp.astype(values, xp.int32)
    here = device(ones)
    if nq * block_q != rows:  # zero padding to whole blocks
        pad = xp.zeros((*outer, nq * block_q - rows, cols), dtype=xp.int32, device=here)
        ones = xp.concat([ones, pad], axis=-2)
    if nk * block_k != cols:
        pad = xp.zeros((*outer, nq * block_q, nk * block_k - cols), dtype=xp.int32, device=here)
        ones = xp.concat([ones, pad], axis=-1)
    ones = xp.reshape(ones, (*outer, nq, block_q, nk, block_k))
    counts = host_values(xp.sum(xp.sum(ones, axis=-1), axis=-2))
    if counts is None:
        raise TypeError("the classes of a lazy or traced mask cannot be read on the host")
    return _classes(counts, rows, cols, block_q, block_k)


def _evaluate(
    mask_mod: Callable[..., Any],
    batch: tuple[int, ...],
    heads: tuple[int, ...],
    L: int,
    S: int,
    block_q: int,
    block_k: int,
    xp: ModuleType | None = None,
    where: Any = None,
) -> np.ndarray:
    """Block classes ``(B', H', nq, nk)``: the function on index arrays of ``xp`` on device
    ``where``, chunk by chunk."""

    xp = numpy_namespace() if xp is None else xp

    def chunk(rows: slice) -> Array:
        indices = index_grid(xp, where, batch, heads, rows, slice(0, S))
        shape = (*batch, *heads, rows.stop - rows.start, S)
        return call_mod("mask_mod", mask_mod, indices, shape)  # xp's, checked

    nq, nk = -(-L // block_q), -(-S // block_k)
    probe = chunk(slice(0, min(L, 1)))
    # the result's shape tells which index arrays it depends on; the batch (heads) axes are
    # kept whole when it depends on any of them
    got = (1,) * (len(batch) + len(heads) + 2 - len(probe.shape)) + tuple(probe.shape)
    on_batch = any(m != 1 for m in got[: len(batch)])
    on_heads = any(m != 1 for m in got[len(batch) : len(batch) + len(heads)])
    depends = (
        *(batch if on_batch else (1,) * len(batch)),
        *(heads if on_heads else (1,) * len(heads)),
    )
    outer = (int(np.prod(batch)) if on_batch else 1, int(np.prod(heads)) if on_heads else 1)
    kinds = np.empty((*outer, nq, nk), dtype=np.int8)
    per_row = max(1, outer[0] * outer[1] * S)
    step = max(1, CHUNK_ELEMENTS // per_row // block_q) * block_q
    for r0 in range(0, L, step):
        rows = slice(r0, min(L, r0 + step))
        values = xp.broadcast_to(chunk(rows), (*depends, rows.stop - rows.start, S))
        values = xp.reshape(values, (*outer, rows.stop - rows.start, S))
        reduce = _reduce_blocks if xp is np else functools.partial(_block_counts, xp)
        kinds[:, :, r0 // block_q : -(-rows.stop // block_q)] = reduce(values, block_q, block_k)
    return kinds


def segment_classes(
    query_ids: np.ndarray, key_ids: np.ndarray, L: int, S: int, block_q: int, block_k: int
) -> np.ndarray | None:
    """Block classes ``(B', 1, nq, nk)`` of the mask ``query_ids[i] == key_ids[j]`` (a
    document mask) from each block's smallest and largest id, without evaluating the mask:
    a block is empty where the two ranges do not meet, full where both blocks hold one and
    the same id, partial otherwise (exact for packed documents numbered in order, each id
    the last one or one more). ``None`` where the ids do not cover ``L`` and ``S`` or their
    batch axes differ."""
    if query_ids.shape[-1] != L or key_ids.shape[-1] != S:
        return None
    q, k = np.reshape(query_ids, (-1, L)), np.reshape(key_ids, (-1, S))
    if len(q) != len(k) and 1 not in (len(q), len(k)):
        return None

    def ranges(ids: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        starts = np.arange(0, ids.shape[-1], size)
        return np.minimum.reduceat(ids, starts, axis=-1), np.maximum.reduceat(ids, starts, -1)

    (q_lo, q_hi), (k_lo, k_hi) = ranges(q, block_q), ranges(k, block_k)
    q_lo, q_hi = q_lo[:, :, None], q_hi[:, :, None]
    k_lo, k_hi = k_lo[:, None, :], k_hi[:, None, :]
    meet = (q_lo <= k_hi) & (k_lo <= q_hi)
    one = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    return np.where(one, FULL, np.where(meet, PARTIAL, EMPTY)).astype(np.int8)[:, None]


def create_block_mask(
    mask_mod: Callable[..., Any],
    batch_size: int | None,
    heads: int | None,
    L: int,
    S: int,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
) -> BlockMask:
    """Evaluate ``mask_mod`` once on the host and classify its blocks.

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(batch, head, q_idx, kv_idx) -> boolean array`` (see :mod:`sdpa_array.mods`),
        called here with NumPy index arrays; it must compute with their library
        (``array_api_compat.array_namespace(q_idx)``).
    batch_size : int or None
        Number of batch elements (the leading batch axes flattened); ``None`` evaluates
        ``batch = 0`` only, for functions that do not depend on it.
    heads : int or None
        Number of query heads; ``None`` evaluates ``head = 0`` only, likewise.
    L, S : int
        Query and key lengths of the calls the mask is for.
    block_q, block_k : int, optional
        Block sizes (default 128 each).

    Returns
    -------
    BlockMask
        Pass it as ``mask_mod`` to :func:`scaled_dot_product_attention` (and the VJP) for
        inputs of these sizes. The function is evaluated a chunk of query rows at a time,
        so no ``(L, S)`` array of every batch element and head is formed.

    Raises
    ------
    TypeError, ValueError
        Arguments that are not positive ints (``L``, ``S`` may be 0), a ``mask_mod`` that is
        not callable, raises, or returns something other than a boolean NumPy array that
        broadcasts to the scores' shape.

    Examples
    --------
    Three packed documents of 96, 64 and 96 tokens, causal within each: of the 16 tiles of
    64 x 64, 9 are empty (skipped), 7 partial (the function is evaluated there):

    >>> import numpy as np
    >>> from sdpa_array import create_block_mask, mods, scaled_dot_product_attention
    >>> segments = np.repeat([0, 1, 2], [96, 64, 96])
    >>> doc_causal = mods.and_masks(mods.causal(), mods.document(segments, segments))
    >>> bm = create_block_mask(doc_causal, None, None, 256, 256, block_q=64, block_k=64)
    >>> bm.kinds[0, 0]  # 0 empty, 1 partial, 2 full
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]], dtype=int8)
    >>> bm.sparsity
    0.5625
    >>> q = np.random.default_rng(0).standard_normal((2, 256, 16), dtype=np.float32)
    >>> scaled_dot_product_attention(q, q, q, mask_mod=bm).shape
    (2, 256, 16)
    """
    check_mod_callable("mask_mod", mask_mod)
    if isinstance(mask_mod, BlockMask):
        mask_mod = mask_mod.mask_mod
    b = None if batch_size is None else check_index("batch_size", batch_size, minimum=1)
    h = None if heads is None else check_index("heads", heads, minimum=1)
    n_q, n_k = check_index("L", L, minimum=0), check_index("S", S, minimum=0)
    bq = check_index("block_q", BLOCK_MASK_BLOCK if block_q is None else block_q, minimum=1)
    bk = check_index("block_k", BLOCK_MASK_BLOCK if block_k is None else block_k, minimum=1)
    pairs = (b or 1) * (h or 1) * n_q * n_k
    if pairs > MAX_PAIRS:
        raise ValueError(
            f"create_block_mask evaluates mask_mod on every (query, key) pair of every batch "
            f"element and head: batch_size={b}, heads={h}, L={n_q}, S={n_k} make {pairs}, "
            f"more than {MAX_PAIRS}"
        )
    if n_q == 0 or n_k == 0:
        kinds = np.zeros((1, 1, -(-n_q // bq), -(-n_k // bk)), dtype=np.int8)
    else:
        kinds = _evaluate(mask_mod, (b or 1,), (h or 1,), n_q, n_k, bq, bk)
    return BlockMask(mask_mod, b, h, n_q, n_k, bq, bk, kinds)


def classify_on_host(
    mask_mod: Callable[..., Any],
    batch: tuple[int, ...],
    heads: tuple[int, ...],
    L: int,
    S: int,
) -> np.ndarray | None:
    """Block classes ``(B', H', nq, nk)`` of a mask function that is known to give on NumPy
    indices what it gives on the inputs' (the ready-made ones of :mod:`sdpa_array.mods`),
    or ``None`` where its data cannot be read on the host (traced or lazy arrays). Blocks of
    :data:`HOST_BLOCK`."""
    return classify_in(numpy_namespace(), None, mask_mod, batch, heads, L, S)


def classify_in(
    xp: ModuleType,
    where: Any,
    mask_mod: Callable[..., Any],
    batch: tuple[int, ...],
    heads: tuple[int, ...],
    L: int,
    S: int,
) -> np.ndarray | None:
    """Block classes ``(B', H', nq, nk)`` of a mask function called, as always, with index
    arrays of the inputs' library ``xp`` on their device ``where``; ``None`` where the classes
    cannot be read on the host (traced or lazy arrays) or the function raises (its tiles are
    then evaluated one by one, where its error surfaces). Blocks of :data:`HOST_BLOCK`."""
    try:
        return _evaluate(mask_mod, batch, heads, L, S, HOST_BLOCK, HOST_BLOCK, xp, where)
    except Exception:  # evaluated tile by tile in the inputs' library instead
        return None
