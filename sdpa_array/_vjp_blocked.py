"""The blocked VJP: FlashAttention-2's backward pass on the Array API, in ``O(block)`` memory.

Organisation
------------
Queries are cut into blocks of ``block_q`` rows and keys into a fixed *grid* of key blocks.
The batch is split into slices exactly as the blocked forward splits it
(:mod:`sdpa_array._blocked`), so that one score tile stays near
:data:`~sdpa_array._blocked.TILE_BYTES`. A query block visits the grid blocks that
:meth:`Positions.key_range` lets its queries reach (the others are skipped: causal attention
does about half the work), in tiles of whole grid blocks, at most about ``block_k`` keys
wide, and each tile gives

* rows of ``dQ``, summed over the block's tiles;
* one piece of ``dK`` and ``dV`` per grid block, summed over the tile's rows (and over the
  query heads of each GQA group, inside the matrix product);
* pieces of ``dBias``, each already summed down to the bias's own shape.

A work item is some query blocks of one batch slice; it sums its pieces grid block by grid
block, and the caller adds the items' sums. Nothing ever holds a score matrix: memory is
one tile per running item plus the gradients and one partial sum of ``dK``/``dV`` per item.
Items are independent, so :func:`sdpa_array._parallel.map_blocks` runs them concurrently
for NumPy; there are at least :data:`ITEMS_PER_THREAD` per thread, a slice's query blocks dealt
round-robin so that causal items get similar work.

Where the probabilities come from
---------------------------------
* When each query block reaches few enough keys for one tile (always with the default
  sizes when ``S <= MAX_BLOCK_K``), the tile holds whole rows: its own softmax is ``P`` and
  ``D = rowsum(P * dP)``. No forward pass is needed; a tile costs five matrix products.
* Otherwise ``P = exp(Z - lse)`` with the log-sum-exp of the blocked forward pass, and
  ``D = rowsum(dO * O)`` with its output: FlashAttention-2's recomputation. Under autograd
  the forward's output and log-sum-exp are saved, and they are always used.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._blocked import (
    BLOCK_ALIGN,
    TILE_BYTES,
    _at,
    _balanced,
    _pad,
    _split_batch,
    blocked_attention,
    choose_block_sizes,
)
from ._parallel import get_num_threads, map_blocks
from ._problem import Problem
from ._scores import tile_of
from ._vjp_tiles import (
    RawGrads,
    prepare_backward,
    prepare_grad_lse,
    prepare_saved,
    row_delta,
    sum_to_shape,
    tile_gradients,
)

__all__ = ["GRID_RESTRICTED", "BackwardBlock", "BackwardPlan", "blocked_vjp", "plan_backward"]

#: Key grid block when causal or window restrictions let query blocks reach different keys:
#: a query block's tile starts and ends on this grid, so at most one grid block's worth of
#: excluded keys is computed on each side of the admissible band.
GRID_RESTRICTED = 256

#: Fewest query rows in a tile that holds whole rows: a row of up to ``TILE_BYTES /
#: (itemsize * MIN_ROWS)`` keys (4096 in float32) fits one tile, so the backward pass needs
#: no forward pass; longer rows are cut into the forward's key blocks. Fewer rows would make
#: the products' inner dimension (``dK = dSᵀ Q`` sums over the rows) too short to be fast.
MIN_ROWS = 64

#: Work items per thread (when the batch has fewer slices): enough for load balance, few
#: enough that their partial sums of ``dK`` and ``dV`` stay few.
ITEMS_PER_THREAD = 2


@dataclass(frozen=True)
class BackwardBlock:
    """Queries ``[start, stop)`` and the key tiles ``[(start, stop), ...]`` they visit.

    Every tile is a run of whole grid blocks (the last one possibly cut at ``S``); an empty
    ``tiles`` means no query of the block may attend any key, by position.
    """

    start: int
    stop: int
    tiles: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BackwardPlan:
    """Block sizes and query blocks of one blocked backward pass.

    Attributes
    ----------
    block_q : int
        Query block length.
    grid : int
        Key grid block length: the unit in which ``dK``, ``dV`` and ``dBias`` are summed.
    width : int
        Longest key tile (a multiple of ``grid``).
    blocks : tuple of BackwardBlock
        The query blocks, in order, covering ``[0, L)``.
    """

    block_q: int
    grid: int
    width: int
    blocks: tuple[BackwardBlock, ...]

    @property
    def rows_fit_one_tile(self) -> bool:
        """Whether each query block's keys fit one tile, so no log-sum-exp is needed."""
        return all(len(b.tiles) <= 1 for b in self.blocks)


