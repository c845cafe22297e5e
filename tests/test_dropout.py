"""Dropout of the attention weights with a counter-based keep mask.

* :func:`sdpa_array.dropout_keep_mask` gives the same bits on every backend (64-bit and
  32-bit integers: JAX without x64) and a smaller grid's mask is a slice of a larger one;
* the kernels drop exactly those weights: the returned weights and the output equal the
  oracle's (which applies ``dropout_keep_mask``) on every path (:mod:`tests.paths`: the VJP
  and autograd among them), backend and dtype, and with tiles of one pair;
* gradients against central finite differences with the same seed;
* ``dropout_p=0`` is no dropout, bit for bit; lse ignores dropout;
* statistics: the keep rate within a binomial bound over 1e7 draws, and chi-square tests
  of independence between neighbours (row, column) and between seeds;
* a seed given as a 0-d integer array (of every library, traced under ``jax.jit``, a torch
  tensor under autograd) gives the bits of its value, in every dtype's range (negative and
  64-bit values, JAX's 32-bit and unsigned seeds);
* errors: ``dropout_p`` outside ``[0, 1)``, no seed, a non-int seed, a seed array that is not
  0-d or not integer, or of another library; native kernels refuse.
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import sdpa_array
from sdpa_array import dropout_keep_mask, reference
from sdpa_array.reference._dropout import keep_mask as oracle_keep_mask
from sdpa_array.testing import assert_close_to_oracle, assert_vjp_close_to_oracle
from tests.helpers import as_checked
from tests.paths import FeatureCase, check_on_path

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

Q, KV = (2, 4, 6, 4), (2, 2, 7, 4)
P, SEED = 0.3, 1234

DROPOUT = {"dropout_p": P, "dropout_seed": SEED, "enable_gqa": True}

PATH_CASES = [
    FeatureCase("gqa", Q, KV, KV, DROPOUT),
    FeatureCase("causal-softcap", Q, KV, KV, {**DROPOUT, "is_causal": True, "softcap": 2.5}),
    FeatureCase("sinks", Q, KV, KV, {**DROPOUT, "sinks": np.linspace(-1.0, 1.0, 4)}),
]


def test_on_every_path(path_case):
    """Output, log-sum-exp and gradients with the same seed on every path
    (:mod:`tests.paths`) against the oracle, which draws the keep mask with its own code."""
    check_on_path(path_case)


def _case(backend, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [backend.asarray(rng.standard_normal(s), dtype) for s in (Q, KV, KV, Q)]


def _namespace(backend):
    like = backend.asarray(np.zeros(1), "float32")
    return sdpa_array._arrays.compat.array_namespace({"x": like}), sdpa_array._arrays.compat.device(
        like
    )


def test_keep_mask_bits_are_the_same_on_every_backend(backend):
    shape = (3, 4, 33, 65)
    expected = dropout_keep_mask(SEED, shape, P)
    xp, device = _namespace(backend)
    got = dropout_keep_mask(SEED, shape, P, xp=xp, device=device)
    assert sdpa_array._arrays.compat.device(got) == device
    np.testing.assert_array_equal(reference.to_numpy(got), expected)


#: Seeds and the integer dtypes that hold them: 64-bit values, negative ones, the edges of
#: the 31-bit halves.
SEEDS = [0, 5, 2**31 - 1, -3, -(2**31), 2**31 + 7, 2**62 + 11, -(2**40)]


def test_a_seed_array_gives_the_bits_of_its_value(eager_backend):
    """Every library but Dask (whose lazy arrays are refused as seeds, below)."""
    backend = eager_backend
    _, device = _namespace(backend)
    for seed in SEEDS:
        expected = dropout_keep_mask(seed, (2, 3, 9, 10), 0.5)
        array = backend.asarray(np.asarray(seed, dtype=np.int64))
        got = dropout_keep_mask(array, (2, 3, 9, 10), 0.5)
        assert sdpa_array._arrays.compat.device(got) == device
        np.testing.assert_array_equal(reference.to_numpy(got), expected, err_msg=str(seed))


def test_32_bit_and_unsigned_seed_arrays(jax_backend, monkeypatch):
    """The 32-bit path (JAX without x64): int32 seeds, negative ones too, and uint32 seeds
    above ``2**31``."""
    import jax.numpy as jnp

    from sdpa_array._kernels import dropout

    cases = [(-5, jnp.int32), (-(2**31), jnp.int32), (7, jnp.int32), (2**31 + 7, jnp.uint32)]
    expected = [dropout_keep_mask(seed, (2, 9, 10), 0.5) for seed, _ in cases]
    monkeypatch.setattr(dropout, "_wide", lambda xp: False)
    for (seed, dtype), want in zip(cases, expected, strict=True):
        got = dropout_keep_mask(jnp.asarray(seed, dtype=dtype), (2, 9, 10), 0.5)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(seed))


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_attention_and_vjp_with_a_seed_array_equal_the_int_seed(eager_backend, implementation):
    """The output, log-sum-exp and gradients with the seed as an array are the oracle's for
    the int seed (a weight dropped in one and kept in the other would differ by order one)."""
    backend = eager_backend
    q, k, v, g = _case(backend, "float32")
    run = {**DROPOUT, "implementation": implementation}
    with_array = {**run, "dropout_seed": backend.asarray(np.asarray(SEED))}
    got = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **with_array)
    assert_close_to_oracle(got, q, k, v, return_lse=True, **as_checked(q, k, v, run))
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **with_array)
    assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, run, vjp=True))


def test_a_traced_seed_under_jit_and_grad(jax_backend):
    import jax

    q, k, v, g = _case(jax_backend, "float32")

    def loss(q, seed):
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, implementation="blocked", **{**DROPOUT, "dropout_seed": seed}
        )
        return (out * g).sum(), out

    (_, out), dq = jax.jit(jax.value_and_grad(loss, has_aux=True))(q, jax.numpy.asarray(SEED))
    assert_close_to_oracle(out, q, k, v, **DROPOUT)
    others = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **DROPOUT)[1:]
    assert_vjp_close_to_oracle((dq, *others), q, k, v, g, **DROPOUT)


def test_32_bit_integers_give_the_same_bits(backend, monkeypatch):
    """The 15-bit-limb products that JAX without x64 uses give the 64-bit path's bits."""
    from sdpa_array._kernels import dropout

    expected = dropout_keep_mask(7, (2, 16, 40), 0.5)
    values = np.random.default_rng(0).integers(0, 2**31, 10**5)
    wide = [dropout._mul(np, values, c, True) for c in (dropout.C1, dropout.C2, 2**31 - 1)]
    monkeypatch.setattr(dropout, "_wide", lambda xp: False)
    for c, w in zip((dropout.C1, dropout.C2, 2**31 - 1), wide, strict=True):
        np.testing.assert_array_equal(dropout._mul(np, values.astype(np.int32), c, False), w)
    xp, device = _namespace(backend)
    got = dropout_keep_mask(7, (2, 16, 40), 0.5, xp=xp, device=device)
    np.testing.assert_array_equal(reference.to_numpy(got), expected)


