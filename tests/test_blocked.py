"""The blocked (FlashAttention-style) implementation: oracle agreement with many small tiles,
the tile plan (skipped blocks, full tiles), O(block) memory, block sizes and the NumPy pool.
"""

from __future__ import annotations

import dataclasses
import tracemalloc
import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

import sdpa_array
from sdpa_array import reference
from sdpa_array._arrays import parallel
from sdpa_array._arrays.compat import array_namespace
from sdpa_array._kernels import blocked, tiling
from sdpa_array._kernels.restrictions import Restrictions, TileKind
from sdpa_array._plan import dispatch as _dispatch
from sdpa_array._problem.band import Band
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import validate
from tests.helpers import check_against_oracle
from tests.libraries import SHAPE_COMPILING_LIBRARIES

#: The generic kernels' numerics, the same code as on NumPy, torch and array-api-strict (the
#: default sessions); on JAX (a compilation per new shape) and Dask (a graph per call) they
#: run in `nox -s tests-slow`, which CI runs. JAX's and Dask's own paths (autodiff, jit, the
#: Dask graph) are tested by default in test_autograd, test_compositions and test_dask_graph.
pytestmark = pytest.mark.slow_on("jax", "dask")


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def use_blocks(monkeypatch, block_q, block_k):
    """Make ``check_against_oracle``'s library calls pass these block sizes (the oracle
    takes no such keywords)."""
    original = sdpa_array.scaled_dot_product_attention

    def attention(*args, **kwargs):
        return original(*args, block_q=block_q, block_k=block_k, **kwargs)

    monkeypatch.setattr(sdpa_array, "scaled_dot_product_attention", attention)


# (id, q, k, v shapes, options, mask shape, bias shape, (block_q, block_k)); lengths are not
# multiples of the tiny blocks, so there are ragged last blocks, many tiles, partial tiles on
# the diagonals and skipped tiles. (The automatic sizes, one tile here, run in the feature
# matrix of test_attention.py.)
CASES = [
    ("plain", (2, 2, 11, 4), (2, 2, 13, 4), (2, 2, 13, 3), {}, None, None, (3, 5)),
    ("mask+bias", (2, 2, 10, 4), (2, 2, 12, 4), (2, 2, 12, 4), {}, (2, 1, 10, 12), (12,), (5, 3)),
    (
        "causal-top-left-L<S",
        (1, 2, 9, 4),
        (1, 2, 17, 4),
        (1, 2, 17, 4),
        {"is_causal": True},
        None,
        None,
        (2, 3),
    ),
    (
        "causal-bottom-right-L>S",
        (1, 2, 17, 4),
        (1, 2, 9, 4),
        (1, 2, 9, 4),
        {"is_causal": True, "alignment": "bottom_right"},
        None,
        None,
        (3, 2),
    ),
    (
        "window-both-sides",
        (1, 1, 23, 4),
        (1, 1, 23, 4),
        (1, 1, 23, 4),
        {"window": (4, 3)},
        (23, 23),
        None,
        (4, 4),
    ),
    (
        "window-bottom-right-L<S",
        (2, 13, 4),
        (2, 29, 4),
        (2, 29, 2),
        {"window": (2, 5), "alignment": "bottom_right"},
        None,
        (2, 13, 29),
        (3, 7),
    ),
    (
        "gqa+causal+softcap+bias",
        (1, 4, 12, 8),
        (1, 2, 14, 8),
        (1, 2, 14, 8),
        {"enable_gqa": True, "is_causal": True, "alignment": "bottom_right", "softcap": 3.0},
        (4, 12, 14),
        (1, 4, 1, 14),
        (1, 5),
    ),
    (
        "broadcast-batch",
        (3, 1, 7, 4),
        (1, 2, 11, 4),
        (2, 11, 5),
        {"scale": 0.3},
        None,
        None,
        (4, 3),
    ),
]


