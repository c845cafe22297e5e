"""The scores' contraction in chunks where the scores may be large (``products.scores``'s
``chunks``, decided by ``score_bound.chunks_from_bound``).

A score's rounding error grows with its magnitude, and ``exp`` turns it into the same
relative error of its weight: at logits of ~1e3 it is the float32 output's whole error.
OpenBLAS sums each score in one chain along the features; two chains of half the length,
added, have about ``1/√2`` of its error (a chain's error grows with its length, the errors
of independent chains add in quadrature). These tests check that the chunked scores are the
product within the worst-case rounding bound of their chains, that they are cut exactly
where the call's score bound exceeds the fixed reference's limit (and on the libraries whose
BLAS sums in one chain), and that on OpenBLAS their error is below the single product's by
that factor (1M scores, so that the ratio is tight).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import sdpa_array
from sdpa_array._arrays import products
from sdpa_array._arrays.compat import array_namespace
from sdpa_array._kernels import score_bound
from sdpa_array._kernels.operands import prepare
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import Inputs, validate
from sdpa_array.testing.backends import get_backend
from tests.helpers import check_against_oracle, check_vjp_against_oracle

LARGE = 31.6  # q and k times this: logits ~ 1e3 at 64 features


def _gamma(n: int, dtype) -> float:
    """Higham's ``γ_n = n u / (1 - n u)``: a chain of ``n`` roundings."""
    u = float(np.finfo(dtype).eps) / 2
    return n * u / (1 - n * u)


