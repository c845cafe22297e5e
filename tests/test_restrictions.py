"""The restriction interface: tile classification, tile masks and the plans built on them.

Every claim is checked against the brute-force boolean grid of admissible pairs, written
here from the definition (the oracle's index arithmetic): a tile is *empty* when no pair is
admissible, *full* when every pair is, *partial* otherwise; a classification may be
conservative (partial where the data would allow more) but never wrong.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import hypothesis.strategies as st
import numpy as np
import pytest
from array_api_compat import numpy as xnp
from hypothesis import given

from sdpa_array._kernels.restrictions import DenseMask, Restrictions, TileKind
from sdpa_array._kernels.tiling import plan_backward, plan_blocks
from sdpa_array._problem.band import Band
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import validate
from sdpa_array.reference import intermediates

lengths = st.integers(1, 24)
sides = st.one_of(st.none(), st.integers(0, 6))


def _band(L, S, is_causal, left, right, bottom_right):
    offset = S - L if bottom_right else 0
    return Band(L=L, S=S, is_causal=is_causal, left=left, right=right, offset=offset)


def _grid(L, S, is_causal, left, right, bottom_right):
    """Admissible pairs by the oracle's own definition."""
    q, k = np.zeros((L, 1)), np.zeros((S, 1))
    window = None if left is None and right is None else (left, right)
    alignment = "bottom_right" if bottom_right else "top_left"
    return intermediates(q, k, k, is_causal=is_causal, window=window, alignment=alignment)[
        "allowed"
    ]


def _kind(block: np.ndarray) -> TileKind:
    if not block.any():
        return TileKind.EMPTY
    return TileKind.FULL if block.all() else TileKind.PARTIAL


def _band_tile(args, tile):
    """The admissible grid, the band's restrictions and the tile's rows and columns."""
    L, S = args[:2]
    q0, nq, k0, nk = tile
    rows = slice(min(q0, L - 1), min(q0 + nq, L))
    cols = slice(min(k0, S - 1), min(k0 + nk, S))
    return _grid(*args), Restrictions((_band(*args),), L, S), rows, cols


band_args = st.tuples(lengths, lengths, st.booleans(), sides, sides, st.booleans())
tiles = st.tuples(st.integers(0, 23), st.integers(1, 8), st.integers(0, 23), st.integers(1, 8))


@given(band_args, tiles)
def test_band_classifies_exactly(args, tile):
    """For the band (causal/window) the classification is exact, not only conservative."""
    grid, r, rows, cols = _band_tile(args, tile)
    assert r.classify(rows, cols) is _kind(grid[rows, cols])
    mask = r.tile_mask(xnp, "cpu", rows, cols)
    if r.classify(rows, cols) is TileKind.FULL:
        assert mask is None
    else:
        np.testing.assert_array_equal(
            np.broadcast_to(mask, grid[rows, cols].shape), grid[rows, cols]
        )


@given(band_args, st.integers(1, 9))
def test_key_range_and_full_range_bound_every_query(args, block):
    L, S = args[:2]
    grid = _grid(*args)
    r = Restrictions((_band(*args),), L, S)
    for q0 in range(0, L, block):
        q1 = min(q0 + block, L)
        lo, hi = r.key_range(q0, q1)
        outside = np.ones(S, dtype=bool)
        outside[lo:hi] = False
        assert not grid[q0:q1, outside].any()  # nothing admissible outside the key range
        f_lo, f_hi = r.full_range(q0, q1)
        assert grid[q0:q1, f_lo:f_hi].all()  # everything admissible inside the full range


@given(band_args, st.integers(1, 9), st.integers(1, 9), st.data())
def test_forward_plan_covers_every_admissible_pair_once(args, bq, bk, data):
    """With a dense mask beside the band: empty tiles are never planned, full ones need no
    mask, and the planned tiles cover every admissible pair exactly once."""
    L, S = args[:2]
    dense = np.asarray(data.draw(st.lists(st.booleans(), min_size=L * S, max_size=L * S)))
    dense = dense.reshape(L, S)
    band_grid = _grid(*args)
    r = Restrictions((_band(*args), DenseMask(dense, S)), L, S)
    covered = np.zeros((L, S), dtype=int)
    for block in plan_blocks(r, bq, bk):
        rows = slice(block.start, block.stop)
        for tile in block.tiles:
            cols = slice(tile.start, tile.stop)
            assert band_grid[rows, cols].any()  # the band does not empty a planned tile
            assert tile.kind is TileKind.PARTIAL  # a dense mask is data: never full
            covered[rows, cols] += 1
    assert covered.max(initial=0) <= 1
    assert (covered[band_grid] == 1).all()