# Slow on JAX: the geometry is the point, so every case has its own shapes and tiles, each
# compiled anew (seconds a case). JAX's blocked path with several tiles a row still runs by
# default below and in tests/test_vjp.py and tests/test_autograd.py.
@pytest.mark.slow_on(*SHAPE_COMPILING_LIBRARIES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "options", "mask_shape", "bias_shape", "blocks"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_blocked_matches_oracle(
    backend, monkeypatch, dtype, q_shape, k_shape, v_shape, options, mask_shape, bias_shape, blocks
):
    use_blocks(monkeypatch, *blocks)
    rng = np.random.default_rng(zlib.crc32(repr((q_shape, k_shape, options)).encode()))
    mask = None if mask_shape is None else rng.random(mask_shape) > 0.25
    bias = None if bias_shape is None else randn(rng, *bias_shape)
    check_against_oracle(
        backend,
        dtype,
        randn(rng, *q_shape),
        randn(rng, *k_shape),
        randn(rng, *v_shape),
        mask=mask,
        bias=bias,
        implementation="blocked",
        return_weights=False,
        **options,
    )


@pytest.mark.parametrize(
    ("block_q", "block_k"),
    # JAX compiles each tile geometry anew: there one of the two runs by default.
    [pytest.param(2, 3, marks=pytest.mark.slow_on(*SHAPE_COMPILING_LIBRARIES)), (4, 4)],
)
def test_fully_masked_rows_and_blocks(backend_dtype, monkeypatch, block_q, block_k):
    """Rows excluded by mask, by a -inf bias, and whole key blocks excluded for a row."""
    backend, dtype = backend_dtype
    use_blocks(monkeypatch, block_q, block_k)
    rng = np.random.default_rng(11)
    q, k, v = randn(rng, 2, 9, 4), randn(rng, 2, 10, 4), randn(rng, 2, 10, 3)
    mask = rng.random((2, 9, 10)) > 0.3
    mask[0, 1] = False  # a whole row, by the mask
    mask[0, 2, :6] = False  # the first key blocks of a row: the running max starts late
    bias = randn(rng, 2, 9, 10)
    bias[1, 3] = -np.inf  # a whole row, by the bias
    out, _, lse = check_against_oracle(
        backend,
        dtype,
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        implementation="blocked",
        return_weights=False,
    )
    for row in ((0, 1), (1, 3)):
        assert np.all(reference.to_numpy(out)[row] == 0)
        assert reference.to_numpy(lse)[row] == -np.inf


def test_online_softmax_rescales_large_logits(backend_dtype, monkeypatch):
    """Scores in the thousands, rising from block to block: every block rescales."""
    backend, dtype = backend_dtype
    use_blocks(monkeypatch, 4, 3)
    rng = np.random.default_rng(12)
    q = randn(rng, 2, 6, 16) * 40.0
    k = randn(rng, 2, 13, 16) * 40.0 * np.linspace(0.2, 1.0, 13)[:, None]
    v = randn(rng, 2, 13, 4)
    _, _, lse = check_against_oracle(
        backend,
        dtype,
        q,
        k,
        v,
        scale=1.0,
        implementation="blocked",
        return_weights=False,
    )
    assert np.abs(reference.to_numpy(lse)).max() > 1000.0


def test_return_weights_falls_back_to_materialized(backend):
    rng = np.random.default_rng(13)
    q, k, v = (backend.asarray(randn(rng, 2, 5, 3), "float32") for _ in range(3))
    blocked = sdpa_array.scaled_dot_product_attention(
        q, k, v, return_weights=True, implementation="blocked", block_q=2, block_k=2
    )
    materialized = sdpa_array.scaled_dot_product_attention(
        q, k, v, return_weights=True, implementation="materialized"
    )
    for a, b in zip(blocked, materialized, strict=True):
        np.testing.assert_array_equal(reference.to_numpy(a), reference.to_numpy(b))


# ----------------------------------------------------------------------------------------
# the tile plan: pure Python, checked against an explicit positional mask
# ----------------------------------------------------------------------------------------


def positional_mask(pos: Band) -> np.ndarray:
    i = np.arange(pos.L)[:, None]
    j = np.arange(pos.S)[None, :]
    rel = j - i - pos.offset
    ok = np.ones((pos.L, pos.S), dtype=bool)
    if pos.is_causal:
        ok &= rel <= 0
    if pos.right is not None:
        ok &= rel <= pos.right
    if pos.left is not None:
        ok &= rel >= -pos.left
    return ok


@st.composite
def plans(draw):
    L = draw(st.integers(1, 40))
    S = draw(st.integers(1, 40))
    side = st.none() | st.integers(0, 12)
    pos = Band(
        L=L,
        S=S,
        is_causal=draw(st.booleans()),
        left=draw(side),
        right=draw(side),
        offset=draw(st.sampled_from([0, S - L])),
    )
    return pos, draw(st.integers(1, 12)), draw(st.integers(1, 12))


def band_plan(pos: Band, bq: int, bk: int) -> list[tiling.QueryBlock]:
    """The forward plan of a call whose only restriction is ``pos``."""
    return tiling.plan_blocks(Restrictions((pos,), pos.L, pos.S), bq, bk)


@given(plans())
def test_plan_covers_every_admissible_pair_once(plan):
    pos, bq, bk = plan
    ok = positional_mask(pos)
    covered = np.zeros((pos.L, pos.S), dtype=int)
    blocks = band_plan(pos, bq, bk)
    assert [(b.start, b.stop) for b in blocks] == [
        (q0, min(q0 + bq, pos.L)) for q0 in range(0, pos.L, bq)
    ]
    for block in blocks:
        for tile in block.tiles:
            assert 0 <= tile.start < tile.stop <= pos.S
            assert tile.stop - tile.start <= bk
            region = ok[block.start : block.stop, tile.start : tile.stop]
            assert region.any(), "a tile with no admissible pair was visited"
            assert tile.full == bool(region.all())
            assert tile.kind is (TileKind.FULL if region.all() else TileKind.PARTIAL)
            covered[block.start : block.stop, tile.start : tile.stop] += 1
    assert covered.max(initial=0) <= 1
    np.testing.assert_array_equal(covered[ok], 1)


def test_causal_plan_visits_about_half_the_tiles():
    pos = Band(L=1024, S=1024, is_causal=True, left=None, right=None, offset=0)
    blocks = band_plan(pos, 64, 64)
    area = sum((b.stop - b.start) * (t.stop - t.start) for b in blocks for t in b.tiles)
    assert area == 1024 * 1024 // 2 + 1024 * 64 // 2
    partial = [t for b in blocks for t in b.tiles if not t.full]
    assert len(partial) == 16  # one diagonal tile per query block needs the positional where


def test_window_plan_skips_blocks_on_both_sides():
    pos = Band(L=100, S=100, is_causal=False, left=10, right=5, offset=0)
    blocks = band_plan(pos, 10, 10)
    middle = blocks[5]  # queries 50..59 reach keys 40..64
    assert (middle.tiles[0].start, middle.tiles[-1].stop) == (40, 65)
    assert sum(t.stop - t.start for b in blocks for t in b.tiles) < 100 * len(blocks) // 3


def test_blocked_computes_only_the_planned_tiles(monkeypatch):
    """Count score tiles actually formed: causal skips every tile above the diagonal."""
    formed = []

    def counting(original):
        def formed_tile(p, ops, q_rows, rows, cols, **kwargs):
            formed.append((rows.start, rows.stop, cols.start, cols.stop))
            return original(p, ops, q_rows, rows, cols, **kwargs)

        return formed_tile

    # the online softmax and the fixed reference (score_bound) form tiles through these
    for name in ("tile_scores_and_maxima", "fixed_weights"):
        monkeypatch.setattr(blocked, name, counting(getattr(blocked, name)))
    rng = np.random.default_rng(14)
    q, k, v = randn(rng, 3, 40, 4), randn(rng, 3, 40, 4), randn(rng, 3, 40, 4)
    sdpa_array.scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation="blocked", block_q=16, block_k=4
    )
    assert formed, "the blocked implementation formed no tile"
    for q0, q1, k0, _ in formed:
        assert k0 <= q1 - 1, f"tile {q0}:{q1} x {k0}: is entirely above the diagonal"
    band = Band(L=40, S=40, is_causal=True, left=None, right=None, offset=0)
    # bounded scores take the fixed reference, whose tiles are cut to the rows that reach
    # their keys (the first row, which admits one key, is a block of its own); the 3 batch
    # elements share one tile (they fit the tile budget together)
    planned = tiling.plan_blocks(
        Restrictions((band,), 40, 40), 16, 4, cut_rows=True, narrow_rows=True
    )
    assert planned[0] == tiling.QueryBlock(0, 1, planned[0].tiles, running_max=True)
    assert sorted(formed) == sorted(
        (*(t.rows or (b.start, b.stop)), t.start, t.stop) for b in planned for t in b.tiles
    )
    whole = band_plan(band, 16, 4)  # the same tiles with their blocks' rows
    pairs = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in formed)
    assert pairs < sum((b.stop - b.start) * (t.stop - t.start) for b in whole for t in b.tiles)


