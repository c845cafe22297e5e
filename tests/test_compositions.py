"""What users compose the library with: function transforms and higher-order gradients.

Every implementation that claims autograd, on float64 inputs with causal, window, softcap,
GQA, mask and bias:

* torch: ``gradcheck`` and ``gradgradcheck`` (double backward, as a gradient penalty
  needs) of the output and the log-sum-exp; ``torch.func.grad`` and ``torch.func.vmap``
  against ``torch.autograd.grad`` and a loop over the batch;
* JAX: ``jax.grad`` under ``jit`` and ``vmap`` (under ``jit``) against the oracle's VJP;
  forward mode (``jax.jacfwd``) and ``jax.hessian`` through every implementation ``"auto"``
  may pick, and an explicit ``implementation="blocked"`` refuses ``jax.jacfwd`` with a
  ``TypeError`` naming the implementation that can.

Finite differences use torch's own ``gradcheck`` tolerances for float64; comparisons with
the oracle use the derived bound of :func:`sdpa_array.testing.vjp_oracle_and_bounds`;
two computations of the same float64 gradient are compared with that bound too.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import sdpa_array
from sdpa_array.testing import assert_within, vjp_oracle_and_bounds
from tests.libraries import NATIVE_LSE_REFUSED_DTYPES

#: (id, q, k, v shapes, options, mask shape, bias shape)
CASES = [
    (
        "causal+mask+bias",
        (1, 2, 5, 3),
        (1, 2, 6, 3),
        (1, 2, 6, 3),
        {"is_causal": True},
        (5, 6),
        (2, 5, 6),
    ),
    (
        "gqa+window-bottom-right",
        (1, 4, 5, 3),
        (1, 2, 7, 3),
        (1, 2, 7, 3),
        {"enable_gqa": True, "window": (2, 1), "alignment": "bottom_right"},
        None,
        (1, 4, 1, 7),
    ),
    (
        "softcap+causal",
        (2, 5, 3),
        (2, 6, 3),
        (2, 6, 3),
        {"softcap": 1.5, "is_causal": True},
        (6,),
        None,
    ),
]

#: Cases torch's and JAX's native kernels compute (no softcap); tests/test_native.py checks
#: that the softcap case is refused.
NATIVE_CASES = {"causal+mask+bias", "gqa+window-bottom-right"}

#: (id, implementation, block sizes)
IMPLEMENTATIONS = [
    ("materialized", "materialized", {}),
    ("blocked", "blocked", {}),
    ("blocked-2x3", "blocked", {"block_q": 2, "block_k": 3}),
    ("native", "native", {}),
    ("auto", "auto", {}),
]


def _params(implementations=IMPLEMENTATIONS):
    return [
        pytest.param(case, implementation, blocks, id=f"{case[0]}-{impl_id}")
        for case in CASES
        for impl_id, implementation, blocks in implementations
        if implementation != "native" or case[0] in NATIVE_CASES
    ]


def _draw(case):
    case_id, q_shape, k_shape, v_shape, options, mask_shape, bias_shape = case
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, v_shape))
    mask = None if mask_shape is None else rng.random(mask_shape) > 0.3
    if mask is not None:
        mask[..., 0] = True
    bias = None if bias_shape is None else rng.standard_normal(bias_shape)
    return [q, k, v] + ([bias] if bias is not None else []), mask, options


def _attention(mask, options, implementation, blocks, *, return_lse=True):
    """``f(q, k, v[, bias])`` returning ``(out, lse)`` (or ``out``) for the case."""

    def attention(q, k, v, *bias):
        return sdpa_array.scaled_dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias[0] if bias else None,
            return_lse=return_lse,
            implementation=implementation,
            **blocks,
            **options,
        )

    return attention


# --------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------


def _torch_case(backend, case):
    arrays, mask, options = _draw(case)
    leaves = tuple(backend.asarray(a, "float64").requires_grad_(True) for a in arrays)
    return leaves, None if mask is None else backend.asarray(mask), options


def _refused_natively(backend, implementation, leaves, mask, options) -> bool:
    """Whether ``"native"`` must refuse this float64 case with the log-sum-exp on the
    backend's device (``NATIVE_LSE_REFUSED_DTYPES``: torch on CUDA); if so, check that it
    does, with the stated reason."""
    refused = NATIVE_LSE_REFUSED_DTYPES.get((backend.library, backend.device), {})
    if implementation != "native" or "float64" not in refused:
        return False
    with pytest.raises(sdpa_array.CannotDelegateError, match=refused["float64"]):
        _attention(mask, options, implementation, {})(*leaves)
    return True


@pytest.mark.parametrize(("case", "implementation", "blocks"), _params())
def test_torch_double_backward(torch_backend, case, implementation, blocks):
    """First and second derivatives of ``out`` and ``lse`` against finite differences."""
    import torch

    leaves, mask, options = _torch_case(torch_backend, case)
    if _refused_natively(torch_backend, implementation, leaves, mask, options):
        return
    fn = _attention(mask, options, implementation, blocks)
    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize(("case", "implementation", "blocks"), _params(IMPLEMENTATIONS[:3]))
def test_torch_gradient_penalty_matches_materialized(torch_backend, case, implementation, blocks):
    """The regression users hit: ``create_graph=True`` through the blocked path.

    A gradient-penalty loss ``|dL/dq|²`` must give the same ``v.grad`` on every
    implementation; the reference is the materialized path, and the tolerance the oracle's
    float64 bound on ``dv`` (both are exact in exact arithmetic).
    """
    import torch

    leaves, mask, options = _torch_case(torch_backend, case)

    def penalty_grads(impl, blk):
        out, lse = _attention(mask, options, impl, blk)(*leaves)
        (dq,) = torch.autograd.grad((out**2).sum() + lse.sum(), leaves[:1], create_graph=True)
        assert dq.requires_grad
        return torch.autograd.grad((dq**2).sum(), leaves)

    got = penalty_grads(implementation, blocks)
    expected = penalty_grads("materialized", {})
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, expected, strict=False):
        scale = float(e.abs().max()) + 1.0
        assert float((g - e).abs().max()) <= 64 * 2.0**-52 * scale * max(g.shape), name


@pytest.mark.parametrize(("case", "implementation", "blocks"), _params())
def test_torch_func_grad_and_vmap(torch_backend, case, implementation, blocks):
    """``torch.func.grad`` equals ``torch.autograd.grad``; ``torch.func.vmap`` equals a loop."""
    import torch

    leaves, mask, options = _torch_case(torch_backend, case)
    if _refused_natively(torch_backend, implementation, leaves, mask, options):
        return
    fn = _attention(mask, options, implementation, blocks)
    argnums = tuple(range(len(leaves)))

    def loss(*xs):
        out, lse = fn(*xs)
        return (out**2).sum() + lse.sum()

    got = torch.func.grad(loss, argnums=argnums)(*leaves)
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-13 * (1 + float(e.abs().max())))

    stacked = torch.stack([leaves[0].detach(), 2 * leaves[0].detach()])
    rest = [x.detach() for x in leaves[1:]]
    mapped = torch.func.vmap(lambda q: fn(q, *rest)[0])(stacked)
    for i in range(2):
        torch.testing.assert_close(mapped[i], fn(stacked[i], *rest)[0], rtol=0, atol=1e-14)


def test_torch_blocked_runs_its_own_backward_under_torch_func(torch_backend):
    """``torch.func.grad`` goes through the blocked path's autograd.Function, so it keeps
    ``O(block)`` memory instead of every tile's probabilities."""
    import torch

    from sdpa_array._plan import autograd as _autograd

    seen = []
    original = _autograd._torch_function().backward

    def spy(ctx, *grads):
        seen.append(ctx.backward_choice.name)
        return original(ctx, *grads)

    function = _autograd._torch_function()
    try:
        function.backward = staticmethod(spy)
        leaves, mask, options = _torch_case(torch_backend, CASES[0])
        fn = _attention(mask, options, "blocked", {})
        torch.func.grad(lambda q: fn(q, *leaves[1:])[0].sum())(leaves[0])
    finally:
        function.backward = staticmethod(original)
    assert seen == ["blocked"]


