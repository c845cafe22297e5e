"""The blocked backward kernel: FlashAttention-2's backward pass in ``O(block)`` memory.

Organisation
------------
Queries are cut into blocks of ``block_q`` rows and keys into a fixed *grid* of key blocks
(:func:`~sdpa_array._kernels.tiling.plan_backward`). The batch is split into slices exactly
as the blocked forward splits it, so that one score tile stays near ``TILE_BYTES``. A query
block visits the grid blocks its queries can reach (the restrictions skip the rest: causal
attention does about half the work), in tiles of whole grid blocks, and each tile gives

* rows of ``dQ``, summed over the block's tiles;
* rows of ``dK`` and ``dV`` for the tile's keys, summed over the tile's rows (and over the
  query heads of each GQA group, inside the matrix product) and added into the item's
  gradients of all the keys;
* pieces of ``dBias``, each already summed down to the bias's own shape.

A work item is some query blocks of one batch slice (:func:`_deal`); it sums its pieces
(:func:`_item`; ``dBias``'s grid block by grid block), the caller adds the items' sums
(:func:`_sum_items`) and puts the gradients together (:class:`_Assembly`), with zeros for
skipped tiles. Nothing ever holds a score matrix. Items are independent, so
:func:`~sdpa_array._arrays.parallel.map_blocks` runs them concurrently for NumPy.

Where the probabilities come from
---------------------------------
* When each query block reaches few enough keys for one tile, the tile holds whole rows: its
  own softmax is ``P`` and ``D = rowsum(P * dP)``. No forward pass is needed; a tile costs
  five matrix products.
* Otherwise ``P = exp(Z - lse)`` with the log-sum-exp of the blocked forward pass, and
  ``D = rowsum(dO * O)`` with its output: FlashAttention-2's recomputation. Under autograd
  the forward's output and log-sum-exp are saved, and they are always used. A sink is in
  each tile's softmax denominator, and its gradient comes from the tiles holding whole rows
  or from the saved log-sum-exp (which includes it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._arrays import inplace
from .._arrays.parallel import get_num_threads, map_blocks
from .._arrays.slicing import tile_of
from .._arrays.typing import Array
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .blocked import blocked_attention
from .gradients import BackwardOperands, prepare_backward, sink_gradient, tile_gradients
from .key_rows import KeyRows, covering
from .layout import concat, sum_to_shape
from .operands import prepare
from .restrictions import TileKind
from .result import RawGrads
from .score_bound import chunks_from_bound, fixed_reference
from .tiling import (
    BackwardBlock,
    BackwardPlan,
    batch_slices,
    plan_backward,
    plans_for_gpu,
    tile_bytes,
)

__all__ = ["ITEMS_PER_THREAD", "blocked_vjp"]

#: Work items per thread (when the batch has fewer slices): enough for load balance, few
#: enough that their partial sums of ``dK`` and ``dV`` stay few.
ITEMS_PER_THREAD = 2

Index = tuple[int, ...]


class _Acc(dict[Any, Array]):
    """Sums by key, and the keys whose sum is an array made here (:func:`_add`)."""

    def __init__(self) -> None:
        super().__init__()
        self.owned: set[Any] = set()


@dataclass
class _Sums:
    """Gradient pieces summed so far, by key.

    ``dq`` maps ``(index, block start)`` to rows of ``dQ``; ``dk`` and ``dv`` hold an
    item's rows of the keys' gradients by key range (:class:`~.key_rows.KeyRows`), and
    ``key_grads`` the items' sums of both, ``index -> (dK rows, dV rows)``; ``bias`` maps
    ``(index, row key, column key)`` (``None`` along a broadcast axis) to a piece of
    ``dBias``. Each ``index`` is the batch index as the gradient's own array sees it (its
    size-1 axes broadcast). ``tables`` maps the position of each of the mods' parameters
    to its gradient so far.
    """

    dq: _Acc = field(default_factory=_Acc)
    dk: KeyRows = field(default_factory=KeyRows)
    dv: KeyRows = field(default_factory=KeyRows)
    key_grads: dict[Index, tuple[KeyRows, KeyRows]] = field(default_factory=dict)
    bias: _Acc = field(default_factory=_Acc)
    sink: _Acc = field(default_factory=_Acc)
    tables: _Acc = field(default_factory=_Acc)


def _add(acc: _Acc, key: Any, x: Array) -> None:
    """``acc[key] += x``, without touching ``x`` in place: the first contribution is kept
    as it is, the second makes the sum a new array, and later ones add into that array in
    place where the library allows (:func:`~sdpa_array._arrays.inplace.add`)."""
    if key not in acc:
        acc[key] = x
    elif key in acc.owned:
        acc[key] = inplace.add(acc[key], x)
    else:
        acc[key] = acc[key] + x
        acc.owned.add(key)


def _grid_pieces(plan: BackwardPlan, a: int, b: int) -> list[tuple[int, slice]]:
    """The grid blocks ``c`` of the tile ``[a, b)`` and their slices within it."""
    return [(c, slice(c - a, min(c + plan.grid, b) - a)) for c in range(a, b, plan.grid)]


def _query_block(
    p: Problem,
    plan: BackwardPlan,
    b: BackwardOperands,
    block: BackwardBlock,
    sums: _Sums,
    fixed: bool,
) -> None:
    """Add the contributions of one query block's tiles to ``sums`` (index ``()``);
    ``fixed``: tiles holding whole rows take a softmax reference of 0."""
    xp, ops = p.xp, b.ops
    rows = slice(block.start, block.stop)
    r = b.rows(p, rows)
    bias = ops.terms.bias
    lead_k = ops.k.shape[:-3] if p.grouped else ops.k.shape[:-2]
    lead_v = ops.v.shape[:-3] if p.grouped else ops.v.shape[:-2]
    per_sequence = ops.restrictions.per_sequence
    for a, z in block.tiles:
        cols = slice(a, z)
        if per_sequence and ops.restrictions.classify(rows, cols) is TileKind.EMPTY:
            continue  # this sequence's lengths or segments exclude the tile
        t = tile_gradients(p, ops, r, rows, cols, need_dz=bias is not None, fixed=fixed)
        _add(sums.dq, block.start, t.dq)
        for i, g in enumerate(t.dtables or ()):
            _add(sums.tables, i, g)
        if t.dsink is not None:
            _add(sums.sink, None, sum_to_shape(xp, t.dsink, tuple(ops.terms.sink.shape)))
        dk = sum_to_shape(xp, t.dk, (*lead_k, z - a, p.E))
        dv = sum_to_shape(xp, t.dv, (*lead_v, z - a, p.Ev))
        sums.dk.add(xp, dk, a, z, p.S)
        sums.dv.add(xp, dv, a, z, p.S)
        if t.dz is not None:
            dz = sum_to_shape(xp, t.dz, tuple(tile_of(bias, rows, cols).shape))
            row_key = block.start if bias.shape[-2] != 1 else None
            if bias.shape[-1] == 1:
                _add(sums.bias, (row_key, None), dz)
            else:
                for c, piece in _grid_pieces(plan, a, z):
                    _add(sums.bias, (row_key, c), dz[..., piece])


def _item(
    p: Problem,
    plan: BackwardPlan,
    b: BackwardOperands,
    blocks: tuple[BackwardBlock, ...],
    fixed: bool,
    dq: Any = None,
) -> _Sums:
    """Gradient contributions of some query blocks of one batch slice ``b``; ``dq``: where
    given, ``dq(block, rows)`` takes each block's rows of ``dQ`` (``None``: zeros) instead
    of the sums."""
    sums = _Sums()
    for block in blocks:
        if block.tiles:
            _query_block(p, plan, b, block, sums, fixed)
        if dq is not None:
            dq(block, sums.dq.pop(block.start, None))
    return sums


def _deal(plan: BackwardPlan, slices: list[Index]) -> list[tuple[Index, tuple[BackwardBlock, ...]]]:
    """Work items: each batch slice's query blocks dealt round-robin into a few items.

    Enough items to keep every thread busy, few enough that their partial sums of ``dK``
    and ``dV`` stay few; round-robin gives causal items similar work.
    """
    per_slice = max(
        1, min(len(plan.blocks), -(-ITEMS_PER_THREAD * get_num_threads() // len(slices)))
    )
    return [(index, plan.blocks[c::per_slice]) for index in slices for c in range(per_slice)]


def _index_in(x: Array, index: Index) -> Index:
    """The batch ``index`` as seen by ``x``, whose size-1 axes broadcast."""
    return tuple(i if n != 1 else 0 for i, n in zip(index, x.shape, strict=False))


def _sum_items(
    p: Problem, b: BackwardOperands, items: list[tuple[Index, Any]], results: list[_Sums]
) -> _Sums:
    """Add the items' sums, keyed by the batch index each gradient's array sees."""
    total = _Sums()
    ops = b.ops
    for (index, _), r in zip(items, results, strict=True):
        for start, dq in r.dq.items():
            total.dq[index, start] = dq
        k_index, v_index = _index_in(ops.k, index), _index_in(ops.v, index)
        total.key_grads.setdefault(k_index, (KeyRows(), KeyRows()))[0].merge(p.xp, r.dk, p.S)
        total.key_grads.setdefault(v_index, (KeyRows(), KeyRows()))[1].merge(p.xp, r.dv, p.S)
        b_index = _index_in(ops.terms.bias, index) if ops.terms.bias is not None else ()
        for (row_key, col_key), dz in r.bias.items():
            _add(total.bias, (b_index, row_key, col_key), dz)
        for ds in r.sink.values():
            _add(total.sink, _index_in(ops.terms.sink, index), ds)
        for i, g in r.tables.items():
            _add(total.tables, i, g)
    return total


def _indices(shape: Iterable[int]) -> list[Index]:
    return list(itertools.product(*(range(n) for n in shape)))


@dataclass(frozen=True)
class _Assembly:
    """Puts the summed pieces back together; a missing piece (skipped tile) is zeros."""

    p: Problem
    plan: BackwardPlan
    split: int

    def concat(self, parts: list[Array], shapes: list[tuple[int, ...]], axis: int) -> Array:
        p = self.p
        filled = [
            x if x is not None else p.xp.zeros(s, dtype=p.compute_dtype, device=p.device)
            for x, s in zip(parts, shapes, strict=True)
        ]
        return concat(p.xp, filled, axis)

    def stack(self, like: Array, build: Any) -> Array:
        """``build(index, item_shape)`` for each outer index of ``like``, stacked."""
        xp = self.p.xp
        outer = tuple(like.shape[: self.split])
        item_shape = tuple(like.shape[self.split :])
        parts = [build(index, item_shape) for index in _indices(outer)]
        if not outer:
            return parts[0]
        stacked = xp.stack(parts)
        return xp.reshape(stacked, (*outer, *stacked.shape[1:]))

    def _grid(self) -> list[tuple[int, int]]:
        g, S = self.plan.grid, self.p.S
        return [(c, min(c + g, S) - c) for c in range(0, S, g)]

    def rows_into(
        self, like: Array, pieces: Any, acc: dict[Any, Array], features: int, lead: int
    ) -> Array | None:
        """The pieces ``(key, start, stop)`` of each outer index (``pieces(index)``) of
        ``acc`` written along the rows of one new array ``(*like.shape[:lead], rows,
        features)`` (``lead``: -3 drops a grouped key array's group axis; ``features`` the
        gradient's last axis; missing pieces are zeros), or ``None`` where the library does
        not allow it (:func:`~sdpa_array._arrays.inplace.fillable`)."""
        p, xp = self.p, self.p.xp
        shape = (*tuple(like.shape)[:lead], int(like.shape[-2]), features)
        out = inplace.fillable(xp, shape, p.compute_dtype, p.device, like, *acc.values())
        if out is None:
            return None
        for index in _indices(tuple(like.shape[: self.split])):
            for key, start, stop in pieces(index):
                at = (*index, Ellipsis, slice(start, stop), slice(None))
                piece = acc.get(key)
                out[at] = 0.0 if piece is None else piece
        return out

    def query_target(self, b: BackwardOperands) -> Array | None:
        """A new ``dQ`` in the padded query layout that the items fill block by block
        (:meth:`put_query`), or ``None`` where the library does not allow it
        (:func:`~sdpa_array._arrays.inplace.fillable`; the sums are then put together by
        :meth:`query`)."""
        p, ops = self.p, b.ops
        shape = (*tuple(b.d_out.shape)[:-1], p.E)
        arrays = (b.d_out, ops.q, ops.k, ops.v, b.out, b.lse, b.grad_lse)
        terms = (ops.terms.bias, ops.terms.sink)
        operands = [a for a in (*arrays, *terms) if a is not None]
        return inplace.fillable(p.xp, shape, p.compute_dtype, p.device, *operands)

    def put_query(self, dq: Array, index: Index, block: BackwardBlock, rows: Array) -> None:
        """Write one query block's rows of ``dQ`` (``None``: zeros) at the outer ``index``."""
        at = (*index, Ellipsis, slice(block.start, block.stop), slice(None))
        dq[at] = 0.0 if rows is None else rows

    def query(self, acc: dict[Any, Array], like: Array) -> Array:
        """``dQ`` in the padded query layout of the full batch."""
        blocks = self.plan.blocks
        filled = self.rows_into(
            like,
            lambda index: [((index, b.start), b.start, b.stop) for b in blocks],
            acc,
            self.p.E,
            -2,
        )
        if filled is not None:
            return filled
        return self.stack(
            like,
            lambda index, shape: self.concat(
                [acc.get((index, blk.start)) for blk in blocks],
                [(*shape[:-2], blk.stop - blk.start, self.p.E) for blk in blocks],
                axis=-2,
            ),
        )

    def key_value(self, acc: dict[Index, KeyRows], like: Array, features: int) -> Array:
        """``dK`` or ``dV`` in ``like``'s padded shape (GQA: without the group axis) from
        each outer index's rows by key range; keys no piece holds are zeros."""
        lead, S = (-3 if self.p.grouped else -2), self.p.S
        flat = {(index, r): x for index, rows in acc.items() for r, x in rows.items()}

        def pieces(index: Index) -> list[tuple[Any, int, int]]:
            return [
                (None if r is None else (index, r), a, b) for r, a, b in covering(acc.get(index), S)
            ]

        filled = self.rows_into(like, pieces, flat, features, lead)
        if filled is not None:
            return filled
        return self.stack(
            like,
            lambda index, shape: self.concat(
                [flat.get(key) for key, _, _ in pieces(index)],
                [(*shape[:lead], b - a, features) for _, a, b in pieces(index)],
                axis=-2,
            ),
        )

    def sink(self, acc: dict[Any, Array], like: Array) -> Array:
        """``dSinks`` in the prepared sinks' shape ``(..., 1, 1)``; zeros where no tile was."""
        p = self.p

        def piece(index: Index, shape: tuple[int, ...]) -> Array:
            x = acc.get(index)
            return x if x is not None else p.xp.zeros(shape, dtype=p.compute_dtype, device=p.device)

        return self.stack(like, piece)

    def bias(self, acc: dict[Any, Array], like: Array) -> Array:
        """``dBias`` in the padded prepared bias's shape (broadcast axes kept at 1)."""
        rows: list[tuple[int | None, int]] = [(None, 1)]
        if like.shape[-2] != 1:
            rows = [(b.start, b.stop - b.start) for b in self.plan.blocks]
        cols: list[tuple[int | None, int]] = [(None, 1)]
        if like.shape[-1] != 1:
            cols = list(self._grid())
        width = sum(n for _, n in cols)

        def bias_rows(index: Index, lead: tuple[int, ...], r: int | None, n_rows: int) -> Array:
            shapes = [(*lead, n_rows, n) for _, n in cols]
            return self.concat([acc.get((index, r, c)) for c, _ in cols], shapes, axis=-1)

        return self.stack(
            like,
            lambda index, shape: self.concat(
                [bias_rows(index, shape[:-2], r, n) for r, n in rows],
                [(*shape[:-2], n, width) for _, n in rows],
                axis=-2,
            ),
        )


def _sink_gradient(p: Problem, b: BackwardOperands, asm: _Assembly, sums: _Sums) -> Array:
    """The sinks' gradient: from the saved log-sum-exp, or the tiles' sums (whole rows)."""
    sink = b.ops.terms.sink
    if sink is None:
        return None
    return sink_gradient(p, b) if b.lse is not None else asm.sink(sums.sink, sink)


def blocked_vjp(
    p: Problem,
    x: Inputs,
    grad_output: Array,
    *,
    out: Array = None,
    lse: Array = None,
    grad_lse: Array = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> RawGrads:
    """Gradients tile by tile; memory ``O(block_q * block_k)`` per batch element in flight.

    Parameters
    ----------
    p : Problem
        The validated call (``L``, ``S`` > 0).
    x : Inputs
        The caller's arrays.
    grad_output : array
        The output cotangent, with the output's shape.
    out, lse : array, optional
        The forward pass's output and log-sum-exp (both or neither). Without them, a plan
        whose query blocks need several tiles runs the blocked forward pass first.
    grad_lse : array, optional
        Cotangent of the log-sum-exp ``(..., Hq, L)``.
    block_q, block_k : int, optional
        Block sizes (see :func:`~sdpa_array._kernels.tiling.plan_backward`).
    """
    ops = prepare(p, x)
    ops, bound = chunks_from_bound(p, ops)  # products cut where the scores may be large
    plan = plan_backward(p, ops.restrictions, block_q, block_k)
    sink_needs_lse = x.sinks is not None and grad_lse is not None
    if out is None and (not plan.rows_fit_one_tile or sink_needs_lse):
        forward = blocked_attention(p, x, Outputs(lse=True), block_q=block_q, block_k=block_k)
        out, lse = forward.out, forward.lse
    b = prepare_backward(p, x, grad_output, ops=ops, out=out, lse=lse, grad_lse=grad_lse)

    per_item = max(1, tile_bytes(p) // p.itemsize // (plan.block_q * plan.width))
    # per-sequence slices loop over the sequences: a GPU plan keeps the batch together
    per_sequence = ops.restrictions.per_sequence and not plans_for_gpu(p)
    at_least = len(p.sequence_batch) if per_sequence else 0
    split, slices = batch_slices(p.kernel_batch, per_item, at_least=at_least)
    if p.grouped and split == len(p.kernel_batch):
        # keep the group axis inside an item: dK sums over it in one product
        split = len(p.kernel_batch) - 1
        slices = _indices(p.kernel_batch[:split])
    items = _deal(plan, slices)
    parts = {index: b.at(index) for index in slices}
    # tiles holding whole rows take their own softmax: a fixed reference where it is safe
    fixed = b.lse is None and not plans_for_gpu(p) and fixed_reference(p, ops, bound)
    asm = _Assembly(p, plan, split)
    # where the library allows, each item writes its rows of dQ into the result
    dq = asm.query_target(b)

    def run(item: tuple[Index, tuple[BackwardBlock, ...]]) -> _Sums:
        index, blocks = item
        put = None if dq is None else lambda block, rows: asm.put_query(dq, index, block, rows)
        return _item(p, plan, parts[index], blocks, fixed, put)

    results = map_blocks(p.xp, run, items)
    sums = _sum_items(p, b, items, results)
    del results

    return RawGrads(
        dq=asm.query(sums.dq, b.d_out) if dq is None else dq,
        dk=asm.key_value({i: g[0] for i, g in sums.key_grads.items()}, ops.k, p.E),
        dv=asm.key_value({i: g[1] for i, g in sums.key_grads.items()}, ops.v, p.Ev),
        dbias=None if ops.terms.bias is None else asm.bias(sums.bias, ops.terms.bias),
        dsinks=_sink_gradient(p, b, asm, sums),
        dtables=tuple(sums.tables[i] for i in sorted(sums.tables)) or None,
    )
