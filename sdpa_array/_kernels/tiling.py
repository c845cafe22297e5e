"""Tiling: block sizes, tile plans and batch slices, shared by the blocked kernels.

Everything here is plain Python arithmetic on lengths, done before any array work. The
forward plan (:func:`plan_blocks`) and the backward plan (:func:`plan_backward`) ask the
call's :class:`~sdpa_array._kernels.restrictions.Restrictions` which keys a query block can
reach and which tiles are empty, full or partial; empty tiles are never planned.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from .._problem.band import Band
from .._problem.problem import Problem
from .restrictions import Restrictions, TileKind

__all__ = [
    "BLOCK_ALIGN",
    "GPU_MAX_BLOCK_K",
    "GPU_TILE_BYTES",
    "GRID_RESTRICTED",
    "MAX_BLOCK_K",
    "MIN_ROWS",
    "MIN_ROWS_RESTRICTED",
    "TILE_BYTES",
    "BackwardBlock",
    "BackwardPlan",
    "KeyTile",
    "QueryBlock",
    "balanced",
    "batch_slices",
    "block_scores",
    "choose_block_sizes",
    "clear_band_plans",
    "gpu_plans",
    "plan_backward",
    "plan_blocks",
    "plans_for_gpu",
    "tile_bytes",
]

#: Target size in bytes of one score tile (all batch elements processed together in it): on
#: NumPy, tiles of 0.25 to 2 MiB run within noise of each other at L = S = 4096, and 1 MiB
#: tiles about 10 % faster than 2 MiB ones at L = S = 1024.
TILE_BYTES = 2**20

#: On a GPU, the score tile of every batch element and head together: each launch does a
#: lot of work (one batched product over the whole batch per tile, no Python loop over
#: batch, heads or small tiles), within a memory budget far below a GPU's memory (the
#: blocked path's peak is a few tiles).
GPU_TILE_BYTES = 2**26

#: On a GPU, the longest key block: a tile covers all keys up to this length, so each
#: query row's softmax is done in one tile.
GPU_MAX_BLOCK_K = 2**15

_FORCE_GPU_PLANS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sdpa_array_force_gpu_plans", default=False
)


@contextlib.contextmanager
def gpu_plans() -> Iterator[None]:
    """Plan tiles as for a GPU whatever the device (for tests on a CPU, which count the
    operations of a call planned for a GPU)."""
    token = _FORCE_GPU_PLANS.set(True)
    try:
        yield
    finally:
        _FORCE_GPU_PLANS.reset(token)


def plans_for_gpu(p: Problem) -> bool:
    """Whether ``p``'s tiles are planned for a GPU: its arrays are on one, or
    :func:`gpu_plans` is active."""
    return p.on_gpu or _FORCE_GPU_PLANS.get()


def tile_bytes(p: Problem) -> int:
    """Bytes of scores in one tile of all the batch elements processed together:
    :data:`GPU_TILE_BYTES` on a GPU, :data:`TILE_BYTES` elsewhere."""
    return GPU_TILE_BYTES if plans_for_gpu(p) else TILE_BYTES


#: Longest default key block; the query block fills the rest of the tile budget (1024 rows
#: in float32, 512 in float64). On NumPy the product ``q kᵀ`` of a 256-key tile runs about
#: 20 % faster per score than that of a 1024-key one, and a tall block costs a causal call
#: little since its tiles are cut to the rows that reach their keys (``cut_rows`` of
#: :func:`plan_blocks`).
MAX_BLOCK_K = 256

#: Default blocks are multiples of this (matrix-product kernels prefer aligned sizes).
BLOCK_ALIGN = 16

#: Key grid block of the backward pass when restrictions let query blocks reach different
#: keys: a tile starts and ends on this grid, so at most one grid block of excluded keys is
#: computed on each side of the admissible band (a causal tile of 128 query rows ends at its
#: diagonal; 256 computed and masked up to 128 more keys, 5 % of the causal VJP at 2048 on
#: one thread).
GRID_RESTRICTED = 128

#: Fewest query rows in a backward tile that holds whole rows: a row of up to
#: ``TILE_BYTES / (itemsize * MIN_ROWS)`` keys (4096 in float32) fits one tile, so the
#: backward pass needs no forward pass; fewer rows would make ``dK = dSᵀ Q``'s inner
#: dimension too short to be fast.
MIN_ROWS = 64

#: Fewest query rows of such a tile when the restrictions bound the keys (causal): its
#: tiles hold part of their rows' keys (half of them on average), so that 64-row tiles are
#: narrow; 128 rows took 0.88 of the time of 64 in the causal VJP at 1x4x4096x64 on two
#: threads (the widest tile then holds twice :data:`TILE_BYTES`), and more rows at shorter
#: keys computed more of the excluded triangle at the diagonal than they saved (512 rows
#: against 256 at 1024 keys: 1.11).
MIN_ROWS_RESTRICTED = 128

#: How much more of the score matrices a backward tile of more rows may reach than tiles of
#: :data:`MIN_ROWS_RESTRICTED` rows (:func:`_rows_by_reach`).
REACH_GROWTH = 1.05


@dataclass(frozen=True)
class KeyTile:
    """Keys ``[start, stop)`` of one forward tile and how the restrictions cover it.

    ``rows``: the query rows ``(start, stop)`` of the tile when it covers fewer than its
    block's (the others attend none of its keys), else ``None``; ``kind`` is that of
    those rows.
    """

    start: int
    stop: int
    kind: TileKind
    rows: tuple[int, int] | None = None

    @property
    def full(self) -> bool:
        """Whether every pair of the tile is admissible (no mask needed)."""
        return self.kind is TileKind.FULL


@dataclass(frozen=True)
class QueryBlock:
    """Queries ``[start, stop)`` and the key tiles they visit, in order.

    An empty ``tiles`` means no query of the block may attend any key. ``running_max``: the
    block's rows admit at most one key each (:meth:`~.restrictions.Restrictions.narrow_ends`),
    and the forward kernel gives them a running maximum where the other rows take the fixed
    reference, so that such a row's one weight is ``exp(0) = 1`` and its output that key's
    value, exactly.
    """

    start: int
    stop: int
    tiles: tuple[KeyTile, ...]
    running_max: bool = False


def block_scores(block: QueryBlock) -> int:
    """How many scores the block's tiles compute (its share of the work)."""
    n = block.stop - block.start
    return sum(
        (n if t.rows is None else t.rows[1] - t.rows[0]) * (t.stop - t.start) for t in block.tiles
    )