# ----------------------------------------------------------------------------------------
# memory, block sizes, the thread pool
# ----------------------------------------------------------------------------------------


def test_memory_is_o_block_not_o_scores():
    """tracemalloc sees NumPy's buffers: the peak stays far below one score matrix."""
    L = S = 8192
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((1, n, 8), dtype=np.float32) for n in (L, S, S))
    score_bytes = L * S * 4  # 256 MiB for the materialized path
    tracemalloc.start()
    try:
        out = sdpa_array.scaled_dot_product_attention(q, k, v, implementation="blocked")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (1, L, 8)
    tiles_alive = 3 * parallel.get_num_threads() * tiling.TILE_BYTES  # s, exp(s), slack
    assert peak < tiles_alive + 8 * q.nbytes
    assert peak < score_bytes / 8


def test_auto_uses_blocked_for_large_score_matrices(monkeypatch):
    calls = []
    row = _dispatch.IMPLEMENTATIONS["blocked"]

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return row.forward(*args, **kwargs)

    monkeypatch.setitem(_dispatch.IMPLEMENTATIONS, "blocked", dataclasses.replace(row, forward=spy))
    rng = np.random.default_rng(16)
    big = rng.standard_normal((1, 2048, 4), dtype=np.float32)  # 16 MiB of float32 scores
    sdpa_array.scaled_dot_product_attention(big, big, big)
    assert len(calls) == 1
    small = big[:, :64]
    sdpa_array.scaled_dot_product_attention(small, small, small)
    assert len(calls) == 1
    sdpa_array.scaled_dot_product_attention(small, small, small, block_q=16)
    assert len(calls) == 2