@given(band_args, st.integers(0, 23), st.integers(1, 9))
def test_query_range_bounds_every_key(args, k0, width):
    """No query outside ``query_range`` attends a key of the range; a dense mask says
    nothing (every query may)."""
    L, S = args[:2]
    grid = _grid(*args)
    k0 = min(k0, S - 1)
    k1 = min(k0 + width, S)
    r = Restrictions((_band(*args), DenseMask(np.ones((L, S), dtype=bool), S)), L, S)
    lo, hi = r.query_range(k0, k1)
    outside = np.ones(L, dtype=bool)
    outside[lo:hi] = False
    assert not grid[outside, k0:k1].any()


@given(band_args, st.integers(0, 23), st.integers(0, 9))
def test_band_full_rows_are_exactly_the_rows_attending_every_key(args, k0, width):
    """``Band.full_rows`` is the set of queries that attend every key of the range (for a
    band an interval), by the oracle's grid; every query for no key."""
    L, S = args[:2]
    grid = _grid(*args)
    k0 = min(k0, S - 1)
    k1 = min(k0 + width, S)
    lo, hi = _band(*args).full_rows(k0, k1)
    expected = grid[:, k0:k1].all(axis=1)
    got = np.zeros(L, dtype=bool)
    got[lo:hi] = True
    np.testing.assert_array_equal(got, expected)


@given(band_args, tiles, st.booleans())
def test_partial_rows_leave_out_only_rows_attending_every_column(args, tile, dense):
    """Rows of a tile outside ``partial_rows`` attend every column of it, and they are a run
    at one end of the tile (or all of it); with a member that has no ``full_rows`` (a dense
    mask) every row is kept."""
    grid, r, rows, cols = _band_tile(args, tile)
    if dense:
        L, S = args[:2]
        r = Restrictions((*r.members, DenseMask(np.ones((L, S), dtype=bool), S)), L, S)
    part = r.partial_rows(rows, cols)
    assert rows.start <= part.start <= part.stop <= rows.stop
    assert part.start == rows.start or part.stop == rows.stop
    if dense:
        assert part == rows
    kept = np.zeros(grid.shape[0], dtype=bool)
    kept[rows] = True
    kept[part] = False
    assert grid[kept, cols].all()
    if grid[rows, cols].all() and not dense:
        assert part.start == part.stop


#: Bands (``band_args`` order) whose every tile the two tests below go through: causal,
#: bottom-right causal with L != S, windows on both sides and on one side each.
SMALL_BANDS = [
    (9, 9, True, None, None, False),
    (6, 10, True, None, None, True),
    (10, 7, False, 2, 1, False),
    (9, 9, False, 3, None, False),
    (9, 9, False, None, 2, True),
]


def _every_tile(L: int, S: int):
    for r0 in range(L):
        for r1 in range(r0 + 1, L + 1):
            for c0 in range(S):
                for c1 in range(c0 + 1, S + 1):
                    yield slice(r0, r1), slice(c0, c1)


@pytest.mark.parametrize("args", SMALL_BANDS, ids=str)
def test_equal_mask_keys_mean_equal_masks(args):
    """Over every tile of small bands: tiles with equal ``mask_key`` have equal masks (the
    kernels build such a mask once per call), the oracle's."""
    grid = _grid(*args)
    r = Restrictions((_band(*args),), *args[:2])
    seen: dict = {}
    for rows, cols in _every_tile(*args[:2]):
        mask = r.tile_mask(xnp, "cpu", rows, cols)
        if mask is None:
            continue
        np.testing.assert_array_equal(mask, grid[rows, cols])
        first = seen.setdefault(r.mask_key(rows, cols), mask)
        np.testing.assert_array_equal(first, mask)
    assert len(seen) > 1


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("args", SMALL_BANDS, ids=str)
def test_excluded_fills_exactly_the_excluded_pairs(args, transposed):
    """Over every tile of small bands, the kernels' masking of a tile
    (``operands._excluded``: partial columns, then partial rows, the masks kept for the
    call, the tile's layout) fills exactly the pairs the oracle excludes."""
    from sdpa_array._kernels import operands

    L, S = args[:2]
    grid = _grid(*args)
    r = Restrictions((_band(*args),), L, S)
    p = validate(np.zeros((L, 2), np.float32), *(np.zeros((S, 2), np.float32),) * 2, Options())
    ops = SimpleNamespace(restrictions=r, masks={})
    cut = 0
    for rows, cols in _every_tile(L, S):
        tile = np.ones((cols.stop - cols.start, rows.stop - rows.start), np.float32)
        tile = tile.T if transposed else np.ascontiguousarray(tile.T)
        (got,) = operands._excluded(p, ops, rows, cols, (tile,), 0.0, transposed=transposed)
        np.testing.assert_array_equal(got, grid[rows, cols])
        masked = r.partial_columns(rows, cols)
        cut += masked.start < masked.stop and r.partial_rows(rows, masked) != rows
    assert ops.masks  # masks were kept
    assert cut  # and rows were left out of some tiles' masks


