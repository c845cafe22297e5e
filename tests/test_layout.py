"""The ``layout`` option: (batch..., length, heads, features) inputs and outputs.

On every backend and dtype, with the implementations that apply, a ``layout="BLHE"`` call
(forward with the log-sum-exp, and the VJP) is checked against the float64 oracle with the
derived bounds of the same call in the default layout: its results, with the length and
heads axes exchanged back, are compared with the oracle on the inputs so exchanged (a
layout only moves axes, so the bound is that of the heads-first call). The oracle's own
``layout`` (written separately, in ``sdpa_array.reference``) is checked against its
heads-first result, and torch autograd and ``jax.grad`` through a ``"BLHE"`` call against
the oracle's gradients. Bad layouts get a ``ValueError`` naming the option.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array.testing import assert_close_to_oracle, assert_vjp_close_to_oracle

B, L, S, HQ, HKV, E = 2, 5, 7, 4, 2, 8
OPTIONS = {"is_causal": True, "enable_gqa": True}


def _swap(x):
    """Axes -3 and -2 exchanged, in x's own library."""
    xp = sdpa_array._arrays.compat.array_namespace({"x": x})
    order = [*range(x.ndim - 3), x.ndim - 2, x.ndim - 3, x.ndim - 1]
    return xp.permute_dims(x, tuple(order))


def _case(seed=0):
    """BLHE query, key, value, output cotangent and a (B, HQ, L, S) bias, as NumPy."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, L, HQ, E))
    k = rng.standard_normal((B, S, HKV, E))
    v = rng.standard_normal((B, S, HKV, E))
    d_out = rng.standard_normal((B, L, HQ, E))
    bias = rng.standard_normal((B, HQ, L, S))
    return q, k, v, d_out, bias


@pytest.mark.parametrize("implementation", ["auto", "materialized", "blocked"])
def test_forward_and_vjp_in_blhe(backend_dtype, implementation):
    backend, dtype = backend_dtype
    q, k, v, d_out, bias = (backend.asarray(a, dtype) for a in _case())
    out, lse = sdpa_array.scaled_dot_product_attention(
        q, k, v, bias=bias, return_lse=True, layout="BLHE", implementation=implementation, **OPTIONS
    )
    assert tuple(out.shape) == (B, L, HQ, E)
    heads_first = [_swap(x) for x in (q, k, v)]
    assert_close_to_oracle((_swap(out), lse), *heads_first, bias=bias, return_lse=True, **OPTIONS)
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, v, d_out, bias=bias, layout="BLHE", implementation=implementation, **OPTIONS
    )
    assert [tuple(g.shape) for g in grads[:3]] == [tuple(x.shape) for x in (q, k, v)]
    assert_vjp_close_to_oracle(
        (*(_swap(g) for g in grads[:3]), grads[3]),
        *heads_first,
        _swap(d_out),
        bias=bias,
        **OPTIONS,
    )


def test_the_oracles_layout_moves_axes_only():
    q, k, v, d_out, bias = _case(1)
    swapped = [np.swapaxes(x, -3, -2) for x in (q, k, v)]
    out, lse = reference.scaled_dot_product_attention(
        q, k, v, bias=bias, return_lse=True, layout="BLHE", **OPTIONS
    )
    out_h, lse_h = reference.scaled_dot_product_attention(
        *swapped, bias=bias, return_lse=True, **OPTIONS
    )
    np.testing.assert_array_equal(out, np.swapaxes(out_h, -3, -2))
    np.testing.assert_array_equal(lse, lse_h)
    grads = reference.scaled_dot_product_attention_vjp(
        q, k, v, d_out, bias=bias, layout="BLHE", **OPTIONS
    )
    grads_h = reference.scaled_dot_product_attention_vjp(
        *swapped, np.swapaxes(d_out, -3, -2), bias=bias, **OPTIONS
    )
    for g, h in zip(grads[:3], grads_h[:3], strict=True):
        np.testing.assert_array_equal(g, np.swapaxes(h, -3, -2))
    np.testing.assert_array_equal(grads[3], grads_h[3])


def test_torch_autograd_through_blhe(torch_backend):
    torch = pytest.importorskip("torch")
    q, k, v, d_out, bias = (torch_backend.asarray(a, "float64") for a in _case(2))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
    out = sdpa_array.scaled_dot_product_attention(
        *leaves[:3], bias=leaves[3], layout="BLHE", **OPTIONS
    )
    grads = torch.autograd.grad(out, leaves, d_out)
    assert_vjp_close_to_oracle(
        (*(_swap(g) for g in grads[:3]), grads[3]),
        *(_swap(x) for x in (q, k, v)),
        _swap(d_out),
        bias=bias,
        **OPTIONS,
    )


def test_jax_grad_under_jit_through_blhe(jax_backend):
    jax = pytest.importorskip("jax")
    q, k, v, d_out, bias = (jax_backend.asarray(a, "float64") for a in _case(3))

    def loss(q, k, v, bias):
        out = sdpa_array.scaled_dot_product_attention(q, k, v, bias=bias, layout="BLHE", **OPTIONS)
        return (out * d_out).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert_vjp_close_to_oracle(
        (*(_swap(g) for g in grads[:3]), grads[3]),
        *(_swap(x) for x in (q, k, v)),
        _swap(d_out),
        bias=bias,
        **OPTIONS,
    )


@pytest.mark.parametrize(
    ("layout", "shape", "match"),
    [
        ("BSHD", (2, 3, 4), "layout must be one of"),
        (None, (2, 3, 4), "layout must be one of"),
        ("BLHE", (3, 4), "needs .* heads axis"),
    ],
)
def test_bad_layouts_are_refused_before_any_work(layout, shape, match):
    x = np.zeros(shape)
    for call in (
        lambda: sdpa_array.scaled_dot_product_attention(x, x, x, layout=layout),
        lambda: sdpa_array.scaled_dot_product_attention_vjp(x, x, x, x, layout=layout),
        lambda: sdpa_array.explain(x, x, x, layout=layout),
        lambda: reference.scaled_dot_product_attention(x, x, x, layout=layout),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_torch_func_vmap_and_double_backward_through_blhe(torch_cpu_backend):
    """``torch.func.grad`` equals autograd, ``torch.func.vmap`` equals a loop, and double
    backward (``gradgradcheck``, float64, the materialized path) holds in ``"BLHE"``."""
    torch = pytest.importorskip("torch")
    q, k, v, _, _ = (torch_cpu_backend.asarray(a, "float64") for a in _case(4))

    def attend(q, k, v):
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, layout="BLHE", implementation="materialized", **OPTIONS
        )

    def loss(q):
        return (attend(q, k, v) ** 2).sum()

    leaf = q.detach().clone().requires_grad_()
    expected = torch.autograd.grad(loss(leaf), leaf)[0]
    torch.testing.assert_close(torch.func.grad(loss)(q), expected, rtol=0, atol=0)
    stacked = torch.stack([q, 2 * q])
    mapped = torch.func.vmap(lambda x: attend(x, k, v))(stacked)
    for i in range(2):
        torch.testing.assert_close(mapped[i], attend(stacked[i], k, v), rtol=0, atol=0)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradgradcheck(attend, leaves)