@pytest.mark.parametrize("features", [32, 48, 64, 100, 128, 256])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_chunked_scores_within_their_chains_bound(features, transposed, lead):
    """Within ``γ_(size+count) Σ|a||b|`` of the exact product: each chunk's chain of ``size``
    products, then ``count - 1`` additions (a wrong slice or a lost chunk is far outside)."""
    rng = np.random.default_rng(features)
    a = rng.standard_normal((*lead, 37, features)).astype(np.float32)
    b = rng.standard_normal((*lead, 29, features)).astype(np.float32)
    xp = array_namespace({"a": a})
    count = products.score_chunks(xp, features)
    assert count == max(2, -(-features // products.SCORE_CHUNK))
    got = products.scores(xp, a, b, transposed=transposed, chunks=count)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ np.swapaxes(b64, -1, -2)
    magnitude = np.abs(a64) @ np.swapaxes(np.abs(b64), -1, -2)
    size = -(-features // count)
    assert got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= _gamma(size + count, np.float32) * magnitude)


def test_chunked_scores_on_array_api_strict():
    strict = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((2, 9, 64)).astype(np.float32) for _ in range(2))
    xa, xb = strict.asarray(a), strict.asarray(b)
    xp = array_namespace({"a": xa})
    assert products.score_chunks(xp, 64) == 2
    got = np.asarray(products.scores(xp, xa, xb, transposed=False, chunks=2))
    exact = a.astype(np.float64) @ np.swapaxes(b.astype(np.float64), -1, -2)
    bound = _gamma(33, np.float32) * (np.abs(a) @ np.swapaxes(np.abs(b), -1, -2))
    assert np.all(np.abs(got - exact) <= bound)


def test_one_product_for_few_features_and_other_libraries(backend):
    a = backend.asarray(np.ones((2, 64)), "float32")
    xp = array_namespace({"a": a})
    split = backend.library in products.SPLIT_LIBRARIES
    assert products.score_chunks(xp, 64) == (2 if split else 1)
    assert products.score_chunks(xp, 2 * products.MIN_SCORE_CHUNK - 1) == 1


def _ops(q, k, v, **options):
    p = validate(q, k, v, Options(**options))
    x = Inputs(q, k, v, bias=options.get("bias"))
    return p, prepare(p, x)


@pytest.mark.parametrize("factor", [1.0, LARGE])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cut_where_the_bound_exceeds_the_limit(factor, with_bias):
    """Unit logits (a bound below 22.2 at 64 features): one product; logits ~1e3: two
    chunks, with a bias too (the bias is added after the product)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 64, 64)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((64, 64)).astype(np.float32) if with_bias else None
    p, ops = _ops(q * factor, k * factor, v, bias=bias)
    assert ops.score_chunks == 2  # prepare's, before a kernel decides
    chunked, bound = score_bound.chunks_from_bound(p, ops)
    assert bound == pytest.approx(score_bound.product_bound(p, ops))
    large = bound > score_bound.exponent_limit(p)
    assert large is (factor == LARGE)
    assert chunked.score_chunks == (2 if large else 1)
    assert chunked.at((0,)).score_chunks == chunked.score_chunks


def test_unreadable_bound_keeps_the_chunks():
    """A NaN leaves no bound (NaN): the scores stay cut, whatever the soft-cap, and the
    fixed reference is not taken."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 8, 64)).astype(np.float32) for _ in range(3))
    q[0, 0, 3, 5] = np.nan
    p, ops = _ops(q, k, v, softcap=10.0)
    chunked, bound = score_bound.chunks_from_bound(p, ops)
    assert np.isnan(bound)
    assert chunked.score_chunks == 2
    assert not score_bound.fixed_reference(p, chunked, bound)


@pytest.mark.skipif(
    "openblas" not in str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]),
    reason="needs NumPy on OpenBLAS (its kernel sums each score in one chain)",
)
def test_smaller_error_than_one_chain_on_openblas():
    """1024 x 1024 scores from 64 features at logits ~1e3: the two chunks' RMS error is at
    most 0.8 of the single product's (1/√2 = 0.71 expected, the additions' rounding
    aside)."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((1024, 64)) * LARGE / 8).astype(np.float32)
    b = (rng.standard_normal((1024, 64)) * LARGE).astype(np.float32)
    xp = array_namespace({"a": a})
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    chunked = products.scores(xp, a, b, transposed=False, chunks=2)
    single = products.scores(xp, a, b, transposed=False)
    assert np.linalg.norm(chunked - exact) <= 0.8 * np.linalg.norm(single - exact)


def test_the_scratch_buffer_is_never_returned():
    """The chunks after the first go through a kept scratch buffer: a later product of the
    same shape leaves an earlier result as it was."""
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    xp = array_namespace({"a": a})
    first = products.scores(xp, a, b, transposed=False, chunks=2)
    kept = first.copy()
    second = products.scores(xp, c, b, transposed=True, chunks=2)
    np.testing.assert_array_equal(first, kept)
    for result in (first, second):
        for buffers in products._kept.values():
            for kept in buffers:
                assert not np.shares_memory(result, kept)
    assert products._kept[np.dtype(np.float32)]  # the buffer was kept


@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_on_the_thread_pool_against_the_oracle(causal, monkeypatch):
    """Logits ~1e3 (scores in chunks) on the NumPy pool with small tiles, so that each
    thread's scratch buffer serves many tiles of several shapes: the forward and the VJP
    within the oracle's bounds."""
    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal((2, 3, 200, 64)) * LARGE for _ in range(2))
    v, d_out = (rng.standard_normal((2, 3, 200, 64)) for _ in range(2))
    threads = set()
    chunked = products._chunked_scores

    def spy(xp, a, b, count):
        threads.add(threading.get_ident())
        return chunked(xp, a, b, count)

    monkeypatch.setattr(products, "_chunked_scores", spy)
    sdpa_array.set_num_threads(2)
    try:
        _check_both(q, k, v, d_out, causal)
    finally:
        sdpa_array.set_num_threads(None)
    assert threads  # the tiles' scores were cut


def _check_both(q, k, v, d_out, causal):
    numpy = get_backend("numpy")
    check_against_oracle(
        numpy,
        "float32",
        q,
        k,
        v,
        implementation="blocked",
        return_weights=False,
        is_causal=causal,
        block_q=48,
        block_k=32,
    )
    check_vjp_against_oracle(
        numpy,
        "float32",
        q,
        k,
        v,
        d_out,
        implementation="blocked",
        block_q=48,
        block_k=32,
        is_causal=causal,
    )


