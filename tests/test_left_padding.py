"""``padding_side="left"``: lengths whose padding comes first (batched generation's layout).

* every path (:mod:`tests.paths`) against the oracle, with causal (both alignments), windows,
  GQA, a bias, sinks and dropout;
* the oracle against the textbook: a left-padded call is the right-padded call on the rows
  rolled so that the valid tokens come first (hypothesis over lengths, causal, alignment
  and window), and the library against the oracle on the same draws;
* padded rows: zero output, ``-inf`` log-sum-exp, exact zero gradients, even where the
  padding holds NaN; lengths traced under ``jax.jit``; lazy Dask;
* errors: a ``padding_side`` that is neither side (the Triton kernels' refusal is in
  ``tests/test_triton.py``).
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array.testing import assert_close_to_oracle, assert_vjp_close_to_oracle
from tests.helpers import KV, Q_GQA, Q
from tests.paths import FeatureCase, check_on_path, random_normal

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

#: Batch element 0 is full, element 1 padded on both sides' left (Q, KV: L=6, S=7).
Q_LENGTHS, K_LENGTHS = np.array([6, 3]), np.array([7, 4])
LEFT = {"query_lengths": Q_LENGTHS, "key_lengths": K_LENGTHS, "padding_side": "left"}

PATH_CASES = [
    FeatureCase("lengths", Q, KV, KV, dict(LEFT)),
    FeatureCase(
        "causal-top-left+gqa", Q_GQA, KV, KV, {**LEFT, "is_causal": True, "enable_gqa": True}
    ),
    FeatureCase(
        "causal-bottom-right+bias",
        Q,
        KV,
        KV,
        {**LEFT, "is_causal": True, "alignment": "bottom_right", "bias": random_normal(2, 1, 6, 7)},
    ),
    FeatureCase("window+sinks", Q, KV, KV, {**LEFT, "window": (2, 1), "sinks": random_normal(2)}),
    FeatureCase(
        "keys-only+dropout",
        Q,
        KV,
        KV,
        {
            "key_lengths": K_LENGTHS,
            "padding_side": "left",
            "is_causal": True,
            "dropout_p": 0.3,
            "dropout_seed": 5,
        },
    ),
]


def test_on_every_path(path_case):
    """Output, log-sum-exp, maximum scores and gradients on every path against the oracle."""
    check_on_path(path_case)


def _rolled_to_the_right(x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row's last ``lengths[b]`` tokens moved to its start, zeros after them."""
    out = np.zeros_like(x)
    n = x.shape[-2]
    for b, length in enumerate(lengths):
        out[b, ..., :length, :] = x[b, ..., n - length :, :]
    return out


@hypothesis.given(
    q_lengths=st.lists(st.integers(0, 6), min_size=2, max_size=2),
    k_lengths=st.lists(st.integers(0, 7), min_size=2, max_size=2),
    causal=st.booleans(),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    window=st.none() | st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(0, 3)),
    implementation=st.sampled_from(["materialized", "blocked"]),
)
def test_left_padding_is_right_padding_rolled(
    q_lengths, k_lengths, causal, alignment, window, implementation
):
    """The oracle's left-padded call equals its right-padded call on the rolled rows, and
    the library's equals the oracle's (output and log-sum-exp, within the derived bound)."""
    rng = np.random.default_rng(len(q_lengths) + 7 * sum(q_lengths) + sum(k_lengths))
    q, k, v = (rng.standard_normal(s) for s in (Q, KV, KV))
    ql, kl = np.array(q_lengths), np.array(k_lengths)
    options = {"is_causal": causal, "alignment": alignment, "window": window}
    left, lse = reference.scaled_dot_product_attention(
        q, k, v, query_lengths=ql, key_lengths=kl, padding_side="left", return_lse=True,
        **options,
    )  # fmt: skip
    right, right_lse = reference.scaled_dot_product_attention(
        _rolled_to_the_right(q, ql),
        _rolled_to_the_right(k, kl),
        _rolled_to_the_right(v, kl),
        query_lengths=ql,
        key_lengths=kl,
        return_lse=True,
        **options,
    )
    L = q.shape[-2]
    for b, length in enumerate(ql):
        np.testing.assert_allclose(left[b, :, L - length :], right[b, :, :length], atol=1e-13)
        np.testing.assert_array_equal(left[b, :, : L - length], 0.0)
        np.testing.assert_allclose(lse[b, :, L - length :], right_lse[b, :, :length], atol=1e-13)
        assert np.all(lse[b, :, : L - length] == -np.inf)
    run = {"query_lengths": ql, "key_lengths": kl, "padding_side": "left", **options}
    result = sdpa_array.scaled_dot_product_attention(
        q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), return_lse=True,
        implementation=implementation, block_q=None if implementation != "blocked" else 2,
        block_k=None if implementation != "blocked" else 3, **run,
    )  # fmt: skip
    arrays = (a.astype(np.float32) for a in (q, k, v))
    assert_close_to_oracle(result, *arrays, return_lse=True, **run)


