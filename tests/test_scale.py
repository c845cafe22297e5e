"""``scale`` given as a 0-d array: a learnable temperature on every backend.

* a number and a 0-d ``scale`` array on every path (:mod:`tests.paths`), backend and dtype
  against the oracle: the forward result and the gradients, ``grad_scale`` (0-d, the
  scale's dtype) within the bound derived in
  :func:`sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds`;
* autograd reaches it (the ``autograd`` path above, and ``jax.grad`` under ``jax.jit``)
  against the oracle; ``torch.autograd.gradcheck`` and, where torch has a second
  derivative, ``gradgradcheck`` (double backward) in float64; ``torch.func.grad`` and
  ``torch.func.vmap`` over a batch of scales;
* its value is checked where it can be read, and a lazy Dask scale is never computed;
* bad scales, each with a message naming ``scale``.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array.testing import assert_vjp_close_to_oracle
from tests.helpers import as_checked
from tests.paths import FeatureCase, check_on_path

#: JAX compiles every new shape: on JAX these cases run in `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax")

# The shapes of tests/test_vjp.py's common cases, so that JAX compiles them once.
Q, KV = (2, 2, 6, 4), (2, 2, 7, 4)
SCALE = 0.3

SCALE_ARRAY = {"scale": np.asarray(SCALE)}


def _inputs(backend, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = backend.asarray(rng.standard_normal(Q), dtype)
    k = backend.asarray(rng.standard_normal(KV), dtype)
    v = backend.asarray(rng.standard_normal(KV), dtype)
    g = backend.asarray(rng.standard_normal(Q), dtype)
    return q, k, v, g


PATH_CASES = [
    FeatureCase("number", Q, KV, KV, {"scale": 0.7}, native=True),
    FeatureCase("array", Q, KV, KV, SCALE_ARRAY),
    FeatureCase("array+causal", Q, KV, KV, {**SCALE_ARRAY, "is_causal": True}),
    FeatureCase("array+softcap", Q, KV, KV, {**SCALE_ARRAY, "softcap": 2.5}),
]


def test_on_every_path(path_case):
    """The forward result and the gradients (``grad_scale`` last, for an array) against the
    oracle on every path (:mod:`tests.paths`)."""
    check_on_path(path_case)


def test_vjp_with_bias_and_gqa_returns_grad_bias_then_grad_scale(backend):
    rng = np.random.default_rng(1)
    q = backend.asarray(rng.standard_normal((2, 6, 5, 4)), "float32")
    k = backend.asarray(rng.standard_normal((2, 2, 7, 4)), "float32")
    v = backend.asarray(rng.standard_normal((2, 2, 7, 3)), "float32")
    g = backend.asarray(rng.standard_normal((2, 6, 5, 3)), "float32")
    bias = backend.asarray(rng.standard_normal((6, 1, 7)), "float32")
    scale = backend.asarray(np.asarray(0.8), "float32")
    options = {"bias": bias, "scale": scale, "enable_gqa": True}
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **options)
    assert len(grads) == 5
    assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, options, vjp=True))


def test_number_scales_have_no_gradient(backend):
    q, k, v, g = _inputs(backend, "float32")
    for scale in (SCALE, np.float32(SCALE), np.float64(SCALE), None):
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, scale=scale)
        assert len(grads) == 3


def test_empty_lengths_give_a_zero_scale_gradient(backend):
    q = backend.asarray(np.ones((1, 0, 4)), "float32")
    k = backend.asarray(np.ones((1, 3, 4)), "float32")
    scale = backend.asarray(np.asarray(0.5), "float32")
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, k, backend.asarray(np.ones((1, 0, 4)), "float32"), scale=scale
    )
    assert len(grads) == 4
    assert tuple(grads[3].shape) == ()
    assert float(reference.to_numpy(grads[3])) == 0.0


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_jax_jit_grad_traced_scale(jax_backend, implementation):
    import jax

    q, k, v, g = _inputs(jax_backend, "float32")
    scale = jax_backend.asarray(np.asarray(SCALE), "float32")

    def loss(q, k, v, scale):
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, scale=scale, implementation=implementation, is_causal=True
        )
        return (out * g).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, scale)
    assert_vjp_close_to_oracle(grads, q, k, v, g, scale=scale, is_causal=True)


def _torch_float64_case(backend):
    rng = np.random.default_rng(2)
    shapes = ((1, 2, 5, 3), (1, 2, 6, 3), (1, 2, 6, 3))
    q, k, v = (backend.asarray(rng.standard_normal(s), "float64") for s in shapes)
    scale = backend.asarray(np.asarray(0.7), "float64")
    return tuple(a.requires_grad_(True) for a in (q, k, v, scale))


def _causal(implementation):
    def f(q, k, v, scale):
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, scale=scale, implementation=implementation, is_causal=True
        )

    return f


@pytest.mark.parametrize("implementation", ["materialized", "blocked", "native", "auto"])
def test_torch_gradcheck(torch_backend, implementation):
    import torch

    assert torch.autograd.gradcheck(_causal(implementation), _torch_float64_case(torch_backend))


# Not "native" (nor "auto", which delegates to it here): torch's fused CPU kernel has no
# second derivative, and torch says so with a RuntimeError.
@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_torch_double_backward(torch_backend, implementation):
    import torch

    args = _torch_float64_case(torch_backend)
    assert torch.autograd.gradgradcheck(_causal(implementation), args)


def test_torch_func_grad_and_vmap_over_scales(torch_backend):
    import torch

    q, k, v, g = _inputs(torch_backend, "float64")
    scales = torch_backend.asarray(np.asarray([0.2, 0.5, 1.1]), "float64")

    def loss(scale):
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, scale=scale, implementation="blocked", block_q=3, block_k=4
        )
        return (out * g).sum()

    batched = torch.func.vmap(torch.func.grad(loss))(scales)
    for i in range(3):
        scale = scales[i]
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, scale=scale)
        assert_vjp_close_to_oracle(grads, q, k, v, g, scale=scale)
        assert_vjp_close_to_oracle((*grads[:3], batched[i]), q, k, v, g, scale=scale)


def _exploding_scale():
    raise AssertionError("the lazy scale was computed")


def test_lazy_dask_scale_is_not_computed(dask_backend):
    import dask
    import dask.array as da

    q, k, v, g = _inputs(dask_backend, "float32")
    bomb = da.from_delayed(dask.delayed(_exploding_scale)(), shape=(), dtype=np.float32)
    out = sdpa_array.scaled_dot_product_attention(q, k, v, scale=bomb)
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, scale=bomb)
    assert all(isinstance(a, da.Array) for a in (out, *grads))
    with pytest.raises(AssertionError, match="lazy scale was computed"):
        out.compute()


BAD_SHAPES_AND_KINDS = [
    ("vector", lambda b: b.asarray(np.asarray([0.5]), "float32"), ValueError, r"scale.*\(1,\)"),
    ("matrix", lambda b: b.asarray(np.ones((2, 2)), "float32"), ValueError, r"scale.*\(2, 2\)"),
    ("integer", lambda b: b.asarray(np.asarray(2), "int32"), TypeError, r"scale.*floating dtype"),
    ("numpy-bool", lambda b: np.True_, TypeError, r"scale must be a real number.*bool"),
    ("list", lambda b: [0.5], TypeError, r"scale must be a real number.*list"),
]
BAD_VALUES = [0.0, -1.0, np.nan, np.inf]


def _check_refused(backend, scale, error, match):
    q, k, v, g = _inputs(backend, "float32")
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention(q, k, v, scale=scale)
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, scale=scale)


@pytest.mark.parametrize(
    ("make", "error", "match"), [pytest.param(*c[1:], id=c[0]) for c in BAD_SHAPES_AND_KINDS]
)
def test_bad_scale(backend, make, error, match):
    _check_refused(backend, make(backend), error, match)


@pytest.mark.parametrize("value", BAD_VALUES)
def test_bad_scale_value_where_readable(host_backend, value):
    scale = host_backend.asarray(np.asarray(value), "float32")
    _check_refused(host_backend, scale, ValueError, r"scale must be a positive finite number")


def test_scale_value_is_not_read_on_a_gpu(gpu_backend):
    """Reading a GPU array's value waits for the device (a host synchronisation in every
    call): a scale array on a GPU is taken as it is, like a JAX tracer's."""
    scale = gpu_backend.asarray(np.asarray(0.5), "float32")
    assert sdpa_array._arrays.compat.known_value(scale) is None


def test_scale_of_another_library(non_numpy_backend):
    q, k, v, _ = _inputs(non_numpy_backend, "float32")
    with pytest.raises(TypeError, match=r"scale must be .* inputs' library.*numpy\.ndarray"):
        sdpa_array.scaled_dot_product_attention(q, k, v, scale=np.asarray(0.5))


@pytest.mark.parametrize("flag", ["return_lse", "return_weights", "is_causal", "enable_gqa"])
def test_numpy_bool_flags(flag):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 3, 4)) for _ in range(3))
    result = sdpa_array.scaled_dot_product_attention(q, k, v, **{flag: np.True_})
    expected = sdpa_array.scaled_dot_product_attention(q, k, v, **{flag: True})
    for a, b in zip(
        result if isinstance(result, tuple) else (result,),
        (expected if isinstance(expected, tuple) else (expected,)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
