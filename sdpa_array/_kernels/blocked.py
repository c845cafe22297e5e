"""The blocked forward kernel: FlashAttention-style online softmax on the Array API.

Keys and values are visited in tiles with an *online softmax*: each query row keeps a
running maximum ``m``, a running sum ``l`` of ``exp(score - m)`` and a running output
``acc``, and rescales ``l`` and ``acc`` by ``exp(m_old - m_new)`` whenever a later tile
raises the maximum. Queries are processed in blocks too, so the largest temporary is one
``(block_q, block_k)`` score tile per batch element instead of the ``(L, S)`` score matrix.

Where a bound read on the host keeps every score small (:func:`~.score_bound.fixed_reference`)
the rows take a reference of 0 instead: no maxima, no rescaling; the scores then come out
times ``log2(e)`` where the library's ``exp2`` is the faster exponential
(:func:`~sdpa_array._arrays.inplace.exp2_is_faster`, timed once on NumPy, whose ``exp2`` is
twice as fast as ``exp`` with AVX-512 and twice as slow with AVX2 alone), and their
``exp2`` is their ``exp`` (:meth:`~.operands.Operands.in_base2`).

The tiles come from :func:`~sdpa_array._kernels.tiling.plan_blocks`, which skips the tiles
the restrictions empty and marks the full ones (no mask built). Independent (batch slice,
query block) items run through :func:`~sdpa_array._arrays.parallel.map_blocks`, the one
place that knows which libraries run them concurrently, costliest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._arrays import inplace, products
from .._arrays.parallel import map_blocks
from .._arrays.typing import Array
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .layout import broadcast_if_needed, concat, ungroup
from .materialized import materialized_attention
from .operands import (
    Operands,
    fixed_scores_and_scaled,
    fixed_weights,
    prepare,
    tile_scores_and_maxima,
)
from .result import AttentionResult
from .score_bound import chunks_from_bound, fixed_reference
from .softmax import exp_shift, log_sum_exp, row_sum, safe_reciprocal
from .tiling import (
    QueryBlock,
    batch_slices,
    block_scores,
    choose_block_sizes,
    plan_blocks,
    plans_for_gpu,
    tile_bytes,
)

__all__ = ["blocked_attention"]


def _tile_sums(
    p: Problem, ops: Operands, e: Array, rows: slice, cols: slice
) -> tuple[Array, Array]:
    """A tile's row sums of ``e`` (its weights before normalisation) and their product with
    the tile's values; dropout drops weights after the sums, and ``1 / (1 - p)`` comes last."""
    tile_total = row_sum(p, e)
    if ops.dropout is not None:
        e = ops.dropout.tile(p.xp, e, rows, cols, p.device, scaled=False)
    return tile_total, products.matmul(p.xp, e, ops.v[..., cols, :], whole=p.S)


def _online_tiles(
    p: Problem, ops: Operands, q: Array, block: QueryBlock, maxima: bool
) -> tuple[Array, Array, Array, Array]:
    """The online softmax over the block's tiles: each row's reference (its running
    maximum, :func:`exp_shift`), ``Σ exp(score - ref)``, ``Σ exp(score - ref) v`` and, with
    ``maxima``, the largest scaled products (else ``None``). The scores, the maxima and the
    reference are in the terms' unit (:meth:`~.score_terms.ScoreTerms.exp`: times
    ``log2(e)`` for operands in base 2, whose rows admitting one key take this softmax)."""
    xp = p.xp
    terms = ops.terms
    rows = slice(block.start, block.stop)
    running_max = total = acc = ref = best = None
    if terms.sink is not None:  # the sink starts each row: m = sink, l = exp(sink - m)
        running_max = terms.sink if terms.unit == 1.0 else terms.sink * terms.unit
        ref = exp_shift(p, running_max)
        total = terms.exp(xp, running_max - ref)
    for tile in block.tiles:
        cols = slice(tile.start, tile.stop)
        s, tile_max, tile_best = tile_scores_and_maxima(p, ops, q, rows, cols, maxima=maxima)
        if tile_best is not None:
            best = tile_best if best is None else xp.maximum(best, tile_best)
        new_max = tile_max if running_max is None else xp.maximum(running_max, tile_max)
        new_ref = exp_shift(p, new_max)
        e = terms.exp(xp, inplace.subtract(s, new_ref))
        del s
        tile_total, tile_out = _tile_sums(p, ops, e, rows, cols)
        del e
        if running_max is None:
            total, acc = tile_total, tile_out
        else:
            # 0 while the row had no admissible key
            alpha = terms.exp(xp, running_max - new_ref)
            total = total * alpha + tile_total
            acc = tile_out if acc is None else acc * alpha + tile_out
        running_max, ref = new_max, new_ref
    return ref, total, acc, best