def plan_backward(
    p: Problem, block_q: int | None = None, block_k: int | None = None
) -> BackwardPlan:
    """Plan the blocked backward pass of ``p`` (``L``, ``S`` > 0).

    Tiles hold about :data:`~sdpa_array._blocked.TILE_BYTES` of scores per batch element,
    like the blocked forward's. By default a tile holds whole rows (all ``S`` keys, and as
    many query rows as fit) when at least :data:`MIN_ROWS` rows fit; otherwise, or when
    ``block_k`` is given, the blocks are the forward's
    (:func:`sdpa_array._blocked.choose_block_sizes`). The key grid is the key block, or
    :data:`GRID_RESTRICTED` when positional restrictions make query blocks reach different
    keys and ``block_k`` is not given; tiles are then runs of grid blocks at most ``block_k``
    (rounded up to the grid) wide.
    """
    bq, bk = choose_block_sizes(p, block_q, block_k)  # also validates the overrides
    budget = TILE_BYTES // (p.xp.finfo(p.compute_dtype).bits // 8)
    if block_k is None and budget >= p.S * MIN_ROWS:
        bk = p.S
        bq = block_q or _balanced(p.L, max(BLOCK_ALIGN, budget // p.S))
        bq = min(bq, p.L)
    pos = p.positions
    grid = bk if block_k is not None or not pos.restricts else min(bk, GRID_RESTRICTED)
    width = -(-bk // grid) * grid
    blocks = []
    for q0 in range(0, p.L, bq):
        q1 = min(q0 + bq, p.L)
        lo, hi = pos.key_range(q0, q1)
        tiles: tuple[tuple[int, int], ...] = ()
        if lo < hi:
            c0 = lo // grid * grid
            c1 = min(p.S, -(-hi // grid) * grid)
            tiles = tuple((a, min(a + width, c1)) for a in range(c0, c1, width))
        blocks.append(BackwardBlock(q0, q1, tiles))
    return BackwardPlan(bq, grid, width, tuple(blocks))


@dataclass(frozen=True)
class _Inputs:
    """Prepared operands padded to ``len(batch) + 2`` axes (GQA: the grouped layout)."""

    q: Any
    k: Any
    v: Any
    mask: Any
    bias: Any
    d_out: Any
    out: Any
    lse: Any
    grad_lse: Any


@dataclass
class _ItemGrads:
    """What one item returns, summed over its query blocks (see the module docstring).

    ``dq`` maps a query block's start to its rows of ``dQ``; ``kv`` maps a grid block's
    start to its ``(dK, dV)`` pieces; ``bias`` maps ``(row key, column key)`` (``None`` along
    a broadcast axis) to a piece of ``dBias``.
    """

    dq: dict[int, Any]
    kv: dict[int, tuple[Any, Any]]
    bias: dict[tuple[int | None, int | None], Any]


def _reduce_kv(p: Problem, x: Any, like: Any, width: int) -> Any:
    """Sum a tile's ``dK``/``dV`` down to the item's key/value shape (width ``width``)."""
    lead = like.shape[:-3] if p.grouped else like.shape[:-2]
    return sum_to_shape(p, x, (*lead, width, x.shape[-1]))


def _item(
    p: Problem,
    plan: BackwardPlan,
    ins: _Inputs,
    index: tuple[int, ...],
    blocks: tuple[BackwardBlock, ...],
) -> _ItemGrads:
    """Gradient contributions of some query blocks of one batch slice."""
    k, v = _at(ins.k, index), _at(ins.v, index)
    mask, bias = _at(ins.mask, index), _at(ins.bias, index)
    grads = _ItemGrads(dq={}, kv={}, bias={})
    for block in blocks:
        if block.tiles:
            _query_block(p, plan, ins, index, block, k, v, mask, bias, grads)
    return grads


def _query_block(
    p: Problem,
    plan: BackwardPlan,
    ins: _Inputs,
    index: tuple[int, ...],
    block: BackwardBlock,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    grads: _ItemGrads,
) -> None:
    """Add the contributions of one query block's tiles to ``grads``."""
    rows = slice(block.start, block.stop)
    q = _at(ins.q, index)[..., rows, :]
    d_out = _at(ins.d_out, index)[..., rows, :]
    g_lse = None if ins.grad_lse is None else _at(ins.grad_lse, index)[..., rows, :]
    lse = delta = None
    if ins.lse is not None:
        lse = _at(ins.lse, index)[..., rows, :]
        delta = row_delta(p, d_out, _at(ins.out, index)[..., rows, :], g_lse)
    for a, b in block.tiles:
        cols = slice(a, b)
        t = tile_gradients(
            p,
            q,
            k,
            v,
            mask,
            bias,
            d_out,
            rows,
            cols,
            lse_rows=lse,
            delta_rows=delta,
            grad_lse_rows=g_lse,
            need_dz=bias is not None,
        )
        _add(grads.dq, block.start, t.dq)
        dk, dv = _reduce_kv(p, t.dk, k, b - a), _reduce_kv(p, t.dv, v, b - a)
        for c in range(a, b, plan.grid):
            piece = slice(c - a, min(c + plan.grid, b) - a)
            _add(grads.kv, c, (dk[..., piece, :], dv[..., piece, :]))
        if t.dz is not None:
            dz = sum_to_shape(p, t.dz, tuple(tile_of(bias, rows, cols).shape))
            row_key = block.start if bias.shape[-2] != 1 else None
            if bias.shape[-1] == 1:
                _add(grads.bias, (row_key, None), dz)
            else:
                for c in range(a, b, plan.grid):
                    piece = slice(c - a, min(c + plan.grid, b) - a)
                    _add(grads.bias, (row_key, c), dz[..., piece])


def _add(acc: dict[Any, Any], key: Any, x: Any) -> None:
    """``acc[key] += x`` for arrays or tuples of arrays, without touching ``x`` in place."""
    if key not in acc:
        acc[key] = x
    elif isinstance(x, tuple):
        acc[key] = tuple(a + b for a, b in zip(acc[key], x, strict=True))
    else:
        acc[key] = acc[key] + x


def _index_in(x: Any, index: tuple[int, ...]) -> tuple[int, ...]:
    """The batch ``index`` as seen by ``x``, whose size-1 axes broadcast."""
    return tuple(i if n != 1 else 0 for i, n in zip(index, x.shape, strict=False))


def _indices(shape: Iterable[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in shape)))


def _stack(p: Problem, parts: list[Any], outer: tuple[int, ...]) -> Any:
    """Stack per-index arrays and give them the ``outer`` batch axes."""
    if not outer:
        return parts[0]
    stacked = p.xp.stack(parts)
    return p.xp.reshape(stacked, (*outer, *stacked.shape[1:]))


def _concat(p: Problem, parts: list[Any], axis: int) -> Any:
    return parts[0] if len(parts) == 1 else p.xp.concat(parts, axis=axis)


@dataclass(frozen=True)
class _Assembly:
    """Puts the summed pieces back together; a missing piece (skipped tile) is zeros."""

    p: Problem
    plan: BackwardPlan
    split: int

    def concat(self, parts: list[Any], shapes: list[tuple[int, ...]], axis: int) -> Any:
        xp, p = self.p.xp, self.p
        filled = [
            x if x is not None else xp.zeros(s, dtype=p.compute_dtype, device=p.device)
            for x, s in zip(parts, shapes, strict=True)
        ]
        return _concat(p, filled, axis)

    def stack(self, parts: list[Any], outer: tuple[int, ...]) -> Any:
        return _stack(self.p, parts, outer)

    def _grid(self) -> list[tuple[int, int]]:
        g, S = self.plan.grid, self.p.S
        return [(c, min(c + g, S) - c) for c in range(0, S, g)]

    def key_value(self, acc: dict[Any, Any], like: Any, features: int) -> Any:
        """``dK`` or ``dV`` in ``like``'s padded shape (GQA: without the group axis)."""
        outer = tuple(like.shape[: self.split])
        item = _at(like, _indices(outer)[0])
        lead = tuple(item.shape[:-3] if self.p.grouped else item.shape[:-2])
        grid = self._grid()
        return self.stack(
            [
                self.concat(
                    [acc.get((index, c)) for c, _ in grid],
                    [(*lead, n, features) for _, n in grid],
                    axis=-2,
                )
                for index in _indices(outer)
            ],
            outer,
        )

    def bias(self, acc: dict[Any, Any], like: Any) -> Any:
        """``dBias`` in the padded prepared bias's shape (broadcast axes kept at 1)."""
        outer = tuple(like.shape[: self.split])
        item = _at(like, _indices(outer)[0])
        lead = tuple(item.shape[:-2])
        rows: list[tuple[int | None, int]] = [(None, 1)]
        if item.shape[-2] != 1:
            rows = [(b.start, b.stop - b.start) for b in self.plan.blocks]
        cols: list[tuple[int | None, int]] = [(None, 1)]
        if item.shape[-1] != 1:
            cols = list(self._grid())
        width = sum(n for _, n in cols)

        def bias_rows(index: tuple[int, ...], r: int | None, n_rows: int) -> Any:
            shapes = [(*lead, n_rows, n) for _, n in cols]
            return self.concat([acc.get((index, r, c)) for c, _ in cols], shapes, axis=-1)

        return self.stack(
            [
                self.concat(
                    [bias_rows(index, r, n_rows) for r, n_rows in rows],
                    [(*lead, n_rows, width) for _, n_rows in rows],
                    axis=-2,
                )
                for index in _indices(outer)
            ],
            outer,
        )


def blocked_vjp(
    p: Problem,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    grad_output: Any,
    *,
    out: Any | None = None,
    lse: Any | None = None,
    grad_lse: Any | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> RawGrads:
    """Gradients tile by tile; memory ``O(block_q * block_k)`` per batch element in flight.

    Parameters
    ----------
    p : Problem
        The validated call (``L``, ``S`` > 0).
    query, key, value, mask, bias, grad_output : array or None
        The caller's arrays; ``grad_output`` has the output's shape.
    out, lse : array, optional
        The forward pass's output and log-sum-exp (both or neither). Without them, a plan
        whose query blocks need several tiles runs the blocked forward pass first.
    grad_lse : array, optional
        Cotangent of the log-sum-exp ``(..., Hq, L)``.
    block_q, block_k : int, optional
        Block sizes (see :func:`plan_backward`).
    """
    xp = p.xp
    plan = plan_backward(p, block_q, block_k)
    ops = prepare_backward(p, query, key, value, mask, bias, grad_output)
    if out is None and not plan.rows_fit_one_tile:
        forward = blocked_attention(
            p,
            query,
            key,
            value,
            mask,
            bias,
            return_weights=False,
            return_lse=True,
            block_q=block_q,
            block_k=block_k,
        )
        out, lse = forward.out, forward.lse
    saved = None if out is None else prepare_saved(p, out, lse)
    batch = (*p.batch_shape[:-1], p.heads_kv, p.groups) if p.grouped else p.batch_shape
    ndim = len(batch) + 2
    ins = _Inputs(
        *(
            _pad(p, x, ndim)
            for x in (
                ops.q,
                ops.k,
                ops.v,
                ops.mask,
                ops.bias,
                ops.d_out,
                None if saved is None else saved.out,
                None if saved is None else saved.lse,
                prepare_grad_lse(p, grad_lse),
            )
        )
    )

    itemsize = xp.finfo(p.compute_dtype).bits // 8
    per_item = max(1, TILE_BYTES // itemsize // (plan.block_q * plan.width))
    split = _split_batch(batch, per_item)
    if p.grouped:  # keep the group axis inside an item: dK sums over it in one product
        split = min(split, len(batch) - 1)
    outer = batch[:split]
    slices = _indices(outer)
    # Enough items to keep every thread busy, few enough that their partial sums of dK and
    # dV (one key/value slice each) stay few; a slice's query blocks are dealt round-robin
    # so that causal items get similar work.
    per_slice = max(
        1, min(len(plan.blocks), -(-ITEMS_PER_THREAD * get_num_threads() // len(slices)))
    )
    items = [(index, plan.blocks[c::per_slice]) for index in slices for c in range(per_slice)]
    results = map_blocks(xp, lambda item: _item(p, plan, ins, *item), items)

    dq_parts: dict[tuple[tuple[int, ...], int], Any] = {}
    dk_acc: dict[tuple[tuple[int, ...], int], Any] = {}
    dv_acc: dict[tuple[tuple[int, ...], int], Any] = {}
    bias_acc: dict[tuple[tuple[int, ...], int | None, int | None], Any] = {}
    for (index, _), r in zip(items, results, strict=True):
        for start, dq_rows in r.dq.items():
            dq_parts[index, start] = dq_rows
        k_index, v_index = _index_in(ins.k, index), _index_in(ins.v, index)
        for c, (dk, dv) in r.kv.items():
            _add(dk_acc, (k_index, c), dk)
            _add(dv_acc, (v_index, c), dv)
        b_index = _index_in(ins.bias, index) if ins.bias is not None else ()
        for (row_key, col_key), dz in r.bias.items():
            _add(bias_acc, (b_index, row_key, col_key), dz)
    del results

    asm = _Assembly(p, plan, split)
    inner = batch[split:]
    dq = asm.stack(
        [
            asm.concat(
                [dq_parts.get((index, blk.start)) for blk in plan.blocks],
                [(*inner, blk.stop - blk.start, p.E) for blk in plan.blocks],
                axis=-2,
            )
            for index in _indices(outer)
        ],
        outer,
    )
    dk = asm.key_value(dk_acc, ins.k, p.E)
    dv = asm.key_value(dv_acc, ins.v, p.Ev)
    dbias = None if ins.bias is None else asm.bias(bias_acc, ins.bias)
    return RawGrads(dq=dq, dk=dk, dv=dv, dbias=dbias)