# --------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------


def _jax_case(backend, case):
    arrays, mask, options = _draw(case)
    xs = tuple(backend.asarray(a, "float64") for a in arrays)
    return arrays, xs, mask, None if mask is None else backend.asarray(mask), options


@pytest.mark.parametrize(
    ("case", "implementation", "blocks"),
    # jax.nn.dot_product_attention computes in float32, so native takes no float64 call
    _params([i for i in IMPLEMENTATIONS if i[1] != "native"]),
)
def test_jax_grad_under_jit_and_vmap(jax_backend, case, implementation, blocks):
    import jax

    arrays, xs, mask, jmask, options = _jax_case(jax_backend, case)
    fn = _attention(jmask, options, implementation, blocks, return_lse=False)
    rng = np.random.default_rng(7)
    d_out = rng.standard_normal(jax.eval_shape(fn, *xs).shape)  # no eager run to compile
    argnums = tuple(range(len(xs)))

    def loss(*a):
        return (fn(*a) * d_out).sum()

    expected, bounds = vjp_oracle_and_bounds(
        "float64",
        *arrays[:3],
        d_out,
        mask=mask,
        bias=arrays[3] if len(arrays) > 3 else None,
        **options,
    )
    jitted = jax.jit(jax.grad(loss, argnums=argnums))(*xs)
    for name, g, e, b in zip(("dq", "dk", "dv", "dbias"), jitted, expected, bounds, strict=False):
        assert_within(g, e, b, name)
    # vmap under jit: the batching rules (and the custom_vjp's) are the same as eagerly, where
    # vmap would compile each of a few hundred batched operations anew (seconds a case).
    mapped = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, *[None] * (len(xs) - 1))))(
        jax.numpy.stack([xs[0], xs[0]]), *xs[1:]
    )
    assert_within(mapped[1], expected[0], bounds[0], "vmap dq")