def _fixed_reference_tiles(
    p: Problem, ops: Operands, q: Array, block: QueryBlock, maxima: bool
) -> tuple[Array, Array, Array, Array]:
    """The softmax over the block's tiles with a reference of 0 for every row
    (:func:`~.score_bound.fixed_reference` holds): no running maxima, no rescaling. A tile
    cut to some of the block's rows (:attr:`~.tiling.KeyTile.rows`) adds to those rows only.
    Returns the reference, ``Σ exp(score)``, ``Σ exp(score) v`` and, with ``maxima``, the
    rows' largest scaled products (else ``None``, :class:`_Maxima`)."""
    xp = p.xp
    n = block.stop - block.start
    total: Array = None
    acc: Array = None
    best = _Maxima(p, n, ops.terms.unit) if maxima else None
    for tile in block.tiles:
        cols = slice(tile.start, tile.stop)
        r0, r1 = tile.rows or (block.start, block.stop)
        rows = slice(r0, r1)
        q_rows = q[..., r0 - block.start : r1 - block.start, :]
        a, b = r0 - block.start, r1 - block.start
        if best is None:
            e = fixed_weights(p, ops, q_rows, rows, cols, full=tile.full)
        else:
            s, scaled = fixed_scores_and_scaled(p, ops, q_rows, rows, cols)
            best.add(scaled)
            e = ops.terms.exp(xp, s)
            del s, scaled
        tile_total, tile_out = _tile_sums(p, ops, e, rows, cols)
        del e
        if acc is None and tile.rows is not None:  # rows no tile reaches keep zeros
            lead = tuple(tile_out.shape[:-2])
            acc = xp.zeros((*lead, n, p.Ev), dtype=p.compute_dtype, device=p.device)
            total = xp.zeros((*lead, n, 1), dtype=p.compute_dtype, device=p.device)
        if acc is None:
            total, acc = tile_total, tile_out
        else:
            total = inplace.add_rows(xp, total, a, b, tile_total)
            acc = inplace.add_rows(xp, acc, a, b, tile_out)
    sink = ops.terms.sink_total(xp, 0.0)
    if sink is not None:
        total = total + sink
    ref = xp.zeros(tuple(total.shape), dtype=p.compute_dtype, device=p.device)
    return ref, total, acc, None if best is None else best.rows()


class _Maxima:
    """The largest scaled product over a query block's tiles, for the fixed reference, per
    batch element and head: one reduction of each whole tile (one read of it, nothing
    written; a row reduction costs as much as the tile's exponentials on NumPy, whose rows
    are short), given to every row of the block. The maximum scores are the maximum of the
    rows' values (:func:`~.result.finalize`), which this leaves unchanged. The tiles' scaled
    products come in the scores' ``unit`` (``log2(e)`` in base 2), divided out at the end."""

    def __init__(self, p: Problem, n: int, unit: float) -> None:
        self.p, self.n, self.unit = p, n, unit
        self.best: Array = None  # (..., 1, 1): the largest over the tiles so far

    def add(self, scaled: Array) -> None:
        """Take in the scaled products of a tile (``-inf`` where excluded)."""
        xp = self.p.xp
        tile = xp.max(scaled, axis=(-2, -1), keepdims=True)
        self.best = tile if self.best is None else xp.maximum(self.best, tile)

    def rows(self) -> Array:
        """The block's maximum for each of its rows, ``(..., n, 1)``."""
        best = self.best if self.unit == 1.0 else self.best / self.unit
        return self.p.xp.broadcast_to(best, (*tuple(best.shape[:-2]), self.n, 1))