def test_padding_is_never_read(eager_backend_dtype):
    """NaN in the padding changes nothing: the padded rows' outputs and every gradient
    there are exact zeros, the log-sum-exp ``-inf``."""
    backend, dtype = eager_backend_dtype
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal(s) for s in (Q, KV, KV, Q))
    for x, lengths in ((q, Q_LENGTHS), (k, K_LENGTHS), (v, K_LENGTHS)):
        x[1, :, : x.shape[-2] - lengths[1]] = np.nan
    arrays = [backend.asarray(a, dtype) for a in (q, k, v, g)]
    run = {**LEFT, "is_causal": True, "implementation": "blocked", "block_q": 2, "block_k": 3}
    out, lse = sdpa_array.scaled_dot_product_attention(*arrays[:3], return_lse=True, **run)
    grads = sdpa_array.scaled_dot_product_attention_vjp(*arrays, **run)
    out, lse = reference.to_numpy(out), reference.to_numpy(lse)
    assert np.all(out[1, :, :3] == 0.0)
    assert np.all(lse[1, :, :3] == -np.inf)
    for grad, padded in zip(grads, (3, 3, 3), strict=True):
        assert np.all(reference.to_numpy(grad)[1, :, :padded] == 0.0)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("side", ["right", "left"])
def test_traced_lengths_under_jit(jax_backend, side):
    """Lengths and a dropout seed traced under ``jax.jit`` (no host copy: every tile is
    masked) give what the oracle gives, with ``jax.grad`` through the blocked kernel's
    ``jax.custom_vjp`` (which takes them as arguments: it may not close over a tracer)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    q, k, v, g = (jax_backend.asarray(rng.standard_normal(s), "float32") for s in (Q, KV, KV, Q))
    run = {"is_causal": True, "padding_side": side, "dropout_p": 0.25}
    blocked = {"implementation": "blocked", "block_q": 2}

    @jax.jit
    def loss(q, k, v, ql, kl, seed):
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, query_lengths=ql, key_lengths=kl, dropout_seed=seed, **run, **blocked
        )
        return jnp.sum(out * g), out

    traced = (jnp.asarray(Q_LENGTHS), jnp.asarray(K_LENGTHS), jnp.asarray(9))
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, *traced)
    given = {"query_lengths": Q_LENGTHS, "key_lengths": K_LENGTHS, "dropout_seed": 9, **run}
    assert_close_to_oracle(out, q, k, v, **given)
    assert_vjp_close_to_oracle(tuple(grads), q, k, v, g, **given)


def test_dask_is_lazy(dask_backend):
    """On Dask the call stays lazy (the blocked kernel on the Dask arrays)."""
    rng = np.random.default_rng(5)
    q, k, v = (dask_backend.asarray(rng.standard_normal(s), "float64") for s in (Q, KV, KV))
    out = sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=True, **LEFT)
    assert hasattr(out, "dask")
    assert_close_to_oracle(out, q, k, v, is_causal=True, **LEFT)


@pytest.mark.parametrize("side", ["up", "LEFT", None, 1])
def test_bad_padding_side_is_named(side):
    q, k, v = (np.zeros(s) for s in (Q, KV, KV))
    with pytest.raises(ValueError, match="padding_side must be one of"):
        sdpa_array.scaled_dot_product_attention(q, k, v, key_lengths=3, padding_side=side)
    with pytest.raises(ValueError, match="padding_side must be 'right' or 'left'"):
        reference.scaled_dot_product_attention(q, k, v, key_lengths=3, padding_side=side)