def problem(L, S, dtype=np.float32):
    q = np.zeros((1, L, 8), dtype=dtype)
    k = np.zeros((1, S, 8), dtype=dtype)
    return validate(q, k, k, Options())


def test_automatic_block_sizes():
    assert tiling.choose_block_sizes(problem(5, 7)) == (5, 7)
    bq, bk = tiling.choose_block_sizes(problem(4096, 4096))
    assert bq * bk * 4 <= tiling.TILE_BYTES
    assert bk == tiling.MAX_BLOCK_K
    assert bq >= 512
    bq64, bk64 = tiling.choose_block_sizes(problem(4096, 4096, np.float64))
    assert bq64 * bk64 * 8 <= tiling.TILE_BYTES
    # balanced: no sliver of a last block
    _, bk = tiling.choose_block_sizes(problem(64, tiling.MAX_BLOCK_K + 4))
    assert bk % tiling.BLOCK_ALIGN == 0
    assert (tiling.MAX_BLOCK_K + 4) % bk > bk // 2
    assert tiling.choose_block_sizes(problem(100, 100), 7, None)[0] == 7
    assert tiling.choose_block_sizes(problem(100, 100), 1000, 1000) == (100, 100)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_block_sizes_are_validated(bad):
    q = np.zeros((4, 3))
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        sdpa_array.scaled_dot_product_attention(q, q, q, implementation="blocked", block_q=bad)
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        sdpa_array.scaled_dot_product_attention(q, q, q, block_k=bad)


def test_block_sizes_belong_to_blocked():
    q = np.zeros((4, 3))
    with pytest.raises(ValueError, match="apply to the blocked implementation"):
        sdpa_array.scaled_dot_product_attention(q, q, q, implementation="materialized", block_q=2)


def test_thread_pool_gives_identical_results(monkeypatch):
    rng = np.random.default_rng(17)
    q, k, v = randn(rng, 2, 3, 50, 8), randn(rng, 2, 3, 60, 8), randn(rng, 2, 3, 60, 8)
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(parallel, "_override", threads)
        results.append(
            sdpa_array.scaled_dot_product_attention(
                q, k, v, is_causal=True, return_lse=True, block_q=7, block_k=9
            )
        )
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_thread_configuration(monkeypatch):
    monkeypatch.setattr(parallel, "_override", None)
    monkeypatch.setenv(parallel.ENV_VAR, "3")
    assert parallel.get_num_threads() == 3
    monkeypatch.setenv(parallel.ENV_VAR, "zero")
    with pytest.raises(ValueError, match=parallel.ENV_VAR):
        parallel.get_num_threads()
    monkeypatch.delenv(parallel.ENV_VAR)
    assert 1 <= parallel.get_num_threads() <= parallel.DEFAULT_MAX_THREADS
    parallel.set_num_threads(2)
    assert parallel.get_num_threads() == 2
    parallel.set_num_threads(None)
    with pytest.raises(ValueError, match="positive int"):
        parallel.set_num_threads(0)