def balanced(n: int, most: int) -> int:
    """Block length ``<= most`` (when ``most >= BLOCK_ALIGN``) that splits ``n`` evenly."""
    if n <= most:
        return n
    count = -(-n // most)
    size = -(-n // count)
    aligned = -(-size // BLOCK_ALIGN) * BLOCK_ALIGN
    return aligned if aligned <= most else size


def check_block_sizes(block_q: int | None, block_k: int | None) -> None:
    """Raise ``ValueError`` unless each of ``block_q``, ``block_k`` is a positive int or None."""
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def choose_block_sizes(
    p: Problem, block_q: int | None = None, block_k: int | None = None
) -> tuple[int, int]:
    """Block sizes for ``p``: the overrides where given, else sized to :data:`TILE_BYTES`.

    The key block is as long as possible (up to :data:`MAX_BLOCK_K`) and the query block
    fills the rest of the tile budget; both are balanced so that the last block is not a
    sliver (``S = 1028`` gives two key blocks of 528, not 1024 and 4).

    Returns
    -------
    (int, int)
        ``(block_q, block_k)``, each at least 1 and at most ``L`` and ``S`` (when those are
        positive).
    """
    check_block_sizes(block_q, block_k)
    S, L = max(p.S, 1), max(p.L, 1)
    if plans_for_gpu(p):  # the whole batch in one tile, each row's keys in one tile
        batch = max(1, math.prod(p.kernel_batch))
        if block_k is None:
            block_k = balanced(S, GPU_MAX_BLOCK_K)
        if block_q is None:
            rows = GPU_TILE_BYTES // p.itemsize // (batch * block_k)
            block_q = balanced(L, max(BLOCK_ALIGN, rows // BLOCK_ALIGN * BLOCK_ALIGN))
        return min(block_q, L), min(block_k, S)
    budget = max(TILE_BYTES // p.itemsize, BLOCK_ALIGN * BLOCK_ALIGN)
    if block_k is None:
        block_k = balanced(S, min(MAX_BLOCK_K, budget // BLOCK_ALIGN))
    if block_q is None:
        block_q = balanced(L, max(BLOCK_ALIGN, budget // block_k))
    return min(block_q, L), min(block_k, S)


def _tiles(
    r: Restrictions, rows: slice, lo: int, hi: int, size: int, cut_rows: bool
) -> list[KeyTile]:
    tiles = []
    for k0 in range(lo, hi, size):
        cols = slice(k0, min(k0 + size, hi))
        kind = r.classify(rows, cols)
        if kind is TileKind.EMPTY:
            continue
        if not cut_rows:
            tiles.append(KeyTile(cols.start, cols.stop, kind))
            continue
        a, b = r.query_range(cols.start, cols.stop)
        a, b = max(a, rows.start), min(b, rows.stop)
        if a >= b:
            a, b = rows.start, rows.stop
        m = _full_rows_from(r, a, b, cols) if kind is TileKind.PARTIAL else b
        m = min(a + -(-(m - a) // BLOCK_ALIGN) * BLOCK_ALIGN, b)  # whole multiples of rows
        if b - m < BLOCK_ALIGN:  # too few full rows to be worth a tile of their own
            m = b
        elif r.partial_rows(slice(a, b), cols).stop <= m:
            m = b  # the tile's mask leaves out those rows by itself: one tile
        if a < m:
            kind = r.classify(slice(a, m), cols)
            if kind is not TileKind.EMPTY:  # the full rows' tile may be all it has
                tiles.append(KeyTile(cols.start, cols.stop, kind, _cut(a, m, rows)))
        if m < b:
            tiles.append(KeyTile(cols.start, cols.stop, TileKind.FULL, _cut(m, b, rows)))
    return tiles


def _cut(a: int, b: int, rows: slice) -> tuple[int, int] | None:
    """``(a, b)``, or ``None`` when those are all of ``rows``."""
    return None if (a, b) == (rows.start, rows.stop) else (a, b)


def _full_rows_from(r: Restrictions, a: int, b: int, cols: slice) -> int:
    """A row ``m`` of ``[a, b)`` from which every row attends every key of ``cols`` (``b``
    when the last row does not), by bisection over the final runs of rows ``[m, b)``. Under
    a causal band the full rows are such a run and ``m`` is the first of them; under a left
    window they may end before ``b``, and then none is split off. The bisection only keeps
    runs it classified as full, so a split is never wrong, at worst smaller."""
    if r.classify(slice(b - 1, b), cols) is not TileKind.FULL:
        return b
    lo, hi = a, b - 1  # rows [hi, b) attend every key; find the smallest such hi
    while lo < hi:
        mid = (lo + hi) // 2
        if r.classify(slice(mid, b), cols) is TileKind.FULL:
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_blocks(
    r: Restrictions,
    block_q: int,
    block_k: int,
    *,
    cut_rows: bool = False,
    narrow_rows: bool = False,
) -> list[QueryBlock]:
    """The query blocks of a forward pass and, for each, the key tiles it must visit.

    Keys outside :meth:`Restrictions.key_range` of a query block are skipped. The
    reachable range is cut into the keys that every query of the block may attend
    (:meth:`Restrictions.full_range`, shrunk to whole multiples of ``block_k`` from the
    range's start, so that the cut leaves no sliver of a tile on either side of it) and the
    partial bands on either side, so that as few tiles as possible need a mask; each part is
    split into tiles of at most ``block_k`` keys, and tiles the restrictions classify as
    empty are dropped. With ``cut_rows`` a tile keeps only the block's rows that may attend
    its keys (:meth:`Restrictions.query_range`, :attr:`KeyTile.rows`), and a partial tile's
    run of full rows (at least :data:`BLOCK_ALIGN` of them) becomes a tile of its own, the
    masked rows before it a whole multiple of :data:`BLOCK_ALIGN`, unless the tile's mask
    leaves those rows out by itself (:meth:`Restrictions.partial_rows`, a band's): one
    tile then does fewer, larger products.

    Returns
    -------
    list of QueryBlock
        Covering queries ``[0, L)`` in order; together their tiles cover every admissible
        (query, key) pair exactly once.

    Notes
    -----
    Plans of restrictions made of position bands only (causal, windows: frozen values, no
    arrays) are kept, the last 16 (:func:`_band_plan`; a plan at 65536 keys holds about
    1.5 MB): a repeated call does not plan again.
    """
    if all(isinstance(m, Band) for m in r.members):
        return list(_band_plan(r, block_q, block_k, cut_rows, narrow_rows))
    return _plan(r, block_q, block_k, cut_rows, narrow_rows)


@functools.lru_cache(maxsize=16)
def _band_plan(
    r: Restrictions, block_q: int, block_k: int, cut_rows: bool, narrow_rows: bool
) -> tuple[QueryBlock, ...]:
    return tuple(_plan(r, block_q, block_k, cut_rows, narrow_rows))


def clear_band_plans() -> None:
    """Forget the kept plans of position bands (:func:`plan_blocks`'s Notes)."""
    _band_plan.cache_clear()


def _plan(
    r: Restrictions, block_q: int, block_k: int, cut_rows: bool, narrow_rows: bool
) -> list[QueryBlock]:
    blocks = []
    for q0 in range(0, r.L, block_q):
        rows = slice(q0, min(q0 + block_q, r.L))
        if not narrow_rows:
            blocks.append(_query_block(r, rows, block_k, cut_rows))
            continue
        a, b = r.narrow_ends(rows)
        for start, stop, narrow in ((rows.start, a, True), (a, b, False), (b, rows.stop, True)):
            # a narrow run in blocks of at most block_k rows: each reaches about as many keys
            step = block_k if narrow else max(stop - start, 1)
            for s0 in range(start, stop, step):
                part = slice(s0, min(s0 + step, stop))
                block = _query_block(r, part, block_k, cut_rows and not narrow)
                blocks.append(dataclasses.replace(block, running_max=narrow))
    return blocks


def _query_block(r: Restrictions, rows: slice, block_k: int, cut_rows: bool) -> QueryBlock:
    """The query block of ``rows`` and the key tiles it visits (see :func:`plan_blocks`)."""
    lo, hi = r.key_range(rows.start, rows.stop)
    full_lo, full_hi = r.full_range(rows.start, rows.stop)
    full_lo = min(max(full_lo, lo), hi)
    full_hi = max(min(full_hi, hi), full_lo)
    # the full range shrunk to the grid of block_k from lo: no sliver tiles around it
    full_lo = lo + -(-(full_lo - lo) // block_k) * block_k
    full_hi = lo + (full_hi - lo) // block_k * block_k
    cuts = [lo, hi] if full_lo >= full_hi else [lo, full_lo, full_hi, hi]
    tiles = [
        t for a, b in itertools.pairwise(cuts) for t in _tiles(r, rows, a, b, block_k, cut_rows)
    ]
    return QueryBlock(rows.start, rows.stop, tuple(tiles))


def batch_slices(
    batch: tuple[int, ...], per_item: int, *, at_least: int = 0
) -> tuple[int, list[tuple[int, ...]]]:
    """Split the batch into slices that fit a tile: ``(split, indices)``.

    ``split`` is the smallest number (at least ``at_least``) of leading batch axes to loop
    over so that the rest, ``prod(batch[split:])`` elements, is at most ``per_item``;
    ``indices`` lists the index tuples of those leading axes in row-major order (``[()]``
    when ``split == 0``).
    """
    split = len(batch)
    for n in range(min(at_least, len(batch)), len(batch) + 1):
        if math.prod(batch[n:]) <= per_item:
            split = n
            break
    return split, list(itertools.product(*(range(n) for n in batch[:split])))


@dataclass(frozen=True)
class BackwardBlock:
    """Queries ``[start, stop)`` and the key tiles ``[(start, stop), ...]`` they visit.

    Every tile is a run of whole grid blocks (the last one possibly cut at ``S``); an empty
    ``tiles`` means no query of the block may attend any key.
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
        Key grid block length: tiles start and end on it, and ``dBias`` is summed in its
        blocks.
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


def _rows_by_reach(r: Restrictions, budget: int) -> int:
    """The most query rows (:data:`MIN_ROWS_RESTRICTED` times a power of two) of a backward
    tile whose keys the restrictions bound: each block of that many rows reaches (from its
    first to its last admissible key) at most ``budget / rows`` keys, and the blocks
    together reach at most :data:`REACH_GROWTH` times the keys that blocks of
    :data:`MIN_ROWS_RESTRICTED` rows reach. Packed documents reach their own keys alone,
    so their tiles take a whole document's rows; a causal band's last blocks reach every
    key, so its tiles keep :data:`MIN_ROWS_RESTRICTED` rows."""
    best, finest, rows = MIN_ROWS_RESTRICTED, None, MIN_ROWS_RESTRICTED
    while rows <= r.L:
        spans = [
            (min(q0 + rows, r.L) - q0, r.key_range(q0, min(q0 + rows, r.L)))
            for q0 in range(0, r.L, rows)
        ]
        area = sum(n * max(hi - lo, 0) for n, (lo, hi) in spans)
        widest = max(max(hi - lo, 0) for _, (lo, hi) in spans)
        finest = area if finest is None else finest
        if widest * rows > budget or area > REACH_GROWTH * finest:
            break
        best, rows = rows, rows * 2
    return best


def plan_backward(
    p: Problem, r: Restrictions, block_q: int | None = None, block_k: int | None = None
) -> BackwardPlan:
    """Plan the blocked backward pass of ``p`` (``L``, ``S`` > 0).

    Tiles hold about :data:`TILE_BYTES` of scores per batch element, like the forward's (on
    a GPU, the forward's blocks, :data:`GPU_TILE_BYTES` for the whole batch). By
    default a tile holds whole rows (all ``S`` keys, and as many query rows as fit) when at
    least :data:`MIN_ROWS` rows fit (and at least :data:`MIN_ROWS_RESTRICTED` rows where
    the restrictions bound the keys); otherwise, or when ``block_k`` is given, the blocks are
    the forward's (:func:`choose_block_sizes`). The key grid is the key block, or
    :data:`GRID_RESTRICTED` when the restrictions make query blocks reach different keys and
    ``block_k`` is not given; tiles are then runs of grid blocks at most ``block_k``
    (rounded up to the grid) wide.
    """
    bq, bk = choose_block_sizes(p, block_q, block_k)  # also validates the overrides
    budget = TILE_BYTES // p.itemsize
    # on a GPU the forward's blocks already hold whole rows of the whole batch
    if block_k is None and not plans_for_gpu(p) and budget >= p.S * MIN_ROWS:
        bk = p.S
        fit = budget // p.S
        if r.bounds_keys:  # most tiles hold a part of their rows' keys
            fit = max(fit, _rows_by_reach(r, budget))
        bq = min(block_q or balanced(p.L, max(BLOCK_ALIGN, fit)), p.L)
    grid = bk if block_k is not None or not r.bounds_keys else min(bk, GRID_RESTRICTED)
    width = -(-bk // grid) * grid
    blocks = []
    for q0 in range(0, p.L, bq):
        rows = slice(q0, min(q0 + bq, p.L))
        lo, hi = r.key_range(rows.start, rows.stop)
        tiles: tuple[tuple[int, int], ...] = ()
        if lo < hi:
            c0 = lo // grid * grid
            c1 = min(p.S, -(-hi // grid) * grid)
            tiles = tuple(
                (a, min(a + width, c1))
                for a in range(c0, c1, width)
                if r.classify(rows, slice(a, min(a + width, c1))) is not TileKind.EMPTY
            )
        blocks.append(BackwardBlock(rows.start, rows.stop, tiles))
    return BackwardPlan(bq, grid, width, tuple(blocks))
