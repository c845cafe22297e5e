"""The blocked implementation: a FlashAttention-style forward pass on the Array API.

Keys and values are visited in blocks with an *online softmax*: each query row keeps a
running maximum ``m``, a running sum ``l`` of ``exp(score - m)`` and a running output ``acc``,
and rescales ``l`` and ``acc`` by ``exp(m_old - m_new)`` whenever a later key block raises the
maximum. Queries are processed in blocks too, so the largest temporary is one
``(block_q, block_k)`` score tile per batch element instead of the ``(L, S)`` score matrix.

The work is planned in plain Python before any array is touched (:func:`plan_blocks`):

* each query block reaches only the keys :meth:`Positions.key_range` allows, so key blocks
  that causal or window restrictions exclude entirely are never computed (causal attention
  does about half the work of the unrestricted call);
* the reachable keys are split into the part that *every* query of the block may attend
  (no ``where`` needed, see :meth:`Positions.tile_is_full`) and the partial bands at its
  edges, so the positional mask is only ever built for the few tiles on a boundary.

The per-tile maths reuses :mod:`sdpa_array._scores` (the same score, mask and safe-softmax
helpers as the materialized path), so the two implementations cannot drift apart. Nothing
here knows which array library runs it; running independent query blocks concurrently is
delegated to :mod:`sdpa_array._parallel`, the one place that does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._parallel import map_blocks
from ._positions import Positions
from ._problem import Problem
from ._result import AttentionResult
from ._scores import (
    exp_shift,
    log_sum_exp,
    prepare_operands,
    prepare_score_terms,
    safe_reciprocal,
    tile_scores,
    ungroup,
)

__all__ = [
    "TILE_BYTES",
    "KeyTile",
    "QueryBlock",
    "blocked_attention",
    "choose_block_sizes",
    "plan_blocks",
]

#: Target size in bytes of one score tile (all batch elements processed together in it).
#: Measured with NumPy on 2 cores with 1 MiB of L2 each (B=1, H=8, E=64, float32): tiles of
#: 0.25 to 1 MiB are within noise of each other at L = S = 4096, and at L = S = 1024 1 MiB
#: (256 x 1024) is about 10% faster than 2 MiB (512 x 1024): more, smaller items keep
#: both threads busy and the tile's passes closer to cache.
TILE_BYTES = 2**20

#: Longest default key block: long enough that the online-softmax rescaling of ``acc``
#: (``block_q * Ev`` per key block) is small beside the tile (``block_q * block_k``), short
#: enough that ``block_q`` stays at 256 for float32 (128 for float64) in the tile budget.
MAX_BLOCK_K = 1024

#: Default blocks are multiples of this (matrix-product kernels prefer aligned sizes).
BLOCK_ALIGN = 16


@dataclass(frozen=True)
class KeyTile:
    """Keys ``[start, stop)`` of one tile, and whether no position in it is excluded."""

    start: int
    stop: int
    full: bool


@dataclass(frozen=True)
class QueryBlock:
    """Queries ``[start, stop)`` and the key tiles they visit, in order.

    An empty ``tiles`` means no query of the block may attend any key (by position).
    """

    start: int
    stop: int
    tiles: tuple[KeyTile, ...]


def _balanced(n: int, most: int) -> int:
    """Block length ``<= most`` (when ``most >= BLOCK_ALIGN``) that splits ``n`` evenly."""
    if n <= most:
        return n
    count = -(-n // most)
    size = -(-n // count)
    aligned = -(-size // BLOCK_ALIGN) * BLOCK_ALIGN
    return aligned if aligned <= most else size


def choose_block_sizes(
    p: Problem, block_q: int | None = None, block_k: int | None = None
) -> tuple[int, int]:
    """Block sizes for ``p``: the overrides where given, else sized to :data:`TILE_BYTES`.

    The key block is as long as possible (up to :data:`MAX_BLOCK_K`) and the query block
    fills the rest of the tile budget; both are balanced so that the last block is not a
    sliver (``S = 1028`` gives two key blocks of 528, not 1024 and 4).

    Parameters
    ----------
    p : Problem
        The validated call (lengths and compute dtype).
    block_q, block_k : int, optional
        Explicit sizes (positive); ``None`` chooses automatically.

    Returns
    -------
    (int, int)
        ``(block_q, block_k)``, each at least 1 and at most ``L`` and ``S`` (when those are
        positive).
    """
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    itemsize = p.xp.finfo(p.compute_dtype).bits // 8
    budget = max(TILE_BYTES // itemsize, BLOCK_ALIGN * BLOCK_ALIGN)
    S, L = max(p.S, 1), max(p.L, 1)
    if block_k is None:
        block_k = _balanced(S, min(MAX_BLOCK_K, budget // BLOCK_ALIGN))
    if block_q is None:
        block_q = _balanced(L, max(BLOCK_ALIGN, budget // block_k))
    return min(block_q, L), min(block_k, S)


def _chunks(positions: Positions, q0: int, q1: int, lo: int, hi: int, size: int) -> list[KeyTile]:
    return [
        KeyTile(k0, min(k0 + size, hi), positions.tile_is_full(q0, q1, k0, min(k0 + size, hi)))
        for k0 in range(lo, hi, size)
    ]


def plan_blocks(positions: Positions, block_q: int, block_k: int) -> list[QueryBlock]:
    """The query blocks of a call and, for each, the key tiles it must visit.

    Keys outside :meth:`Positions.key_range` of a query block are skipped. The reachable
    range is cut into the keys that every query of the block may attend (found as the
    intersection of the first and last query's ranges, since both ends of a query's range
    grow with the query index) and the partial bands on either side; each part is split
    into tiles of at most ``block_k`` keys.

    Parameters
    ----------
    positions : Positions
        The call's causal/window restrictions (and ``L``, ``S``).
    block_q, block_k : int
        Positive block sizes.

    Returns
    -------
    list of QueryBlock
        Covering queries ``[0, L)`` in order; together their tiles cover every admissible
        (query, key) pair exactly once.
    """
    blocks = []
    for q0 in range(0, positions.L, block_q):
        q1 = min(q0 + block_q, positions.L)
        lo, hi = positions.key_range(q0, q1)
        if lo >= hi:
            blocks.append(QueryBlock(q0, q1, ()))
            continue
        full_lo = min(max(positions.key_range(q1 - 1, q1)[0], lo), hi)
        full_hi = max(min(positions.key_range(q0, q0 + 1)[1], hi), full_lo)
        if full_lo >= full_hi:
            tiles = _chunks(positions, q0, q1, lo, hi, block_k)
        else:
            tiles = [
                *_chunks(positions, q0, q1, lo, full_lo, block_k),
                *_chunks(positions, q0, q1, full_lo, full_hi, block_k),
                *_chunks(positions, q0, q1, full_hi, hi, block_k),
            ]
        blocks.append(QueryBlock(q0, q1, tuple(tiles)))
    return blocks


@dataclass(frozen=True)
class _Operands:
    """Prepared operands, all with ``len(batch) + 2`` dimensions."""

    q: Any
    k: Any
    v: Any
    mask: Any
    bias: Any
    batch: tuple[int, ...]


def _pad(p: Problem, x: Any, ndim: int) -> Any:
    if x is None or x.ndim == ndim:
        return x
    return p.xp.reshape(x, (1,) * (ndim - x.ndim) + tuple(x.shape))


def _at(x: Any, index: tuple[int, ...]) -> Any:
    """``x`` at the outer batch ``index`` (broadcast axes of size 1 stay at 0)."""
    if x is None or not index:
        return x
    at = tuple(i if n != 1 else 0 for i, n in zip(index, x.shape, strict=False))
    key = (*at, Ellipsis)
    return x[key]


def _split_batch(batch: tuple[int, ...], per_item: int) -> int:
    """Smallest number of leading batch axes to loop over so that the rest fits a tile."""
    for split in range(len(batch) + 1):
        if math.prod(batch[split:]) <= per_item:
            return split
    return len(batch)


def _query_block(
    p: Problem, ops: _Operands, index: tuple[int, ...], block: QueryBlock
) -> tuple[Any, Any]:
    """Output ``(..., rows, Ev)`` and log-sum-exp ``(..., rows)`` of one query block."""
    xp = p.xp
    rows = slice(block.start, block.stop)
    inner = ops.batch[len(index) :]
    if not block.tiles:
        n = block.stop - block.start
        out = xp.zeros((*inner, n, p.Ev), dtype=p.compute_dtype, device=p.device)
        lse = xp.full((*inner, n), -math.inf, dtype=p.compute_dtype, device=p.device)
        return out, lse
    q = _at(ops.q, index)[..., rows, :]
    k, v = _at(ops.k, index), _at(ops.v, index)
    mask, bias = _at(ops.mask, index), _at(ops.bias, index)
    running_max = total = acc = ref = None
    for tile in block.tiles:
        cols = slice(tile.start, tile.stop)
        s = tile_scores(p, q, k[..., cols, :], mask, bias, rows, cols)
        tile_max = xp.max(s, axis=-1, keepdims=True)
        new_max = tile_max if running_max is None else xp.maximum(running_max, tile_max)
        new_ref = exp_shift(p, new_max)
        s -= new_ref  # in place where the library allows; rebinds otherwise
        e = xp.exp(s)
        del s
        tile_total = xp.sum(e, axis=-1, keepdims=True)
        tile_out = xp.matmul(e, v[..., cols, :])
        del e
        if running_max is None:
            total, acc = tile_total, tile_out
        else:
            alpha = xp.exp(running_max - new_ref)  # 0 while the row had no admissible key
            total = total * alpha + tile_total
            acc = acc * alpha + tile_out
        running_max, ref = new_max, new_ref
    out = acc * safe_reciprocal(p, total)
    lse = log_sum_exp(p, ref, total)
    if tuple(out.shape[:-2]) != inner:  # every operand broadcast along an inner axis
        out = xp.broadcast_to(out, (*inner, *out.shape[-2:]))
        lse = xp.broadcast_to(lse, (*inner, lse.shape[-1]))
    return out, lse


def blocked_attention(
    p: Problem,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    *,
    return_weights: bool,
    return_lse: bool,
    block_q: int | None = None,
    block_k: int | None = None,
) -> AttentionResult:
    """Attention with an online softmax over key blocks; memory ``O(block_q * block_k)``.

    Parameters
    ----------
    p : Problem
        The validated call.
    query, key, value, mask, bias : array or None
        The caller's arrays.
    return_weights : bool
        The weights are an ``(L, S)`` matrix per batch element, so asking for them defeats
        the purpose of blocking: this falls back to the materialized implementation.
    return_lse : bool
        The log-sum-exp is a by-product and always computed.
    block_q, block_k : int, optional
        Block sizes; see :func:`choose_block_sizes`.

    Returns
    -------
    AttentionResult
        Output and log-sum-exp (weights only through the materialized fallback).
    """
    bq, bk = choose_block_sizes(p, block_q, block_k)
    if return_weights:
        from ._materialized import materialized_attention

        return materialized_attention(
            p, query, key, value, mask, bias, return_weights=True, return_lse=return_lse
        )
    xp = p.xp
    q, k, v = prepare_operands(p, query, key, value)
    mask, bias = prepare_score_terms(p, mask, bias)
    batch = (*p.batch_shape[:-1], p.heads_kv, p.groups) if p.grouped else p.batch_shape
    ndim = len(batch) + 2
    ops = _Operands(
        q=_pad(p, q, ndim),
        k=_pad(p, k, ndim),
        v=_pad(p, v, ndim),
        mask=_pad(p, mask, ndim),
        bias=_pad(p, bias, ndim),
        batch=batch,
    )

    itemsize = xp.finfo(p.compute_dtype).bits // 8
    per_item = max(1, TILE_BYTES // itemsize // (bq * bk))
    split = _split_batch(batch, per_item)
    outer = list(itertools.product(*(range(n) for n in batch[:split])))
    blocks = plan_blocks(p.positions, bq, bk)
    items = [(index, block) for index in outer for block in blocks]
    results = map_blocks(xp, lambda item: _query_block(p, ops, *item), items)

    outs: list[Any] = []
    lses: list[Any] = []
    for i in range(len(outer)):
        mine: Sequence[tuple[Any, Any]] = results[i * len(blocks) : (i + 1) * len(blocks)]
        outs.append(_concat(xp, [r[0] for r in mine], axis=-2))
        lses.append(_concat(xp, [r[1] for r in mine], axis=-1))
    out = xp.reshape(xp.stack(outs), (*batch, p.L, p.Ev)) if split else outs[0]
    lse = xp.reshape(xp.stack(lses), (*batch, p.L)) if split else lses[0]
    return AttentionResult(
        out=ungroup(p, out),
        lse=ungroup(p, lse[..., None])[..., 0] if return_lse else None,
    )


def _concat(xp: Any, parts: list[Any], axis: int) -> Any:
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=axis)