def test_numpy_int32_path_gives_the_portable_bits(monkeypatch):
    """NumPy's chunked int32 hash (wrapping products, masked in place) is the portable one."""
    import array_api_compat.numpy as xp

    from sdpa_array._kernels import dropout

    keys = dropout.key_grid(xp, SEED, (2, 3), None)[..., None, None]
    rows, cols = slice(5, 300), slice(17, 1100)  # several chunks, a ragged last one
    weights = np.random.default_rng(0).random((2, 3, 295, 1083))
    fast_mask = dropout.keep_tile(xp, keys, rows, cols, dropout.threshold(P), None)
    drop = dropout.Dropout(P, keys)
    fast = [drop.tile(xp, weights.astype(t), rows, cols, None, scaled=True) for t in "fd"]
    monkeypatch.setattr(dropout, "_is_numpy", lambda a: False)
    slow_mask = dropout.keep_tile(xp, keys, rows, cols, dropout.threshold(P), None)
    np.testing.assert_array_equal(fast_mask, slow_mask)
    for t, got in zip("fd", fast, strict=True):
        expected = drop.tile(xp, weights.astype(t), rows, cols, None, scaled=True)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


def test_a_smaller_grid_is_a_slice_of_a_larger_one():
    big = dropout_keep_mask(5, (4, 3, 20, 30), 0.2)
    small = dropout_keep_mask(5, (2, 2, 7, 11), 0.2)
    np.testing.assert_array_equal(small, big[:2, :2, :7, :11])


