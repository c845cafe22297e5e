"""How many tiles the blocked forward and backward visit and skip, for
:func:`sdpa_array.explain`.

The blocked kernel cuts the score matrix of each batch element and head into a grid of
``block_q x block_k`` tiles and visits only those its restrictions (causal band, window,
lengths, segments, a ``mask_mod``'s block structure) do not exclude: a *full* tile takes
the unmasked products, a *partial* one a mask. This counts them from the same plan the
kernel makes (:func:`~sdpa_array._kernels.tiling.plan_blocks`), as FlexAttention's
``BlockMask`` prints its sparsity, so that a call's cost can be read before it runs. The
backward's tiles are runs of key grid blocks (:func:`~sdpa_array._kernels.tiling.plan_backward`)
and are counted from its plan in the same way.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .._problem.problem import Inputs, Problem
from .operands import prepare
from .restrictions import Restrictions, TileKind
from .tiling import (
    QueryBlock,
    block_scores,
    choose_block_sizes,
    plan_backward,
    plan_blocks,
    plans_for_gpu,
)

__all__ = ["BackwardTileSummary", "TileSummary", "summarize_backward_tiles", "summarize_tiles"]


@dataclass(frozen=True)
class TileSummary:
    """The tiles of a blocked forward call, over every batch element and head.

    Attributes
    ----------
    block_q, block_k : int
        The block sizes (queries, keys).
    grid : int
        Tiles of the whole score matrices: ``ceil(L / block_q) * ceil(S / block_k)`` per
        batch element and head.
    full, partial : int
        Tiles visited without a mask and with one (a tile whose rows the plan cuts into
        runs, the full rows apart from the masked ones, counts once per run).
    skipped : int
        Tiles of the grid that no visited tile reaches: never read.
    fraction : float
        The share of the score matrices' pairs that the visited tiles compute (1.0: all).
    """

    block_q: int
    block_k: int
    grid: int
    full: int
    partial: int
    skipped: int
    fraction: float

    def __str__(self) -> str:
        return (
            f"tiles of {self.block_q}x{self.block_k}: {self.full} full and {self.partial} "
            f"partial visited, {self.skipped} of {self.grid} skipped; "
            f"{self.fraction:.1%} of the scores computed"
        )


def _each_sequence(p: Problem, restrictions: Restrictions) -> list[tuple[Restrictions, int]]:
    """The restrictions as the kernels plan or classify them, each with the batch elements
    and heads it stands for: each sequence's own (each head's, unless every head admits the
    same pairs) where they are per sequence, else the call's for all of them."""
    elements = math.prod(p.kernel_batch)
    if not restrictions.per_sequence:
        return [(restrictions, elements)]
    shape = p.sequence_batch if restrictions.same_for_every_head else p.kernel_batch
    indices = list(itertools.product(*map(range, shape)))
    return [(restrictions.at(i), elements // max(len(indices), 1)) for i in indices]


def summarize_tiles(
    p: Problem, x: Inputs, block_q: int | None = None, block_k: int | None = None
) -> TileSummary:
    """The tiles the blocked forward visits for the call ``(p, x)`` with these block sizes.

    The plan is that of the CPU's fixed reference (rows cut to those a tile's keys admit),
    the one the kernel makes for scores of moderate size; a GPU's plan keeps whole blocks.
    Only the restrictions are read: no score is computed.
    """
    bq, bk = choose_block_sizes(p, block_q, block_k)
    restrictions = prepare(p, x).restrictions
    cut = not plans_for_gpu(p)
    elements = math.prod(p.kernel_batch)
    plans: list[tuple[list[QueryBlock], int]] = [
        (plan_blocks(r, bq, bk, cut_rows=cut, narrow_rows=cut), times)
        for r, times in _each_sequence(p, restrictions)
    ]
    full = partial = scores = touched = 0
    for blocks, times in plans:
        cells: set[tuple[int, int]] = set()
        for block in blocks:
            scores += times * block_scores(block)
            for tile in block.tiles:
                r0, r1 = (block.start, block.stop) if tile.rows is None else tile.rows
                full += times * tile.full
                partial += times * (not tile.full)
                cells.update(
                    (i, j)
                    for i in range(r0 // bq, (r1 - 1) // bq + 1)
                    for j in range(tile.start // bk, (tile.stop - 1) // bk + 1)
                )
        touched += times * len(cells)
    grid = elements * math.ceil(p.L / bq) * math.ceil(p.S / bk)
    fraction = scores / (elements * p.L * p.S) if p.L and p.S else 0.0
    return TileSummary(bq, bk, grid, full, partial, grid - touched, fraction)


@dataclass(frozen=True)
class BackwardTileSummary:
    """The tiles of a blocked backward call, over every batch element and head.

    Attributes
    ----------
    block_q : int
        Query rows per tile.
    grid, width : int
        The key grid's block length and the widest tile visited: a tile is a run of grid
        blocks.
    blocks : int
        Blocks of ``block_q x grid`` in the whole score matrices.
    full, partial : int
        Tiles visited without a mask and with one.
    skipped : int
        Blocks of ``block_q x grid`` that no visited tile reads.
    fraction : float
        The share of the score matrices' pairs that the visited tiles compute (1.0: all).
    """

    block_q: int
    grid: int
    width: int
    blocks: int
    full: int
    partial: int
    skipped: int
    fraction: float

    def __str__(self) -> str:
        return (
            f"tiles of {self.block_q} rows and up to {self.width} keys: {self.full} full and "
            f"{self.partial} partial visited, {self.skipped} of {self.blocks} "
            f"{self.block_q}x{self.grid} blocks skipped; {self.fraction:.1%} of the scores "
            "computed"
        )


def summarize_backward_tiles(
    p: Problem, x: Inputs, block_q: int | None = None, block_k: int | None = None
) -> BackwardTileSummary:
    """The tiles the blocked backward visits for the call ``(p, x)`` with these block sizes:
    its plan's tiles, less those a sequence's own restrictions exclude (as the kernel
    skips them, batch slice by batch slice). Only the restrictions are read."""
    restrictions = prepare(p, x).restrictions
    plan = plan_backward(p, restrictions, block_q, block_k)
    elements = math.prod(p.kernel_batch)
    full = partial = scores = touched = width = 0
    for r, times in _each_sequence(p, restrictions):
        cells: set[tuple[int, int]] = set()
        for block in plan.blocks:
            rows = slice(block.start, block.stop)
            for a, z in block.tiles:
                kind = r.classify(rows, slice(a, z))
                if kind is TileKind.EMPTY:
                    continue
                full += times * (kind is TileKind.FULL)
                partial += times * (kind is not TileKind.FULL)
                scores += times * (block.stop - block.start) * (z - a)
                width = max(width, z - a)
                cells.update((block.start, c) for c in range(a, z, plan.grid))
        touched += times * len(cells)
    grid_blocks = elements * len(plan.blocks) * math.ceil(p.S / plan.grid)
    fraction = scores / (elements * p.L * p.S) if p.L and p.S else 0.0
    return BackwardTileSummary(
        plan.block_q, plan.grid, width, grid_blocks, full, partial,
        grid_blocks - touched, fraction,
    )  # fmt: skip