long_band_args = st.tuples(
    st.integers(1, 90), st.integers(1, 90), st.booleans(), sides, sides, st.booleans()
)


@given(st.one_of(band_args, long_band_args), st.integers(1, 64), st.integers(1, 9))
def test_forward_plan_with_cut_rows_covers_every_admissible_pair_once(args, bq, bk):
    """Tiles cut to rows: inside their block, classified exactly for their rows, and
    together covering every admissible pair once (rows left out attend none of the keys);
    a band's partial tile keeps its full rows (its mask leaves them out)."""
    L, S = args[:2]
    grid = _grid(*args)
    r = Restrictions((_band(*args),), L, S)
    covered = np.zeros((L, S), dtype=int)
    for block in plan_blocks(r, bq, bk, cut_rows=True):
        for tile in block.tiles:
            a, b = tile.rows or (block.start, block.stop)
            assert block.start <= a < b <= block.stop
            rows, cols = slice(a, b), slice(tile.start, tile.stop)
            assert tile.kind is _kind(grid[rows, cols])
            assert tile.kind is not TileKind.EMPTY
            covered[rows, cols] += 1
        starts = [tile.start for tile in block.tiles]
        assert len(set(starts)) == len(starts)  # no columns cut into two tiles of rows
    assert covered.max(initial=0) <= 1
    assert (covered[grid] == 1).all()


@given(st.one_of(band_args, long_band_args), st.integers(1, 64), st.integers(1, 9))
def test_forward_plan_gives_rows_admitting_one_key_a_running_maximum(args, bq, bk):
    """With ``narrow_rows`` every row admitting at most one key is in a block marked
    ``running_max`` (whose tiles are not cut to rows), and no other row is; the blocks
    still cover the queries in order and every admissible pair once."""
    L, S = args[:2]
    grid = _grid(*args)
    r = Restrictions((_band(*args),), L, S)
    blocks = plan_blocks(r, bq, bk, cut_rows=True, narrow_rows=True)
    assert [b.start for b in blocks] == [0, *(b.stop for b in blocks[:-1])]
    assert blocks[-1].stop == L
    covered = np.zeros((L, S), dtype=int)
    for block in blocks:
        narrow = grid[block.start : block.stop].sum(axis=1) <= 1
        assert narrow.all() if block.running_max else not narrow.any()
        for tile in block.tiles:
            assert tile.rows is None or not block.running_max
            a, b = tile.rows or (block.start, block.stop)
            covered[a:b, tile.start : tile.stop] += grid[a:b, tile.start : tile.stop]
    assert (covered == grid).all()


@given(band_args, st.sampled_from([None, 2, 3]), st.sampled_from([None, 2, 5]))
def test_backward_plan_reaches_every_admissible_key(args, bq, bk):
    L, S, is_causal, left, right, bottom_right = args
    grid = _grid(*args)
    q, k = np.zeros((L, 2)), np.zeros((S, 2))
    p = validate(
        q,
        k,
        k,
        Options(
            is_causal=is_causal,
            window=None if left is None and right is None else (left, right),
            alignment="bottom_right" if bottom_right else "top_left",
        ),
    )
    r = Restrictions((p.band,) if p.band.restricts else (), L, S)
    covered = np.zeros((L, S), dtype=int)
    for block in plan_backward(p, r, bq, bk).blocks:
        for a, b in block.tiles:
            covered[block.start : block.stop, a:b] += 1
    assert covered.max(initial=0) <= 1
    assert (covered[grid] == 1).all()


def test_dense_mask_is_partial_and_sliced_per_batch():
    mask = np.array([[[True, False]], [[False, False]]])  # (2, 1, 2): broadcast rows
    r = Restrictions((DenseMask(mask, 2),), 3, 2)
    assert r.classify(slice(0, 3), slice(0, 2)) is TileKind.PARTIAL
    assert not r.bounds_keys
    np.testing.assert_array_equal(
        r.at((1,)).tile_mask(xnp, "cpu", slice(1, 3), slice(0, 2)), mask[1]
    )
    assert Restrictions((), 3, 2).tile_mask(xnp, "cpu", slice(0, 3), slice(0, 2)) is None


@given(band_args, tiles)
def test_partial_columns_leave_out_only_full_columns(args, tile):
    """Columns of a tile outside ``partial_columns`` are admissible for every row of it, and
    it is a run at one end of the tile, or the whole tile."""
    grid, r, rows, cols = _band_tile(args, tile)
    part = r.partial_columns(rows, cols)
    assert cols.start <= part.start <= part.stop <= cols.stop
    assert part.start == cols.start or part.stop == cols.stop
    kept = np.ones(grid.shape[-1], dtype=bool)
    kept[: cols.start] = kept[cols.stop :] = kept[part] = False
    assert grid[rows, kept].all()
    if r.classify(rows, cols) is TileKind.FULL:
        assert part.start == part.stop