def _query_block(
    p: Problem,
    ops: Operands,
    inner: tuple[int, ...],
    block: QueryBlock,
    maxima: bool,
    fixed: bool,
) -> tuple[Array, Array, Array]:
    """Output ``(*inner, rows, Ev)``, log-sum-exp ``(*inner, rows)`` and, with ``maxima``,
    the rows' largest scaled products ``(*inner, rows)`` (else ``None``) of one query block.

    ``ops`` is one batch slice of the operands and ``inner`` its batch shape; ``fixed``:
    every row takes a reference of 0 (:func:`~.score_bound.fixed_reference`).
    """
    xp = p.xp
    terms = ops.terms
    n = block.stop - block.start
    if not block.tiles:
        out = xp.zeros((*inner, n, p.Ev), dtype=p.compute_dtype, device=p.device)
        if terms.sink is None:
            lse = xp.full((*inner, n), -math.inf, dtype=p.compute_dtype, device=p.device)
        else:  # only the sink is left in each row
            lse = xp.broadcast_to(terms.sink, (*inner, n, 1))[..., 0]
        empty = xp.full((*inner, n), -math.inf, dtype=p.compute_dtype, device=p.device)
        return out, lse, empty if maxima else None
    q = ops.q[..., block.start : block.stop, :]
    best = None
    if fixed:
        ref, total, acc, best = _fixed_reference_tiles(p, ops, q, block, maxima)
    else:
        ref, total, acc, best = _online_tiles(p, ops, q, block, maxima)
        if terms.unit != 1.0:  # the reference and the maxima back in natural units
            ref = ref / terms.unit
            best = None if best is None else best / terms.unit
    inv = safe_reciprocal(p, total)
    out = acc * (inv if ops.dropout is None else inv * ops.dropout.factor)
    lse = log_sum_exp(p, ref, total)
    # every operand may broadcast along an inner batch axis that the output has
    out = broadcast_if_needed(xp, out, (*inner, *out.shape[-2:]))
    lse = broadcast_if_needed(xp, lse, (*inner, lse.shape[-1]))
    if best is not None:
        best = broadcast_if_needed(xp, best[..., 0], (*inner, n))
    return out, lse, best