def test_pool_takes_the_costliest_items_first(monkeypatch):
    """With costs, the pool starts the items in decreasing cost (one thread: the start
    order is the submission order) and returns the results in the items' order; a query
    block's cost is the number of scores its tiles compute."""
    import threading

    from sdpa_array._kernels.tiling import KeyTile, QueryBlock, TileKind, block_scores

    started, lock = [], threading.Lock()

    def fn(item):
        with lock:
            started.append(item)
        return item * 10

    xp = array_namespace({"x": np.zeros(1)})
    monkeypatch.setattr(parallel, "get_num_threads", lambda: 2)
    monkeypatch.setattr(parallel, "_executor", _OneWorker())
    monkeypatch.setattr(parallel, "_executor_threads", 2)
    got = parallel.map_blocks(xp, fn, [0, 1, 2, 3], costs=[1.0, 5.0, 3.0, 5.0])
    assert got == [0, 10, 20, 30]
    assert started == [1, 3, 2, 0]
    started.clear()
    assert parallel.map_blocks(xp, fn, [0, 1, 2]) == [0, 10, 20]
    assert started == [0, 1, 2]
    full = KeyTile(0, 8, TileKind.FULL)
    cut = KeyTile(8, 12, TileKind.PARTIAL, rows=(3, 5))
    assert block_scores(QueryBlock(0, 6, (full, cut))) == 6 * 8 + 2 * 4


class _OneWorker:
    """A stand-in for ``ThreadPoolExecutor`` that runs each submitted call at once."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args))
        return future


def test_pool_only_for_numpy(backend, monkeypatch):
    """Other libraries run blocks one after the other, in the calling thread."""
    import threading

    monkeypatch.setattr(parallel, "_override", 4)
    xp = backend.namespace()
    threads = set()
    parallel.map_blocks(
        array_namespace({"x": backend.asarray(np.zeros(2), "float32")}),
        lambda item: threads.add(threading.get_ident()),
        list(range(8)),
    )
    if backend.library == "numpy":
        assert threading.get_ident() not in threads
    else:
        assert threads == {threading.get_ident()}, xp.__name__


@pytest.mark.parametrize("rows", [slice(0, 4), slice(1, 3), slice(0, 2), slice(2, 4)], ids=str)
def test_where_tile_changes_only_its_region(backend, rows):
    """``inplace.where_tile`` replaces the masked entries of its rows and columns by
    ``fill`` and keeps everything else, in place or not; a condition with more batch
    elements than the scores broadcasts them."""
    from sdpa_array._arrays import inplace

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 6)).astype(np.float32)
    n = rows.stop - rows.start
    for cond in (rng.random((n, 3)) < 0.5, rng.random((2, n, 3)) < 0.5):
        lead = np.broadcast_shapes(x.shape[:-2], cond.shape[:-2])
        expected = np.broadcast_to(x, (*lead, 4, 6)).copy()
        region = expected[..., rows, 2:5]
        expected[..., rows, 2:5] = np.where(cond, region, -np.inf)
        xb = backend.asarray(x.copy(), "float32")
        xp = array_namespace({"x": xb})
        fill = xp.asarray(-np.inf, dtype=xb.dtype)
        got = inplace.where_tile(xp, xb, rows, slice(2, 5), backend.asarray(~cond), fill)
        np.testing.assert_array_equal(reference.to_numpy(got), expected)


def test_fillable_results_where_the_library_writes(backend, monkeypatch):
    """``inplace.fillable`` gives a new array of the shape asked for where the library
    writes through indexing, and ``None`` for JAX and Dask without allocating one."""
    from sdpa_array._arrays import inplace

    x = backend.asarray(np.ones((2, 3), dtype=np.float32), "float32")
    xp = array_namespace({"x": x})
    made = []
    empty = xp.empty
    monkeypatch.setattr(xp, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    out = inplace.fillable(xp, (4, 5), x.dtype, None, x)
    if backend.library in ("jax", "dask"):
        assert out is None
        assert made == []
    else:
        assert tuple(out.shape) == (4, 5)
        out[1:3, ...] = x[:, :1]
        assert bool(xp.all(out[1:3, 0] == 1))


def test_transposed_layout_keeps_the_values(backend):
    """``inplace.transposed_layout`` keeps the values; on NumPy its transposed view is
    contiguous (the layout of a transposed product), elsewhere it is the array itself."""
    from sdpa_array._arrays import inplace

    x = np.arange(24).reshape(2, 3, 4) % 5 == 0
    xb = backend.asarray(x)
    xp = array_namespace({"x": xb})
    got = inplace.transposed_layout(xp, xb)
    np.testing.assert_array_equal(reference.to_numpy(got), x)
    if backend.library == "numpy":
        assert np.swapaxes(got, -1, -2).flags.c_contiguous
    else:
        assert got is xb
