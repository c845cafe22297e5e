"""``explain()`` reports the blocked forward's and backward's tiles: visited (full,
partial) and skipped.

Each report is checked against the admissible pairs computed here, densely, from the
restrictions' definitions: a skipped tile holds no admissible pair, the computed share is
at least the admissible one, block-aligned documents compute exactly their own pairs, and
an unrestricted call visits every tile without a mask.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_array as sa
from sdpa_array import mods


def _admissible(seg_q: np.ndarray, seg_k: np.ndarray, causal: bool) -> np.ndarray:
    """``(L, S)``: whether query ``i`` may attend key ``j`` (same segment; causal: top-left,
    ``j <= i``)."""
    allowed = seg_q[:, None] == seg_k[None, :]
    if causal:
        allowed &= np.arange(len(seg_k))[None, :] <= np.arange(len(seg_q))[:, None]
    return allowed


def _cells_with_pairs(allowed: np.ndarray, bq: int, bk: int) -> int:
    L, S = allowed.shape
    return sum(
        bool(allowed[i : i + bq, j : j + bk].any())
        for i in range(0, L, bq)
        for j in range(0, S, bk)
    )


def _explained_segments(
    lengths: list[int], causal: bool, blocks: tuple[int | None, int | None], heads: int
) -> tuple[np.ndarray, int, sa.Explanation]:
    """Segment ids of documents of ``lengths``, their total and ``explain()`` of a blocked
    call of ``heads`` heads restricted to them."""
    seg = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    n = len(seg)
    q = np.zeros((1, heads, n, 8), np.float32)
    bq, bk = blocks
    explained = sa.explain(
        q, q, q, segment_ids=(seg[None], seg[None]), is_causal=causal,
        implementation="blocked", block_q=bq, block_k=bk,
    )  # fmt: skip
    return seg, n, explained


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 96), min_size=1, max_size=6),
    causal=st.booleans(),
    blocks=st.sampled_from([(16, 16), (32, 16), (16, 64), (64, 32)]),
    heads=st.integers(1, 3),
)
def test_skipped_tiles_hold_no_admissible_pair(lengths, causal, blocks, heads):
    seg, n, explained = _explained_segments(lengths, causal, blocks, heads)
    tiles = explained.forward_tiles
    bq, bk = blocks
    assert tiles is not None
    assert tiles.block_q <= bq  # at most the query and key lengths
    assert tiles.block_k <= bk
    bq, bk = tiles.block_q, tiles.block_k
    allowed = _admissible(seg, seg, causal)
    grid = math.ceil(n / bq) * math.ceil(n / bk)
    assert tiles.grid == heads * grid
    # every grid tile with an admissible pair is visited: skipped ones hold none
    assert tiles.skipped <= heads * (grid - _cells_with_pairs(allowed, bq, bk))
    assert allowed.mean() - 1e-12 <= tiles.fraction <= 1.0
    assert tiles.full + tiles.partial >= 1


def _documents(docs: int, size: int, how: str) -> tuple[np.ndarray, dict]:
    """Queries of two heads for ``docs`` packed documents of ``size`` tokens, and the
    options that restrict them to their documents ``how`` (``mask_mod`` or ``segment_ids``)."""
    seg = np.repeat(np.arange(docs), size).astype(np.int32)
    q = np.zeros((1, 2, docs * size, 8), np.float32)
    if how == "mask_mod":
        return q, {"mask_mod": mods.document(seg, seg)}
    return q, {"segment_ids": (seg[None], seg[None])}


@pytest.mark.parametrize(("docs", "size"), [(8, 512), (16, 256), (4, 1024)])
@pytest.mark.parametrize("how", ["mask_mod", "segment_ids"])
def test_block_aligned_documents_compute_only_their_pairs(docs, size, how):
    q, options = _documents(docs, size, how)
    tiles = sa.explain(q, q, q, implementation="blocked", block_q=256, block_k=256, **options)
    tiles = tiles.forward_tiles
    assert tiles is not None
    assert tiles.partial == 0
    assert tiles.fraction == pytest.approx(1 / docs)
    assert tiles.skipped == tiles.grid - 2 * docs * (size // 256) ** 2
    assert "skipped" in str(sa.explain(q, q, q, implementation="blocked", **options))


def test_an_unrestricted_call_visits_every_tile_unmasked():
    q = np.zeros((2, 3, 300, 8), np.float32)
    tiles = sa.explain(q, q, q, implementation="blocked", block_q=64, block_k=128).forward_tiles
    assert tiles is not None
    assert (tiles.skipped, tiles.partial, tiles.fraction) == (0, 0, 1.0)
    assert tiles.full == tiles.grid == 6 * 5 * 3


def test_other_implementations_report_no_tiles():
    q = np.zeros((1, 1, 16, 8), np.float32)
    assert sa.explain(q, q, q, implementation="materialized").forward_tiles is None
    assert "tiles" not in str(sa.explain(q, q, q, implementation="materialized"))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 96), min_size=1, max_size=6),
    causal=st.booleans(),
    blocks=st.sampled_from([(None, None), (16, 16), (32, 16), (16, 64), (64, 32)]),
    heads=st.integers(1, 3),
)
def test_the_backward_skips_no_block_with_an_admissible_pair(lengths, causal, blocks, heads):
    seg, n, explained = _explained_segments(lengths, causal, blocks, heads)
    tiles = explained.vjp_tiles
    assert tiles is not None
    assert 0 < tiles.width <= n
    allowed = _admissible(seg, seg, causal)
    blocks_each = math.ceil(n / tiles.block_q) * math.ceil(n / tiles.grid)
    assert tiles.blocks == heads * blocks_each
    with_pairs = _cells_with_pairs(allowed, tiles.block_q, tiles.grid)  # the backward's unit
    assert tiles.skipped <= heads * (blocks_each - with_pairs)
    assert allowed.mean() - 1e-12 <= tiles.fraction <= 1.0
    assert tiles.full + tiles.partial >= 1


@pytest.mark.parametrize(("docs", "size"), [(8, 512), (16, 256), (4, 1024)])
@pytest.mark.parametrize("how", ["mask_mod", "segment_ids"])
def test_the_backward_of_block_aligned_documents_computes_only_their_pairs(docs, size, how):
    q, options = _documents(docs, size, how)
    for blocks in ({}, {"block_q": 256, "block_k": 256}):
        tiles = sa.explain(q, q, q, implementation="blocked", **blocks, **options).vjp_tiles
        assert tiles is not None
        assert tiles.partial == 0
        assert tiles.fraction == pytest.approx(1 / docs)
        per_document = (size // tiles.block_q) * (size // tiles.grid)
        assert tiles.skipped == tiles.blocks - 2 * docs * per_document
    assert "blocks skipped" in str(sa.explain(q, q, q, implementation="blocked", **options))


def test_the_backward_visits_the_tiles_it_reports(monkeypatch):
    """The kernel's own tile calls, counted, are the visited tiles of the report (one batch
    element, so each visited tile is one call)."""
    from sdpa_array._kernels import vjp_blocked

    calls: list[tuple[int, int, int, int]] = []
    real = vjp_blocked.tile_gradients

    def counted(p, ops, r, rows, cols, **kw):
        calls.append((rows.start, rows.stop, cols.start, cols.stop))
        return real(p, ops, r, rows, cols, **kw)

    monkeypatch.setattr(vjp_blocked, "tile_gradients", counted)
    lengths = [300, 40, 700, 100]
    seg = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 1, len(seg), 8), dtype=np.float32) for _ in range(4))
    for causal in (False, True):
        options = {"segment_ids": (seg[None], seg[None]), "is_causal": causal}
        tiles = sa.explain(q, k, v, implementation="blocked", **options).vjp_tiles
        assert tiles is not None
        calls.clear()
        sa.scaled_dot_product_attention_vjp(q, k, v, g, implementation="blocked", **options)
        assert calls
        assert len(calls) == tiles.full + tiles.partial
        area = sum((b - a) * (d - c) for a, b, c, d in calls)
        assert area / len(seg) ** 2 == pytest.approx(tiles.fraction)


def test_the_backward_of_an_unrestricted_call_visits_every_block_unmasked():
    q = np.zeros((2, 3, 300, 8), np.float32)
    tiles = sa.explain(q, q, q, implementation="blocked", block_q=64, block_k=128).vjp_tiles
    assert tiles is not None
    assert (tiles.skipped, tiles.partial, tiles.fraction) == (0, 0, 1.0)
    assert tiles.blocks == tiles.full == 6 * 5 * 3
    assert sa.explain(q, q, q, implementation="materialized").vjp_tiles is None
