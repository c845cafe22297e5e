"""The ``layout`` option: (batch..., length, heads, features) inputs and outputs.

On every path (:mod:`tests.paths`), backend and dtype, a ``layout="BLHE"`` call (forward
with the log-sum-exp, and the gradients) is checked against the float64 oracle with the
derived bounds of the same call in the default layout: its results, with the length and
heads axes exchanged back, are compared with the oracle on the inputs so exchanged (a
layout only moves axes, so the bound is that of the heads-first call). The oracle's own
``layout`` (written separately, in ``sdpa_array.reference``) is checked against its
heads-first result, and ``jax.grad`` under ``jax.jit`` through a ``"BLHE"`` call against
the oracle's gradients. Bad layouts get a ``ValueError`` naming the option.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array.testing import assert_vjp_close_to_oracle
from tests.paths import FeatureCase, check_on_path, swap_length_and_heads

B, L, S, HQ, HKV, E = 2, 5, 7, 4, 2, 8
OPTIONS = {"is_causal": True, "enable_gqa": True}


def _case(seed=0):
    """BLHE query, key, value, output cotangent and a (B, HQ, L, S) bias, as NumPy."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, L, HQ, E))
    k = rng.standard_normal((B, S, HKV, E))
    v = rng.standard_normal((B, S, HKV, E))
    d_out = rng.standard_normal((B, L, HQ, E))
    bias = rng.standard_normal((B, HQ, L, S))
    return q, k, v, d_out, bias


BLHE = {"layout": "BLHE"}

PATH_CASES = [
    FeatureCase("blhe", (B, L, HKV, E), (B, S, HKV, E), (B, S, HKV, E), BLHE, native=True),
    FeatureCase(
        "blhe-causal-gqa-bias",
        (B, L, HQ, E),
        (B, S, HKV, E),
        (B, S, HKV, E),
        {**BLHE, **OPTIONS, "bias": np.random.default_rng(0).standard_normal((B, HQ, L, S))},
        native=True,
    ),
    FeatureCase(
        "blhe-window-Ev!=E",
        (B, L, HKV, E),
        (B, S, HKV, E),
        (B, S, HKV, 3),
        {**BLHE, "window": (2, 1), "alignment": "bottom_right"},
    ),
]


# on JAX and Dask in `nox -s tests-slow`
@pytest.mark.slow_on("jax", "dask")
def test_on_every_path(path_case):
    """Output, log-sum-exp and gradients on every path (:mod:`tests.paths`), compared with
    the oracle on the inputs and results with the length and heads axes exchanged back."""
    check_on_path(path_case)


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


def test_jax_grad_under_jit_through_blhe(jax_backend):
    jax = pytest.importorskip("jax")
    q, k, v, d_out, bias = (jax_backend.asarray(a, "float64") for a in _case(3))

    def loss(q, k, v, bias):
        out = sdpa_array.scaled_dot_product_attention(q, k, v, bias=bias, layout="BLHE", **OPTIONS)
        return (out * d_out).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert_vjp_close_to_oracle(
        (*(swap_length_and_heads(g) for g in grads[:3]), grads[3]),
        *(swap_length_and_heads(x) for x in (q, k, v)),
        swap_length_and_heads(d_out),
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