def test_band_plans_are_planned_once(monkeypatch):
    """A plan of position bands only is kept: the same restrictions again (an equal new
    object, as each call builds) take the kept plan, equal to a new one; a dense mask's
    restrictions (arrays among them) are planned each time."""
    from sdpa_array._kernels import tiling

    band = Band(L=300, S=300, is_causal=True, left=40, right=None, offset=0)
    first = plan_blocks(Restrictions((band,), 300, 300), 64, 32, cut_rows=True)
    planned = []
    monkeypatch.setattr(tiling, "_plan", lambda *a: planned.append(a) or [])
    again = plan_blocks(Restrictions((dataclasses.replace(band),), 300, 300), 64, 32, cut_rows=True)
    assert again == first
    assert planned == []
    mask = DenseMask(np.ones((300, 300), dtype=bool), 300)
    plan_blocks(Restrictions((mask,), 300, 300), 64, 32)
    assert len(planned) == 1


def _document_restrictions(kind: str, n: int, length: int, heads: int = 2):
    """The restrictions of ``n`` documents of ``length`` packed in one sequence, as the
    blocked kernel prepares them, with its block sizes."""
    from sdpa_array import mods
    from sdpa_array._kernels.operands import prepare
    from sdpa_array._kernels.tiling import choose_block_sizes
    from sdpa_array._problem.problem import Inputs

    q = np.zeros((1, heads, n * length, 16), dtype=np.float32)
    doc = np.repeat(np.arange(n), length)
    options = {
        "mask_mod": Options(mask_mod=mods.document(doc, doc)),
        "segment_ids": Options(segment_ids=(doc, doc)),
    }[kind]
    p = validate(q, q, q, options)
    return prepare(p, Inputs.of(q, q, q, options, p)).restrictions, choose_block_sizes(p)


@pytest.mark.parametrize("kind", ["mask_mod", "segment_ids"])
@pytest.mark.parametrize(("n", "length"), [(8, 256), (4, 512), (16, 256)])
def test_documents_plan_visits_only_their_own_tiles(kind, n, length):
    """Packed documents cost the documents as a batch: with the rows cut to each tile's
    queries, every tile the forward plan visits is one document's keys against its own
    queries, whole (no mask), whatever the query block spans; no tile of the plan is empty."""
    r, (bq, bk) = _document_restrictions(kind, n, length)
    r = r.at((0, 0)) if r.per_sequence else r
    blocks = plan_blocks(r, bq, bk, cut_rows=True)
    tiles = [(b, t) for b in blocks for t in b.tiles]
    visited = sum(
        (t.stop - t.start) * ((t.rows or (b.start, b.stop))[1] - (t.rows or (b.start, b.stop))[0])
        for b, t in tiles
    )
    assert visited == n * length * length  # the documents' own pairs, each once
    assert all(t.kind is TileKind.FULL for _, t in tiles)
    for b, t in tiles:
        rows = t.rows or (b.start, b.stop)
        assert rows[0] // length == (rows[1] - 1) // length == t.start // length


@pytest.mark.parametrize("kind", ["mask_mod", "segment_ids"])
def test_no_plan_keeps_an_empty_tile(kind):
    r, (bq, bk) = _document_restrictions(kind, 3, 100)
    r = r.at((0, 0)) if r.per_sequence else r
    for size in [(bq, bk), (64, 32), (128, 48)]:
        for block in plan_blocks(r, *size, cut_rows=True):
            for t in block.tiles:
                rows = slice(*(t.rows or (block.start, block.stop)))
                assert r.classify(rows, slice(t.start, t.stop)) is not TileKind.EMPTY


def test_sequences_restrictions_plan_once_for_every_head(monkeypatch):
    """Segment ids admit the same pairs in every head: the blocked forward plans each
    sequence once, not once per head."""
    import sdpa_array
    from sdpa_array._kernels import blocked

    calls = []
    real = blocked.plan_blocks
    monkeypatch.setattr(blocked, "plan_blocks", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = np.random.default_rng(0).standard_normal((2, 4, 512, 16)).astype(np.float32)
    doc = np.repeat(np.arange(4), 128)
    sdpa_array.scaled_dot_product_attention(
        q, q, q, segment_ids=(doc, doc), implementation="blocked", block_q=64, block_k=64
    )
    assert 1 <= len(calls) <= 2  # the two sequences (batch elements), never the 8 heads