@hypothesis.given(
    seed=st.integers(-(2**70), 2**70),
    shape=st.lists(st.integers(1, 6), min_size=2, max_size=5).map(tuple),
    p=st.floats(0.0, 0.99),
)
def test_the_oracle_draws_the_same_mask_from_its_own_code(seed, shape, p):
    """The oracle's keep mask (:mod:`sdpa_array.reference._dropout`, written from the
    specification) and the library's give the same bits: seeds beyond 62 bits and negative
    ones, 2-D to 5-D grids, any probability."""
    ours = np.asarray(dropout_keep_mask(seed, shape, p))
    np.testing.assert_array_equal(ours, oracle_keep_mask(seed, shape, p))


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"enable_gqa": True}, id="gqa"),
        pytest.param({"is_causal": True, "softcap": 2.5, "enable_gqa": True}, id="causal-gqa"),
        pytest.param({"sinks": True, "enable_gqa": True}, id="sinks"),
    ],
)
def test_one_by_one_tiles_drop_the_same_weights(backend_dtype, options):
    """Tiles of a single pair: the bits a pair keeps do not depend on the tiling."""
    backend, dtype = backend_dtype
    implementation, blocks = "blocked", {"block_q": 1, "block_k": 1}
    q, k, v, g = _case(backend, dtype)
    if options.get("sinks"):
        options = {**options, "sinks": backend.asarray(np.linspace(-1, 1, 4), dtype)}
    drop = {"dropout_p": P, "dropout_seed": SEED}
    run = {"implementation": implementation, **blocks, **options, **drop}
    result = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **run)
    assert_close_to_oracle(result, q, k, v, return_lse=True, **as_checked(q, k, v, run))
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, run, vjp=True))


def test_returned_weights_are_zero_exactly_where_the_mask_drops(backend):
    q, k, v, _ = _case(backend, "float32")
    _, w = sdpa_array.scaled_dot_product_attention(
        q, k, v, dropout_p=P, dropout_seed=SEED, return_weights=True, enable_gqa=True
    )
    keep = dropout_keep_mask(SEED, (*Q[:-1], KV[-2]), P)  # Hq heads, not Hkv
    np.testing.assert_array_equal(reference.to_numpy(w) != 0, keep)


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_lse_ignores_dropout_and_p0_is_no_dropout(backend, implementation, monkeypatch):
    """Bit for bit. Eager JAX calls with an int seed are not compiled (the seed's bits are
    computed on the host), so every call here runs uncompiled: the same arithmetic on
    either side (a compiled call may round differently, e.g. through the running maximum
    where an eager one takes the fixed softmax reference)."""
    from sdpa_array._api import jax_eager

    monkeypatch.setenv(jax_eager.ENVIRONMENT_VARIABLE, "0")
    q, k, v, g = _case(backend, "float32")
    common = {"enable_gqa": True, "implementation": implementation}
    plain = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **common)
    dropped = sdpa_array.scaled_dot_product_attention(
        q, k, v, return_lse=True, dropout_p=P, dropout_seed=SEED, **common
    )
    zero = sdpa_array.scaled_dot_product_attention(
        q, k, v, return_lse=True, dropout_p=0.0, dropout_seed=SEED, **common
    )
    np.testing.assert_array_equal(reference.to_numpy(dropped[1]), reference.to_numpy(plain[1]))
    for a, b in zip(zero, plain, strict=True):
        np.testing.assert_array_equal(reference.to_numpy(a), reference.to_numpy(b))
    g0 = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, dropout_p=0.0, **common)
    g1 = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **common)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_array_equal(reference.to_numpy(a), reference.to_numpy(b))


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_gradients_match_central_differences_with_the_same_seed(implementation):
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal(s) for s in (Q, KV, KV, Q))
    options = {"dropout_p": 0.5, "dropout_seed": 99, "enable_gqa": True, "is_causal": True}
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q,
        k,
        v,
        g,
        implementation=implementation,
        block_q=2 if implementation == "blocked" else None,
        **options,
    )
    args = [q, k, v]
    h = 1e-6
    for n, x in enumerate(args):
        numeric = np.zeros_like(x)
        for idx in list(np.ndindex(x.shape))[::5]:
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[n][idx] += h
            minus[n][idx] -= h
            f = sdpa_array.scaled_dot_product_attention(
                *plus, **options
            ) - sdpa_array.scaled_dot_product_attention(*minus, **options)
            numeric[idx] = np.sum(f * g) / (2 * h)
            np.testing.assert_allclose(grads[n][idx], numeric[idx], rtol=1e-5, atol=1e-7)