def blocked_attention(
    p: Problem,
    x: Inputs,
    outputs: Outputs,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
) -> AttentionResult:
    """Attention with an online softmax over key tiles; memory ``O(block_q * block_k)``.

    The weights fall back to the materialized kernel (they are the score matrix); the
    log-sum-exp is a by-product and always computed; the maximum scores are a running
    maximum per row beside the softmax's. Block sizes: see
    :func:`~sdpa_array._kernels.tiling.choose_block_sizes`.
    """
    bq, bk = choose_block_sizes(p, block_q, block_k)
    if outputs.weights:
        return materialized_attention(p, x, outputs)
    xp = p.xp
    ops = prepare(p, x)
    batch = p.kernel_batch
    # per-sequence tile plans loop over the sequences: a GPU plan keeps the batch together
    per_sequence = ops.restrictions.per_sequence and not plans_for_gpu(p)
    split, outer = batch_slices(
        batch,
        max(1, tile_bytes(p) // p.itemsize // (bq * bk)),
        at_least=len(p.sequence_batch) if per_sequence else 0,
    )
    maxima = outputs.max_scores
    ops, bound = chunks_from_bound(p, ops)  # products cut where the scores may be large
    fixed = not plans_for_gpu(p) and fixed_reference(p, ops, bound)
    # with the fixed reference a tile may cover some of its block's rows (cut_rows), and
    # rows admitting at most one key have blocks of their own, with a running maximum
    if per_sequence:  # each sequence skips the tiles its own lengths or segments exclude
        # one plan per sequence where the restrictions are the same for every head
        heads_alike = ops.restrictions.same_for_every_head
        made: dict[tuple[int, ...], list[QueryBlock]] = {}
        plans = {}
        for index in outer:
            key = index[: len(p.sequence_batch)] if heads_alike else index
            if key not in made:
                made[key] = plan_blocks(
                    ops.restrictions.at(index), bq, bk, cut_rows=fixed, narrow_rows=fixed
                )
            plans[index] = made[key]
    else:
        shared = plan_blocks(ops.restrictions, bq, bk, cut_rows=fixed, narrow_rows=fixed)
        plans = dict.fromkeys(outer, shared)
    # exp2 of the scores times log2(e) where that is the faster exponential; the maximum
    # scores are then those scores' maxima over log2(e), except where the scores are not
    # the scaled products
    base2 = inplace.exp2_is_faster(xp, p.compute_dtype)
    if fixed and base2 and not (maxima and ops.terms.changes_scores):
        ops = ops.in_base2(in_place=True)  # the operands before are not used again
    slices = {index: ops.at(index) for index in outer}
    items = [(index, block) for index in outer for block in plans[index]]
    inner = batch[split:]
    costs = [block_scores(block) for _, block in items]

    def run(item: tuple[tuple[int, ...], QueryBlock]) -> tuple[Array, Array, Array]:
        index, block = item
        return _query_block(p, slices[index], inner, block, maxima, fixed and not block.running_max)

    # where the library allows, each item writes its rows into the results (no assembly)
    filled = _Filled.make(p, ops, batch, outputs.lse, maxima)
    if filled is not None:
        map_blocks(xp, lambda item: filled.put(item[0], item[1], run(item)), items, costs)
        return AttentionResult(
            out=ungroup(p, filled.out),
            lse=_rows(p, filled.lse),
            row_maxima=_rows(p, filled.best),
        )

    results = map_blocks(xp, run, items, costs)
    outs, lses, bests = [], [], []
    done = 0  # every plan covers [0, L) in order; plans of sequences may cut it differently
    for index in outer:
        mine = results[done : done + len(plans[index])]
        done += len(plans[index])
        outs.append(concat(xp, [r[0] for r in mine], axis=-2))
        lses.append(concat(xp, [r[1] for r in mine], axis=-1))
        if maxima:
            bests.append(concat(xp, [r[2] for r in mine], axis=-1))

    def rows(parts: list[Array]) -> Array:
        whole = xp.reshape(xp.stack(parts), (*batch, p.L)) if split else parts[0]
        return _rows(p, whole)

    out = xp.reshape(xp.stack(outs), (*batch, p.L, p.Ev)) if split else outs[0]
    return AttentionResult(
        out=ungroup(p, out),
        lse=rows(lses) if outputs.lse else None,
        row_maxima=rows(bests) if maxima else None,
    )


def _rows(p: Problem, x: Array) -> Array:
    """Per-row results ``(*batch, L)`` back from the grouped layout (``None`` stays)."""
    return None if x is None else ungroup(p, x[..., None])[..., 0]


@dataclass(frozen=True)
class _Filled:
    """The call's results, filled in place by its query blocks
    (:func:`~sdpa_array._arrays.inplace.fillable`): the output and, when asked for, the
    log-sum-exp and the maximum scores."""

    out: Array
    lse: Array
    best: Array

    @classmethod
    def make(
        cls, p: Problem, ops: Operands, batch: tuple[int, ...], lse: bool, maxima: bool
    ) -> _Filled | None:
        xp, dtype, device = p.xp, p.compute_dtype, p.device
        arrays = (ops.q, ops.k, ops.v)
        out = inplace.fillable(xp, (*batch, p.L, p.Ev), dtype, device, *arrays)
        if out is None:
            return None
        rows = (*batch, p.L)  # the same library: as fillable as the output
        return cls(
            out=out,
            lse=xp.empty(rows, dtype=dtype, device=device) if lse else None,
            best=xp.empty(rows, dtype=dtype, device=device) if maxima else None,
        )

    def put(
        self, index: tuple[int, ...], block: QueryBlock, result: tuple[Array, Array, Array]
    ) -> None:
        """Write one query block's results at the outer batch ``index``."""
        at = (*index, Ellipsis, slice(block.start, block.stop))
        whole = (*at, slice(None))
        out, lse, best = result
        self.out[whole] = out
        if self.lse is not None:
            self.lse[at] = lse
        if self.best is not None:
            self.best[at] = best