#: How often the hessian below is compiled afresh, and each program run (issue 29: an earlier
#: GPU run once returned NaN here; 360 hessians on an H200 in run 11 did not).
HESSIAN_COMPILES, HESSIAN_RUNS = 3, 10


@pytest.mark.slow
def test_jax_hessian_is_finite_and_repeatable(jax_backend):
    """``jax.hessian`` under ``jit`` of the ``causal+mask+bias`` case, through
    ``materialized``, ``auto`` and ``blocked``: compiled afresh several times
    (``jax.clear_caches``) and each program run repeatedly, every hessian is finite and
    every run of one program gives the same bits."""
    import jax

    _, xs, _, jmask, options = _jax_case(jax_backend, CASES[0])
    programs = {
        "materialized": ("materialized", {}),
        "auto": ("auto", {"block_q": 2, "block_k": 3}),
        "blocked": ("blocked", {"block_q": 2, "block_k": 3}),
    }
    for compile_round in range(HESSIAN_COMPILES):
        jax.clear_caches()
        for name, (implementation, blocks) in programs.items():
            fn = _attention(jmask, options, implementation, blocks, return_lse=False)
            hessian = jax.jit(jax.hessian(lambda q, fn=fn: (fn(q, *xs[1:]) ** 2).sum()))
            first = np.asarray(hessian(xs[0]))
            assert np.isfinite(first).all(), f"{name}: non-finite hessian ({compile_round})"
            for run in range(1, HESSIAN_RUNS):
                again = np.asarray(hessian(xs[0]))
                assert np.array_equal(again, first), f"{name}: run {run} differs ({compile_round})"


@pytest.mark.parametrize(
    "case",
    # Each case compiles jax.hessian of several tiles a row under jit three times (about
    # 10 s): the first runs by default, the others are slow.
    [pytest.param(c, id=c[0], marks=[pytest.mark.slow] if i else []) for i, c in enumerate(CASES)],
)
def test_jax_forward_mode(jax_backend, case):
    """``jax.jacfwd`` and ``jax.hessian`` (under ``jit``) through ``"auto"`` with block
    sizes given (so the blocked path is chosen) and through ``"blocked"`` agree with the
    materialized path; an explicit ``"blocked"`` refuses ``jax.jacfwd``."""
    import jax

    _, xs, _, jmask, options = _jax_case(jax_backend, case)

    def scalar(implementation, blocks):
        fn = _attention(jmask, options, implementation, blocks, return_lse=False)
        return lambda q: (fn(q, *xs[1:]) ** 2).sum()

    materialized = scalar("materialized", {})
    g_ref = jax.jit(jax.grad(materialized))(xs[0])
    h_ref = jax.jit(jax.hessian(materialized))(xs[0])
    tolerance = 1e-12 * (1 + float(abs(h_ref).max()) + float(abs(g_ref).max()))
    auto = scalar("auto", {"block_q": 2, "block_k": 3})
    assert float(abs(jax.jit(jax.jacfwd(auto))(xs[0]) - g_ref).max()) <= tolerance
    assert float(abs(jax.jit(jax.hessian(auto))(xs[0]) - h_ref).max()) <= tolerance
    blocked = scalar("blocked", {"block_q": 2, "block_k": 3})
    assert float(abs(jax.jit(jax.hessian(blocked))(xs[0]) - h_ref).max()) <= tolerance
    with pytest.raises(TypeError, match="implementation='materialized'"):
        jax.jacfwd(scalar("blocked", {}))(xs[0])
