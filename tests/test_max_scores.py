"""``return_max_scores``: the largest ``scale * q . k`` of each batch element and query head.

Every feature file runs its cases with the maximum scores on the materialized, blocked and
KV-cache paths (:mod:`tests.paths`), against the oracle within the error of one scaled
product. This file checks what is the maximum scores' own:

* the oracle against a loop over the admissible pairs, with the restrictions of every kind
  (mask, causal, window, lengths, segments, a mask function) and the terms it ignores
  (softcap, bias, a ``-inf`` bias, sinks, dropout);
* ``-inf`` exactly for heads without an admissible pair, empty calls and padded batch
  elements; the shapes of 2-D inputs (0-d), GQA and broadcast batch axes;
* a statistic: torch detaches it, ``jax.grad`` gets no gradient through it, and it takes
  ``jax.jit``; lazy on Dask;
* the native kernels do not return it: ``"native"`` refuses before any work, ``"auto"``
  runs another kernel (the Triton kernels compute it: ``tests/test_triton.py``); bad flags
  name the argument; the KV cache's chunks give the same maximum as one chunk.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array.testing import assert_close_to_oracle
from tests.helpers import KV, Q_GQA, Q, as_checked, assert_within, score_error

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

B, H, L, S, E = 2, 2, 6, 7, 4


def _loop_maximum(q, k, allowed, scale):
    """``max scale * q[b, h, i] . k[b, h, j]`` over the allowed pairs, by loops."""
    best = np.full(q.shape[:2], -np.inf)
    for b, h, i, j in itertools.product(*map(range, (*q.shape[:3], k.shape[2]))):
        if allowed[b, h, i, j]:
            best[b, h] = max(best[b, h], scale * float(np.dot(q[b, h, i], k[b, h, j])))
    return best


def _allowed(mask, q_lengths, k_lengths, q_segments, k_segments, window):
    """Every restriction of the oracle case below as one boolean (B, H, L, S) array."""
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    diag = i + (S - L)  # bottom right
    band = (j <= diag) & (j >= diag - window)
    allowed = np.broadcast_to(mask & band, (B, H, L, S)).copy()
    for b in range(B):
        allowed[b, :, q_lengths[b] :, :] = False
        allowed[b, :, :, k_lengths[b] :] = False
        same = q_segments[b][:, None] == k_segments[b][None, :]
        allowed[b] &= same
        allowed[b] &= j % 3 != 1  # the mask function below
    return allowed


def test_the_oracle_matches_a_loop_over_the_admissible_pairs():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((B, H, L, E), (B, H, S, E), (B, H, S, E)))
    mask = rng.random((L, S)) < 0.8
    q_lengths, k_lengths = np.array([6, 4]), np.array([7, 5])
    q_segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    k_segments = np.array([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]])
    bias = rng.standard_normal((L, S)) * 10.0
    bias[0, 0] = -np.inf  # a -inf bias does not restrict the maximum (taken before the bias)
    _, got = reference.scaled_dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        is_causal=True,
        window=(2, None),
        alignment="bottom_right",
        query_lengths=q_lengths,
        key_lengths=k_lengths,
        segment_ids=(q_segments, k_segments),
        mask_mod=lambda b, h, i, j: j % 3 != 1,
        softcap=0.5,
        sinks=np.array([5.0, -5.0]),
        dropout_p=0.5,
        dropout_seed=3,
        scale=0.7,
        return_max_scores=True,
    )
    allowed = _allowed(mask, q_lengths, k_lengths, q_segments, k_segments, window=2)
    np.testing.assert_allclose(got, _loop_maximum(q, k, allowed, 0.7), rtol=1e-12)


def test_heads_and_calls_without_admissible_pairs_give_minus_infinity(backend):
    rng = np.random.default_rng(1)
    q, k, v = (backend.asarray(rng.standard_normal(s), "float32") for s in (Q, KV, KV))
    mask = np.ones((B, H, L, S), dtype=bool)
    mask[0, 1] = False  # batch 0, head 1: nothing admissible
    for implementation in ("materialized", "blocked"):
        _, got = sdpa_array.scaled_dot_product_attention(
            q,
            k,
            v,
            mask=backend.asarray(mask),
            query_lengths=backend.asarray(np.array([6, 0])),  # batch 1: every query padded
            return_max_scores=True,
            implementation=implementation,
        )
        got = reference.to_numpy(got)
        assert got.shape == (B, H)
        assert got[0, 1] == -np.inf
        assert np.all(got[1] == -np.inf)
        assert np.all(np.isfinite(got[0, 0]))
    for empty in ((q[..., :0, :], k, v), (q, k[..., :0, :], v[..., :0, :])):
        _out, got = sdpa_array.scaled_dot_product_attention(*empty, return_max_scores=True)
        np.testing.assert_array_equal(reference.to_numpy(got), np.full((B, H), -np.inf))


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "options"),
    [
        pytest.param((L, E), (S, E), {}, id="2d"),
        pytest.param(Q_GQA, KV, {"enable_gqa": True}, id="gqa"),
        pytest.param((3, 1, L, E), (1, H, S, E), {}, id="broadcast-batch"),
    ],
)
def test_shapes_follow_the_output_batch_and_query_heads(backend_dtype, q_shape, k_shape, options):
    backend, dtype = backend_dtype
    rng = np.random.default_rng(2)
    q, k = (backend.asarray(rng.standard_normal(s), dtype) for s in (q_shape, k_shape))
    run = {**options, "return_max_scores": True}
    result = sdpa_array.scaled_dot_product_attention(q, k, k, **run)
    assert_close_to_oracle(result, q, k, k, **as_checked(q, k, k, run))


def test_native_refuses_and_auto_runs_another_kernel(native_backend):
    rng = np.random.default_rng(3)
    q, k = (native_backend.asarray(rng.standard_normal(s), "float32") for s in (Q, KV))
    with pytest.raises(sdpa_array.CannotDelegateError, match="maximum scores"):
        sdpa_array.scaled_dot_product_attention(
            q, k, k, return_max_scores=True, implementation="native"
        )
    explanation = sdpa_array.explain(q, k, k, return_max_scores=True)
    assert explanation.forward in ("materialized", "blocked", "triton")


def test_torch_native_is_passed_over_for_the_maximum_scores(torch_cpu_backend):
    q, k = (torch_cpu_backend.asarray(np.ones(s), "float32") for s in (Q, KV))
    assert sdpa_array.explain(q, k, k).forward == "native"
    explanation = sdpa_array.explain(q, k, k, return_max_scores=True)
    assert explanation.forward == "materialized"
    assert any("maximum scores" in why for why in explanation.forward_why)


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_torch_detaches_the_statistic(torch_backend, implementation):
    rng = np.random.default_rng(4)
    q, k, v = (torch_backend.asarray(rng.standard_normal(s), "float64") for s in (Q, KV, KV))
    q.requires_grad_(True)
    out, best = sdpa_array.scaled_dot_product_attention(
        q, k, v, return_max_scores=True, implementation=implementation
    )
    assert out.requires_grad
    assert not best.requires_grad
    assert_close_to_oracle((out.detach(), best), q.detach(), k, v, return_max_scores=True)


def test_jax_jit_and_no_gradient_through_the_statistic(jax_backend):
    import jax

    rng = np.random.default_rng(5)
    q, k, v = (jax_backend.asarray(rng.standard_normal(s), "float32") for s in (Q, KV, KV))

    def best(q, implementation):
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, return_max_scores=True, implementation=implementation
        )[1]

    for implementation in ("materialized", "blocked"):
        got = jax.jit(best, static_argnums=1)(q, implementation)
        assert_close_to_oracle(
            (sdpa_array.scaled_dot_product_attention(q, k, v), got), q, k, v, return_max_scores=True
        )
        grad = jax.grad(lambda q, i=implementation: best(q, i).sum())(q)
        np.testing.assert_array_equal(np.asarray(grad), np.zeros(Q))


def test_dask_stays_lazy(dask_backend):
    import dask.array as da

    rng = np.random.default_rng(6)
    q, k = (dask_backend.asarray(rng.standard_normal(s), "float32") for s in (Q, KV))
    out, best = sdpa_array.scaled_dot_product_attention(q, k, k, return_max_scores=True)
    assert isinstance(best, da.Array)
    assert isinstance(out, da.Array)
    assert_close_to_oracle((out, best), q, k, k, return_max_scores=True)


def test_the_kv_cache_chunks_give_the_maximum_of_one_call(backend):
    rng = np.random.default_rng(7)
    q = backend.asarray(rng.standard_normal((B, H, 2, E)), "float32")
    k, v = (backend.asarray(rng.standard_normal((B, H, 40, E)), "float32") for _ in range(2))
    lengths = [40, 23]
    options = {"is_causal": True, "window": (17, None)}
    one = sdpa_array.attention_with_kv_cache(
        q, k, v, cache_lengths=lengths, return_max_scores=True, num_splits=1, **options
    )
    split = sdpa_array.attention_with_kv_cache(
        q, k, v, cache_lengths=lengths, return_max_scores=True, num_splits=5, **options
    )
    # each within the error of one scaled product of the exact maximum: 2 ds apart at most
    q64, k64 = reference.to_numpy(q).astype(float), reference.to_numpy(k).astype(float)
    ds = score_error("float32", q64, k64, 1 / np.sqrt(E))
    first = reference.to_numpy(one[1]).astype(float)
    assert_within(split[1], first, np.full(first.shape, 2 * ds), "chunked max_scores")
    for b, n in enumerate(lengths):  # against the main function on the attended tokens
        expected = sdpa_array.scaled_dot_product_attention(
            q[b : b + 1, ...],
            k[b : b + 1, :, :n, :],
            v[b : b + 1, :, :n, :],
            alignment="bottom_right",
            return_max_scores=True,
            **options,
        )[1]
        want = reference.to_numpy(expected)[0].astype(float)
        got = reference.to_numpy(split[1])[b]
        assert_within(got, want, np.full(want.shape, 2 * ds), f"max_scores of sequence {b}")


def test_bad_flags_name_the_argument():
    q = np.zeros(Q)
    k = np.zeros(KV)
    with pytest.raises(TypeError, match="return_max_scores"):
        sdpa_array.scaled_dot_product_attention(q, k, k, return_max_scores="yes")
    with pytest.raises(TypeError, match="return_max_scores"):
        sdpa_array.attention_with_kv_cache(q, k, k, cache_lengths=[7, 7], return_max_scores=1)


@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"window": (40, 0)}], ids=str)
def test_blocked_numpy_keeps_the_fixed_reference_with_the_maximum_scores(options):
    """On NumPy, the blocked call with the maximum scores takes the same softmax as the call
    without (the fixed reference): the same output bit for bit, and the maximum scores
    within the oracle's bounds (whole, row-cut and narrower tiles, several threads)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 3, 200, 64)).astype(np.float32) for _ in range(3))
    run = dict(implementation="blocked", block_q=64, block_k=48, **options)
    plain = sdpa_array.scaled_dot_product_attention(q, k, v, **run)
    out, best = sdpa_array.scaled_dot_product_attention(q, k, v, return_max_scores=True, **run)
    np.testing.assert_array_equal(out, plain)
    assert_close_to_oracle((out, best), q, k, v, return_max_scores=True, **options)