def test_autograd_with_dropout(autograd_backend):
    backend = autograd_backend
    q, k, v, g = _case(backend, "float64")
    xp = sdpa_array._arrays.compat.array_namespace({"q": q})
    drop = {"dropout_p": P, "dropout_seed": SEED, "enable_gqa": True}
    for implementation in ("materialized", "blocked"):

        def loss(q, k, v, implementation=implementation):
            out = sdpa_array.scaled_dot_product_attention(
                q, k, v, implementation=implementation, **drop
            )
            return xp.sum(out * g)

        if backend.library == "torch":
            import torch

            leaves = [a.detach().requires_grad_(True) for a in (q, k, v)]
            grads = torch.autograd.grad(loss(*leaves), leaves)
        else:
            import jax

            grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        assert_vjp_close_to_oracle(tuple(grads), q, k, v, g, **drop)


# --- statistics ------------------------------------------------------------------------

N_DRAWS = 10**7


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_a_binomial_bound(p):
    keep = dropout_keep_mask(2024, (10, 1000, 1000), p)
    rate = 1 - math.floor(p * 2**31) / 2**31
    sigma = math.sqrt(rate * (1 - rate) / N_DRAWS)
    assert abs(keep.mean() - rate) < 5 * sigma  # fails by chance with probability ~6e-7


def _chi_square_2x2(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's statistic of independence of two boolean samples (1 degree of freedom)."""
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]])
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(np.sum((table - expected) ** 2 / expected))


#: The 99.9999% quantile of chi-square with one degree of freedom: a test of independent
#: bits exceeds it with probability 1e-6.
CHI2_1_LIMIT = 23.9


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_no_correlation_between_neighbours_or_seeds(p):
    a = dropout_keep_mask(11, (10, 1000, 1000), p)
    b = dropout_keep_mask(12, (10, 1000, 1000), p)
    pairs = {
        "next key": (a[..., :, :-1], a[..., :, 1:]),
        "next query": (a[..., :-1, :], a[..., 1:, :]),
        "next head": (a[:-1], a[1:]),
        "diagonal": (a[..., :-1, :-1], a[..., 1:, 1:]),
        "next seed": (a, b),
    }
    for name, (x, y) in pairs.items():
        assert _chi_square_2x2(x.ravel(), y.ravel()) < CHI2_1_LIMIT, name
    # the four corners of 2x2 squares: an XOR structure of rows and columns would show here
    corners = a[..., :-1, :-1] ^ a[..., :-1, 1:] ^ a[..., 1:, :-1]
    assert _chi_square_2x2(corners.ravel(), a[..., 1:, 1:].ravel()) < CHI2_1_LIMIT


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dropout_p": 1.0, "dropout_seed": 0}, ValueError, r"dropout_p must be in \[0, 1\)"),
        ({"dropout_p": -0.1, "dropout_seed": 0}, ValueError, r"dropout_p must be in \[0, 1\)"),
        ({"dropout_p": 0.1}, ValueError, "needs dropout_seed"),
        ({"dropout_p": 0.1, "dropout_seed": 1.5}, TypeError, "dropout_seed must be an int"),
        ({"dropout_p": 0.1, "dropout_seed": np.array([1, 2])}, TypeError, r"shape \(2,\)"),
        ({"dropout_p": 0.1, "dropout_seed": np.array(1.0)}, TypeError, "dtype float64"),
        ({"dropout_p": "x", "dropout_seed": 1}, TypeError, "dropout_p must be a real number"),
    ],
)
def test_bad_dropout_arguments(kwargs, error, match):
    q = np.zeros((2, 3, 4))
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention(q, q, q, **kwargs)
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_vjp(q, q, q, q, **kwargs)


def test_a_seed_array_of_another_library_is_refused(non_numpy_backend):
    q = np.zeros((2, 3, 4))
    seed = non_numpy_backend.asarray(np.asarray(3))
    with pytest.raises(TypeError, match="must come from one array library"):
        sdpa_array.scaled_dot_product_attention(q, q, q, dropout_p=0.1, dropout_seed=seed)
    if non_numpy_backend.library == "dask":
        with pytest.raises(TypeError, match="not a lazy Dask array"):
            sdpa_array.scaled_dot_product_attention(
                *(non_numpy_backend.asarray(q, "float64"),) * 3, dropout_p=0.1, dropout_seed=seed
            )


def test_native_refuses_dropout(native_backend):
    q, k, v, _ = _case(native_backend, "float32")
    with pytest.raises(sdpa_array.CannotDelegateError, match="dropout"):
        sdpa_array.scaled_dot_product_attention(
            q, k, v, dropout_p=P, dropout_seed=SEED, implementation="native", enable_gqa=True
        )