def test_softcap_at_most_the_limit_keeps_one_product():
    """A soft-cap of at most ``T`` keeps the final scores small whatever the products: one
    product, and the fixed reference taken with the bound read once."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 32, 64)).astype(np.float32) for _ in range(3))
    p, ops = _ops(q * LARGE, k * LARGE, v, softcap=10.0)
    chunked, bound = score_bound.chunks_from_bound(p, ops)
    assert bound > score_bound.exponent_limit(p)
    assert chunked.score_chunks == 1
    assert score_bound.fixed_reference(p, chunked, bound)
    p, ops = _ops(q * LARGE, k * LARGE, v, softcap=50.0)
    assert score_bound.chunks_from_bound(p, ops)[0].score_chunks == 2


def test_overflowing_bound_with_a_softcap_takes_the_fixed_reference():
    """A bound that overflows (finite operands) is still a bound: capped by the soft-cap."""
    q = np.full((1, 1, 4, 64), 1e160)
    p, ops = _ops(q, q, np.ones_like(q), softcap=10.0)
    assert score_bound.product_bound(p, ops) == np.inf
    assert score_bound.fixed_reference(p, ops)


def _counting(monkeypatch) -> list[int]:
    counts: list[int] = []
    chunked = products._chunked_scores

    def spy(xp, a, b, count):
        counts.append(count)
        return chunked(xp, a, b, count)

    monkeypatch.setattr(products, "_chunked_scores", spy)
    return counts


@pytest.mark.parametrize(
    ("factor", "options", "chunked"),
    [
        pytest.param(1.0, {}, False, id="unit"),
        pytest.param(LARGE, {}, True, id="large"),
        pytest.param(LARGE, {"is_causal": True}, True, id="large-causal"),
        pytest.param(1.0, {"bias": "huge"}, False, id="unit-huge-bias"),
        pytest.param(LARGE, {"softcap": 10.0}, False, id="large-softcapped"),
        pytest.param(1.0, {"mask": "rows"}, False, id="unit-empty-rows"),
    ],
)
def test_materialized_forward_cuts_where_the_products_are_large(
    monkeypatch, factor, options, chunked
):
    """The materialized forward takes one product, then the scores again in chunks only
    where a row's largest scaled product exceeds the limit: not for a bias of -1e9 (the
    products are small), a soft-cap or rows without keys; and its output stays within the
    oracle's bounds."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 2, 24, 64)) for _ in range(3))
    opts = dict(options)
    if opts.get("bias") == "huge":
        bias = np.zeros((24, 24))
        bias[3] = -1e9  # a padded row: its final scores are huge, its products are not
        opts["bias"] = bias
    if opts.get("mask") == "rows":
        mask = np.ones((24, 24), dtype=bool)
        mask[5] = False
        opts["mask"] = mask
    counts = _counting(monkeypatch)
    check_against_oracle(
        get_backend("numpy"),
        "float32",
        q * factor,
        k * factor,
        v,
        implementation="materialized",
        **opts,
    )
    assert bool(counts) is chunked


@pytest.mark.parametrize("features", [31, 64])
@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_empty_batch_and_heads(implementation, features):
    for shape in [(0, 2, 4, features), (2, 0, 4, features)]:
        q = np.zeros(shape, np.float32)
        out = sdpa_array.scaled_dot_product_attention(q, q, q, implementation=implementation)
        assert out.shape == shape
        grads = sdpa_array.scaled_dot_product_attention_vjp(
            q, q, q, q, implementation=implementation
        )
        assert all(g.shape == shape for g in grads[:3])


@pytest.mark.parametrize(
    ("length", "factor", "chunked"),
    [(16, LARGE, False), (128, 1.0, False), (128, LARGE, True)],
)
def test_materialized_vjp_reads_the_bound_for_calls_not_small(monkeypatch, length, factor, chunked):
    """The materialized VJP cuts the scores where the bound says they are large, for calls
    of at least MIN_BOUND_PAIRS pairs; smaller calls read no bound and keep one product."""
    from sdpa_array._kernels import vjp_materialized

    assert (length * length >= vjp_materialized.MIN_BOUND_PAIRS) is (length == 128)
    rng = np.random.default_rng(6)
    q, k = (rng.standard_normal((1, 2, length, 64)) * factor for _ in range(2))
    v, g = (rng.standard_normal((1, 2, length, 64)) for _ in range(2))
    reads: list[float] = []
    bound = score_bound.product_bound
    monkeypatch.setattr(
        score_bound, "product_bound", lambda p, ops: reads.append(1) or bound(p, ops)
    )
    counts = _counting(monkeypatch)
    check_vjp_against_oracle(
        get_backend("numpy"), "float32", q, k, v, g, implementation="materialized"
    )
    assert bool(reads) is (length == 128)
    assert bool(counts) is chunked
