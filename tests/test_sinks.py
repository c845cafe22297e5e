"""Attention sinks: one extra softmax logit per query head whose value contributes nothing.

* forward (output, weights, log-sum-exp) and gradients (``grad_sinks`` after ``grad_bias``,
  before ``grad_scale``) against the oracle on every path (:mod:`tests.paths`: the VJP and
  autograd among them), backend and dtype, combined with mask, causal, GQA, softcap and a
  bias, with fully masked rows (zero output, ``lse = sink``) and calls without keys (the
  same, on the path that skips the kernels); native kernels refuse sinks;
* the oracle against its definition: the gpt-oss formulation (sink as an extra logit
  column, softmax, drop the column) through torch autograd, and central finite differences;
* autograd through the log-sum-exp reaches the sinks;
* bad sinks raise errors naming them.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array.testing import assert_vjp_close_to_oracle
from tests.helpers import as_checked
from tests.paths import FeatureCase, check_on_path, random_normal

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

Q, KV = (2, 4, 6, 4), (2, 2, 7, 4)


def _mask() -> np.ndarray:
    mask = np.random.default_rng(5).random((Q[-2], KV[-2])) > 0.3
    mask[2] = False  # a row with no admissible key: zero output, lse = sink
    return mask


def _case(backend, dtype, options, sinks_shape=(4,), seed=0):
    rng = np.random.default_rng(seed)
    q = backend.asarray(rng.standard_normal(Q), dtype)
    k = backend.asarray(rng.standard_normal(KV), dtype)
    v = backend.asarray(rng.standard_normal(KV), dtype)
    g = backend.asarray(rng.standard_normal(Q), dtype)
    sinks = backend.asarray(rng.standard_normal(sinks_shape), dtype)
    options = dict(options, enable_gqa=True)
    if options.get("mask") == "rows":
        options["mask"] = backend.asarray(_mask())
    return q, k, v, g, sinks, options


def _path_case(id_, options, native="sinks"):
    sinks = {"sinks": random_normal(4, seed=8), "enable_gqa": True}
    return FeatureCase(id_, Q, KV, KV, {**options, **sinks}, native=native)


PATH_CASES = [
    _path_case("plain", {}),
    # native kernels name the first reason they cannot compute a call
    _path_case("causal-softcap", {"is_causal": True, "softcap": 2.5}, native="softcap"),
    _path_case("masked-rows", {"mask": _mask()}),
    _path_case("masked-rows+causal", {"mask": _mask(), "is_causal": True}),
    FeatureCase(
        "broadcast-sinks+bias",
        Q,
        KV,
        KV,
        {"sinks": random_normal(2, 1, seed=9), "bias": random_normal(6, 7), "enable_gqa": True},
    ),
]


def test_on_every_path(path_case):
    """Output, log-sum-exp and gradients (``grad_sinks`` after ``grad_bias``) on every path
    (:mod:`tests.paths`) against the oracle; native kernels refuse sinks, naming them."""
    check_on_path(path_case)


def test_weights_sum_below_one_and_empty_rows_give_the_sink(backend):
    q, k, v, _, sinks, options = _case(backend, "float32", {"mask": "rows"})
    out, w, lse = sdpa_array.scaled_dot_product_attention(
        q, k, v, sinks=sinks, return_weights=True, return_lse=True, **options
    )
    w, out, lse = (reference.to_numpy(a) for a in (w, out, lse))
    assert np.all(w.sum(-1) < 1)
    assert np.all(out[..., 2, :] == 0)
    np.testing.assert_array_equal(lse[..., 2], np.broadcast_to(reference.to_numpy(sinks), Q[:2]))


def test_calls_without_keys_give_the_sink(backend):
    """With ``S == 0`` no kernel runs: every row's log-sum-exp is its head's sink still, and
    its output zero; without sinks, ``-inf``."""
    q, k, v, g, sinks, options = _case(backend, "float32", {}, sinks_shape=(2, 1))
    empty = (k[..., :0, :], v[..., :0, :])
    out, lse = sdpa_array.scaled_dot_product_attention(
        q, *empty, sinks=sinks, return_lse=True, **options
    )
    want = np.broadcast_to(reference.to_numpy(sinks)[..., None], Q[:3])
    np.testing.assert_array_equal(reference.to_numpy(lse), want)
    assert not np.any(reference.to_numpy(out))
    _, lse = sdpa_array.scaled_dot_product_attention(q, *empty, return_lse=True, **options)
    assert np.all(reference.to_numpy(lse) == -np.inf)
    assert_vjp_close_to_oracle(
        sdpa_array.scaled_dot_product_attention_vjp(q, *empty, g, sinks=sinks, **options),
        q, *empty, g, sinks=sinks, **options,
    )  # fmt: skip


def test_grad_order_bias_sinks_scale_and_broadcast_sinks(backend):
    rng = np.random.default_rng(1)
    q, k, v, g, sinks, options = _case(backend, "float32", {}, sinks_shape=(2, 1))
    bias = backend.asarray(rng.standard_normal((4, 1, 7)), "float32")
    scale = backend.asarray(np.asarray(0.8), "float32")
    options = {**options, "bias": bias, "scale": scale, "sinks": sinks}
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **options)
    assert len(grads) == 6
    assert tuple(grads[4].shape) == (2, 1)
    assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, options, vjp=True))


def _gpt_oss(torch, q, k, v, sinks, mask):
    """The gpt-oss formulation: the sink as an extra logit column, softmax, drop it."""
    k_rep = k.repeat_interleave(2, dim=-3)
    v_rep = v.repeat_interleave(2, dim=-3)
    z = q @ k_rep.transpose(-1, -2) / q.shape[-1] ** 0.5
    z = z.masked_fill(~mask, -torch.inf)
    col = sinks[:, None, None].expand(*z.shape[:-1], 1)
    w = torch.softmax(torch.cat([z, col], dim=-1), dim=-1)[..., :-1]
    return w @ v_rep


def test_oracle_matches_gpt_oss_through_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(s) for s in (Q, KV, KV, (4,))]
    g, mask = rng.standard_normal(Q), _mask()
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = _gpt_oss(torch, *leaves, torch.tensor(mask))
    expected = torch.autograd.grad((out * torch.tensor(g)).sum(), leaves)
    q, k, v, s = arrays
    options = {"sinks": s, "mask": mask, "enable_gqa": True}
    np.testing.assert_allclose(
        reference.scaled_dot_product_attention(q, k, v, **options),
        out.detach().numpy(),
        rtol=1e-12,
        atol=1e-12,
    )
    grads = reference.scaled_dot_product_attention_vjp(q, k, v, g, **options)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_grad_sinks_matches_central_differences(implementation):
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal(s) for s in (Q, KV, KV, Q))
    sinks = rng.standard_normal((2, 4))
    options = {"mask": _mask(), "enable_gqa": True, "softcap": 3.0, "return_lse": True}
    g_lse = rng.standard_normal(Q[:-1])

    def loss(s):
        out, lse = sdpa_array.scaled_dot_product_attention(q, k, v, sinks=s, **options)
        return float(np.sum(out * g) + np.sum(lse * g_lse))

    h = 1e-6
    numeric = np.zeros_like(sinks)
    for idx in np.ndindex(sinks.shape):
        e = np.zeros_like(sinks)
        e[idx] = h
        numeric[idx] = (loss(sinks + e) - loss(sinks - e)) / (2 * h)
    # the VJP has no lse cotangent: check it on the output, autograd below covers lse
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q,
        k,
        v,
        g,
        sinks=sinks,
        mask=options["mask"],
        enable_gqa=True,
        softcap=3.0,
        implementation=implementation,
    )
    g_lse[:] = 0
    numeric_out = np.zeros_like(sinks)
    for idx in np.ndindex(sinks.shape):
        e = np.zeros_like(sinks)
        e[idx] = h
        numeric_out[idx] = (loss(sinks + e) - loss(sinks - e)) / (2 * h)
    np.testing.assert_allclose(grads[3], numeric_out, rtol=1e-6, atol=1e-8)
    assert not np.allclose(numeric, numeric_out)  # the lse cotangent mattered above


def _autograd(backend, f, args):
    if backend.library == "torch":
        import torch

        leaves = [a.detach().requires_grad_(True) for a in args]
        return tuple(torch.autograd.grad(f(*leaves), leaves))
    import jax

    return tuple(jax.grad(f, argnums=tuple(range(len(args))))(*args))


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_autograd_through_the_lse_reaches_the_sinks(autograd_backend, implementation):
    backend = autograd_backend
    q, k, v, g, sinks, options = _case(backend, "float64", {"mask": "rows"})
    xp = sdpa_array._arrays.compat.array_namespace({"q": q})
    g_lse = backend.asarray(np.random.default_rng(4).standard_normal(Q[:-1]), "float64")

    def loss(sinks):
        out, lse = sdpa_array.scaled_dot_product_attention(
            q, k, v, sinks=sinks, return_lse=True, implementation=implementation, **options
        )
        return xp.sum(out * g) + xp.sum(lse * g_lse)

    (got,) = _autograd(backend, loss, (sinks,))
    s = reference.to_numpy(sinks)
    mask = reference.to_numpy(options["mask"])
    arrays = [reference.to_numpy(a) for a in (q, k, v, g, g_lse)]

    def ref_loss(s):
        out, lse = reference.scaled_dot_product_attention(
            *arrays[:3], sinks=s, mask=mask, enable_gqa=True, return_lse=True
        )
        return np.sum(out * arrays[3]) + np.sum(lse * arrays[4])

    h = 1e-6
    numeric = [
        (ref_loss(s + h * np.eye(4)[i]) - ref_loss(s - h * np.eye(4)[i])) / (2 * h)
        for i in range(4)
    ]
    np.testing.assert_allclose(reference.to_numpy(got), numeric, rtol=1e-6, atol=1e-8)


def test_bad_sinks_name_the_argument():
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\) does not broadcast"):
        sdpa_array.scaled_dot_product_attention(q, q, q, sinks=np.zeros(3))
    with pytest.raises(TypeError, match="sinks must have a real floating dtype"):
        sdpa_array.scaled_dot_product_attention(q, q, q, sinks=np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_torch_gradcheck_with_sinks_and_dropout(torch_backend, implementation):
    import torch

    rng = np.random.default_rng(6)
    shapes = ((1, 4, 5, 3), (1, 2, 6, 3), (1, 2, 6, 3), (4,))
    args = [torch_backend.asarray(rng.standard_normal(s), "float64") for s in shapes]
    args = [a.requires_grad_(True) for a in args]
    options = {"enable_gqa": True, "is_causal": True, "dropout_p": 0.25, "dropout_seed": 3}

    def f(q, k, v, sinks):
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, sinks=sinks, implementation=implementation, **options
        )

    assert torch.autograd.gradcheck(f, tuple(args))
