"""Gradients through ``scaled_dot_product_attention`` with the libraries' own autodiff.

* torch tensors with ``requires_grad``, for every implementation (the blocked one through
  its ``torch.autograd.Function``), against the float64 oracle's VJP within the bound of
  :func:`sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds`;
* ``jax.grad`` (eager and under ``jax.jit``), the blocked path through its
  ``jax.custom_vjp``, against the same oracle;
* the log-sum-exp output's gradient, what the blocked path saves for backward (``O(block)``,
  not the probabilities), and torch's second derivative through it (``gradgradcheck``);
* ``"native"`` only for the cases it delegates; the others must refuse, naming the reason.
"""

from __future__ import annotations

import sys
import zlib

import numpy as np
import pytest

import sdpa_array
from sdpa_array import CannotDelegateError, reference
from sdpa_array._kernels import vjp_blocked
from sdpa_array._plan import autograd as _autograd
from tests.helpers import (
    KV,
    KV_EV,
    Q_GQA,
    Q,
    assert_array_like,
    assert_within,
    rounded,
    vjp_oracle_and_bounds,
)

#: (id, implementation, block sizes) of the forward pass that autodiff goes through.
IMPLEMENTATIONS = [
    pytest.param("materialized", {}, id="materialized"),
    pytest.param("blocked", {}, id="blocked"),
    pytest.param("blocked", {"block_q": 3, "block_k": 4}, id="blocked-3x4"),
    pytest.param("native", {}, id="native"),
    pytest.param("auto", {}, id="auto"),
]

#: A case's ``native`` entry: every torch and JAX backend must delegate it (output only, in
#: the dtypes the tests use), or the reason the refusal must name.
DELEGATES = True

# (id, q, k, v shapes, options, mask shape, bias shape, native). The first two share the
# shapes of tests/helpers.py, as tests/test_vjp.py's cases do: JAX compiles the blocked
# backward kernel once for both files. "dead-rows" keeps L = 7, S = 3: its first query
# block of 3 has no admissible key at all.
CASES = [
    (
        "mask+bias+causal",
        Q,
        KV,
        KV,
        {"is_causal": True},
        (6, 7),
        (2, 6, 7),
        DELEGATES,
    ),
    (
        "gqa+window+softcap-bottom-right",
        Q_GQA,
        KV,
        KV_EV,
        {"enable_gqa": True, "window": (2, 1), "softcap": 2.0, "alignment": "bottom_right"},
        None,
        (1, 4, 1, 7),
        "softcap",
    ),
    (
        "dead-rows",
        (1, 7, 4),
        (1, 3, 4),
        (1, 3, 4),
        {"is_causal": True, "alignment": "bottom_right"},
        None,
        None,
        DELEGATES,
    ),
]

CASE_FIELDS = ("case_id", "q_shape", "k_shape", "v_shape", "options", "mask_shape", "bias_shape")


def implementations_and_cases(implementations):
    """Every (implementation, case) pair, ``"native"`` only with the cases it delegates."""
    return [
        pytest.param(*impl.values, *case[:-1], id=f"{case[0]}-{impl.id}", marks=impl.marks)
        for case in CASES
        for impl in implementations
        if "native" not in impl.values or case[-1] is DELEGATES
    ]


#: The cases native refuses, with the reason.
REFUSED = [pytest.param(*c[:-1], c[-1], id=c[0]) for c in CASES if c[-1] is not DELEGATES]


def _draw(case_id, q_shape, k_shape, v_shape, mask_shape, bias_shape, options):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, v_shape))
    mask = None if mask_shape is None else rng.random(mask_shape) > 0.3
    if mask is not None:
        mask[..., 0] = True
    bias = None if bias_shape is None else rng.standard_normal(bias_shape)
    out = reference.scaled_dot_product_attention(q, k, v, mask=mask, bias=bias, **options)
    return q, k, v, rng.standard_normal(out.shape), mask, bias


# --------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    ("implementation", "blocks", *CASE_FIELDS), implementations_and_cases(IMPLEMENTATIONS)
)
def test_torch_requires_grad(
    torch_backend,
    dtype,
    implementation,
    blocks,
    case_id,
    q_shape,
    k_shape,
    v_shape,
    options,
    mask_shape,
    bias_shape,
):
    q, k, v, d_out, mask, bias = _draw(
        case_id, q_shape, k_shape, v_shape, mask_shape, bias_shape, options
    )
    (tq, q64), (tk, k64), (tv, v64), (tg, g64) = (
        rounded(torch_backend, a, dtype) for a in (q, k, v, d_out)
    )
    tb, b64 = (None, None) if bias is None else rounded(torch_backend, bias, dtype)
    leaves = [x.requires_grad_(True) for x in (tq, tk, tv, tb) if x is not None]
    out = sdpa_array.scaled_dot_product_attention(
        tq,
        tk,
        tv,
        mask=None if mask is None else torch_backend.asarray(mask),
        bias=tb,
        implementation=implementation,
        **blocks,
        **options,
    )
    if implementation == "blocked":  # through its own backward kernel, not torch's autodiff
        assert type(out.grad_fn).__name__ == f"{_autograd._torch_function().__name__}Backward"
    out.backward(tg)
    expected, bounds = vjp_oracle_and_bounds(
        dtype, q64, k64, v64, g64, mask=mask, bias=b64, **options
    )
    names = ("dq", "dk", "dv", "dbias")[: len(leaves)]
    for name, x, e, b in zip(names, leaves, expected, bounds, strict=True):
        assert_array_like(x.grad, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(x.grad, e, b, name)


@pytest.mark.parametrize((*CASE_FIELDS, "reason"), REFUSED)
def test_native_refuses_with_the_reason(
    autograd_backend, case_id, q_shape, k_shape, v_shape, options, mask_shape, bias_shape, reason
):
    """The cases above that ``"native"`` is not generated for raise its documented error."""
    q, k, v, _, mask, bias = _draw(
        case_id, q_shape, k_shape, v_shape, mask_shape, bias_shape, options
    )
    x = [autograd_backend.asarray(a, "float32") for a in (q, k, v)]
    with pytest.raises(CannotDelegateError, match=reason):
        sdpa_array.scaled_dot_product_attention(
            *x,
            mask=None if mask is None else autograd_backend.asarray(mask),
            bias=None if bias is None else autograd_backend.asarray(bias, "float32"),
            implementation="native",
            **options,
        )


def test_torch_blocked_saves_no_score_matrix(torch_backend):
    """What autograd keeps for the backward pass: ``O(block)`` on the blocked path (inputs,
    output, log-sum-exp), the ``(L, S)`` probabilities on the materialized one."""
    import torch

    L, S, E = 256, 512, 8
    rng = np.random.default_rng(3)
    q, k, v = (torch_backend.asarray(rng.standard_normal((2, n, E)), "float32") for n in (L, S, S))
    for x in (q, k, v):
        x.requires_grad_(True)

    def saved_bytes(implementation):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sdpa_array.scaled_dot_product_attention(
                q, k, v, implementation=implementation
            ).sum().backward()
        return sum(sizes)

    score_matrix = 2 * L * S * 4
    assert saved_bytes("blocked") < score_matrix / 8
    assert saved_bytes("materialized") >= score_matrix


def _lse_loss_and_finite_differences():
    """Inputs, weights and the central differences of ``sum(w_out * out) + sum(w_lse * lse)``.

    The differences use the library's float64 forward (materialized) on NumPy, with the step
    and tolerance of ``tests/test_vjp.py``'s finite-difference test.
    """
    from tests.test_vjp import FD_STEP, FD_TOLERANCE

    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s) for s in ((2, 5, 4), (2, 7, 4), (2, 7, 3), (2, 5, 7))]
    w_out, w_lse = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5))

    def loss(q, k, v, bias):
        out, lse = sdpa_array.scaled_dot_product_attention(
            q, k, v, bias=bias, return_lse=True, implementation="materialized"
        )
        return float(np.sum(out * w_out) + np.sum(lse * w_lse))

    expected = []
    for which, x in enumerate(arrays):
        g = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
            plus[which][idx] += FD_STEP
            minus[which][idx] -= FD_STEP
            g[idx] = (loss(*plus) - loss(*minus)) / (2 * FD_STEP)
        expected.append(g)
    return arrays, w_out, w_lse, expected, FD_TOLERANCE


def _assert_matches_differences(got, expected, tolerance):
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, expected, strict=True):
        err = float(np.max(np.abs(reference.to_numpy(g) - e)))
        bound = tolerance * max(1.0, float(np.max(np.abs(e))))
        assert err <= bound, f"{name}: error {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS[:3])
def test_torch_log_sum_exp_gradient(torch_backend, implementation, blocks):
    import torch

    arrays, w_out, w_lse, expected, tolerance = _lse_loss_and_finite_differences()
    xs = [torch_backend.asarray(a, "float64").requires_grad_(True) for a in arrays]
    out, lse = sdpa_array.scaled_dot_product_attention(
        *xs[:3], bias=xs[3], return_lse=True, implementation=implementation, **blocks
    )
    loss = (out * torch_backend.asarray(w_out)).sum() + (lse * torch_backend.asarray(w_lse)).sum()
    _assert_matches_differences(torch.autograd.grad(loss, xs), expected, tolerance)


def test_torch_blocked_second_derivative_is_exact(torch_backend):
    """Double backward through the blocked path's own backward kernel (``create_graph``)
    matches central finite differences of its first derivative (torch's ``gradgradcheck``,
    float64), with a bias, a causal restriction and several tiles per row."""
    import torch

    rng = np.random.default_rng(5)
    q, k, v, bias = (
        torch_backend.asarray(rng.standard_normal(s), "float64").requires_grad_(True)
        for s in ((2, 5, 4), (2, 7, 4), (2, 7, 3), (2, 5, 7))
    )

    def attention(q, k, v, bias):
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, bias=bias, is_causal=True, implementation="blocked", block_q=2, block_k=3
        )

    out = attention(q, k, v, bias)
    assert type(out.grad_fn).__name__ == f"{_autograd._torch_function().__name__}Backward"
    assert torch.autograd.gradgradcheck(attention, (q, k, v, bias))


def test_torch_blocked_double_backward_after_a_tile_of_every_key(torch_backend, monkeypatch):
    """The blocked backward's key sums when a tile of every key (the first query block's,
    under a window open to the right) comes before a tile of some keys in one work item
    (the fifth block's, from key 256; on two threads the items take every fourth block):
    under ``create_graph`` nothing is written in place, and the first and second
    derivatives match the materialized path's (float64, both exact to rounding)."""
    import torch

    monkeypatch.setattr(vjp_blocked, "get_num_threads", lambda: 2)
    rng = np.random.default_rng(6)
    shapes = ((1, 300, 4), (1, 300, 4), (1, 300, 3))
    arrays = [rng.standard_normal(s) for s in shapes]
    results = []
    for implementation, blocks in (("blocked", {"block_q": 64}), ("materialized", {})):
        xs = [torch_backend.asarray(a, "float64").requires_grad_(True) for a in arrays]
        out = sdpa_array.scaled_dot_product_attention(
            *xs, window=(0, None), implementation=implementation, **blocks
        )
        first = torch.autograd.grad((out * out).sum(), xs, create_graph=True)
        second = torch.autograd.grad(sum((g * g).sum() for g in first), xs)
        results.append([t.detach().numpy() for t in (*first, *second)])
    for ours, materialized in zip(*results, strict=True):
        np.testing.assert_allclose(ours, materialized, rtol=1e-10, atol=1e-12)


def test_torch_without_grad_runs_the_plain_blocked_path(torch_backend):
    import torch

    q = torch_backend.asarray(np.ones((2, 3, 4)), "float32").requires_grad_(True)
    with torch.no_grad():
        out = sdpa_array.scaled_dot_product_attention(q, q, q, implementation="blocked")
    assert out.grad_fn is None
    out = sdpa_array.scaled_dot_product_attention(q.detach(), q, q, implementation="blocked")
    assert out.grad_fn is not None  # key and value still require grad


# --------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------


#: Under ``jax.jit`` for every implementation, and eagerly for the blocked path's
#: ``custom_vjp`` (the others are JAX's own autodiff of JAX operations either way; eager
#: JAX compiles every operation of a new shape, which makes it the slower test: with
#: several tiles a row, "blocked-3x4-eager", a few hundred operations, so it is ``slow``).
JAX_MODES = [
    *(pytest.param(True, *p.values, id=f"{p.id}-jit") for p in IMPLEMENTATIONS),
    *(
        pytest.param(
            False,
            *p.values,
            id=f"{p.id}-eager",
            marks=[pytest.mark.slow] if p.id == "blocked-3x4" else [],
        )
        for p in IMPLEMENTATIONS[1:3]
    ),
]


@pytest.mark.parametrize(
    ("jit", "implementation", "blocks", *CASE_FIELDS), implementations_and_cases(JAX_MODES)
)
def test_jax_grad(
    jax_backend,
    jit,
    implementation,
    blocks,
    case_id,
    q_shape,
    k_shape,
    v_shape,
    options,
    mask_shape,
    bias_shape,
):
    import jax

    dtype = "float32"  # jax.nn.dot_product_attention ("native") computes in float32
    q, k, v, d_out, mask, bias = _draw(
        case_id, q_shape, k_shape, v_shape, mask_shape, bias_shape, options
    )
    (jq, q64), (jk, k64), (jv, v64), (jg, g64) = (
        rounded(jax_backend, a, dtype) for a in (q, k, v, d_out)
    )
    jb, b64 = (None, None) if bias is None else rounded(jax_backend, bias, dtype)
    jmask = None if mask is None else jax_backend.asarray(mask)
    args = (jq, jk, jv) + ((jb,) if jb is not None else ())

    def loss(q, k, v, *bias):
        out = sdpa_array.scaled_dot_product_attention(
            q,
            k,
            v,
            mask=jmask,
            bias=bias[0] if bias else None,
            implementation=implementation,
            **blocks,
            **options,
        )
        return (out * jg).sum()

    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    got = (jax.jit(grad) if jit else grad)(*args)
    expected, bounds = vjp_oracle_and_bounds(
        dtype, q64, k64, v64, g64, mask=mask, bias=b64, **options
    )
    names = ("dq", "dk", "dv", "dbias")[: len(args)]
    for name, g, x, e, b in zip(names, got, args, expected, bounds, strict=True):
        assert_array_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(g, e, b, name)


#: The modes of JAX_MODES for the implementations whose log-sum-exp has a gradient here.
JAX_LSE_MODES = [p for p in JAX_MODES if p.values[1] not in ("native", "auto")]


@pytest.mark.parametrize(("jit", "implementation", "blocks"), JAX_LSE_MODES)
def test_jax_log_sum_exp_gradient(jax_backend, jit, implementation, blocks):
    import jax

    arrays, w_out, w_lse, expected, tolerance = _lse_loss_and_finite_differences()

    def loss(*xs):
        out, lse = sdpa_array.scaled_dot_product_attention(
            *xs[:3], bias=xs[3], return_lse=True, implementation=implementation, **blocks
        )
        return (out * w_out).sum() + (lse * w_lse).sum()

    xs = [jax_backend.asarray(a, "float64") for a in arrays]
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    _assert_matches_differences((jax.jit(grad) if jit else grad)(*xs), expected, tolerance)


# --------------------------------------------------------------------------------------
# arrays the caller's own functions capture
# --------------------------------------------------------------------------------------

#: Shapes of the captured-data cases: a relative position table of the caller's (one entry
#: per head and relative position ``i - j``, ``CL + CS - 1`` of them) and a temperature per
#: head, closed over by its own ``bias_mod`` and ``score_mod`` (nothing declared).
CB, CH, CL, CS, CE = 2, 3, 7, 9, 4

#: (implementation, block sizes) run on those cases: "auto" with block sizes runs the
#: blocked kernel, which must not fall back to the materialized one.
CAPTURED_RUNS = [
    pytest.param("blocked", {"block_q": 3, "block_k": 4}, id="blocked-3x4"),
    pytest.param("auto", {"block_q": 3}, id="auto"),
    pytest.param("materialized", {}, id="materialized"),
]


def _own_mods(table, temperature):
    """The caller's functions: ``bias = table[h, i - j + CS - 1]``, ``score / t[h]``."""

    def bias_mod(b, h, i, j):
        return table[h, i - j + CS - 1]

    def score_mod(s, b, h, i, j):
        return s / temperature[h]

    return bias_mod, score_mod


def _captured_case(dtype):
    """The arrays, rounded to ``dtype``, and the oracle's gradients of ``sum(out * g)`` in
    ``(q, k, v, table, temperature)`` with their bounds. The bias function is the dense bias
    ``table[h, i - j + CS - 1]`` for the oracle, so the table's gradient is the sum of the
    oracle's ``dBias`` along each diagonal; its bound is the sum of their bounds plus the
    rounding of a sum of ``n`` terms, ``(n + 3) u`` times the sum of their magnitudes."""
    rng = np.random.default_rng(48)
    q, g = (rng.standard_normal((CB, CH, CL, CE)) for _ in range(2))
    k, v = (rng.standard_normal((CB, CH, CS, CE)) for _ in range(2))
    table = rng.standard_normal((CH, CL + CS - 1))
    temperature = rng.uniform(0.5, 2.0, CH)
    arrays = [a.astype(dtype).astype(np.float64) for a in (q, k, v, g, table, temperature)]
    q64, k64, v64, g64, table64, t64 = arrays
    offsets = np.arange(CL)[:, None] - np.arange(CS)[None, :] + CS - 1
    dense = np.broadcast_to(table64[:, offsets], (CB, CH, CL, CS))  # dBias per batch entry
    expected, bounds = vjp_oracle_and_bounds(
        dtype, q64, k64, v64, g64, bias=dense,
        score_mod=sdpa_array.mods.temperature(t64), return_mod_gradients=True,
    )  # fmt: skip
    dq, dk, dv, dbias, dt = expected
    bq, bk, bv, bbias, bt = bounds
    u = np.finfo(dtype).eps / 2
    on_diagonal = offsets[None] == np.arange(CL + CS - 1)[:, None, None]  # (m, i, j)
    d_table = np.einsum("bhij,mij->hm", dbias, on_diagonal)
    n = CB * min(CL, CS)
    b_table = np.einsum("bhij,mij->hm", bbias + (n + 3) * u * np.abs(dbias), on_diagonal)
    b_table += u * np.abs(d_table)
    return arrays, [dq, dk, dv, d_table, dt], [bq, bk, bv, b_table, bt]


def _implementations_run(monkeypatch):
    """The names of the implementations whose forward kernels run from now on."""
    from sdpa_array._plan import dispatch

    ran = []
    forward = dispatch.Choice.forward

    def spy(self, p, x, outputs):
        ran.append(self.name)
        return forward(self, p, x, outputs)

    monkeypatch.setattr(dispatch.Choice, "forward", spy)
    return ran


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("implementation", "blocks"), CAPTURED_RUNS)
def test_torch_captured_arrays_get_their_gradients(
    torch_backend, monkeypatch, dtype, implementation, blocks
):
    """A table and a temperature that the caller's functions close over, tensors that
    require grad: their gradients and those of q, k, v against the oracle on every path;
    the blocked one (also chosen by "auto") through its own backward kernel."""
    arrays, expected, bounds = _captured_case(dtype)
    q, k, v, g, table, temperature = (torch_backend.asarray(a, dtype) for a in arrays)
    leaves = [x.requires_grad_(True) for x in (q, k, v, table, temperature)]
    bias_mod, score_mod = _own_mods(table, temperature)
    ran = _implementations_run(monkeypatch)
    out = sdpa_array.scaled_dot_product_attention(
        q, k, v, bias_mod=bias_mod, score_mod=score_mod, implementation=implementation, **blocks
    )
    if implementation != "materialized":
        assert ran == ["blocked"]
        assert type(out.grad_fn).__name__ == f"{_autograd._torch_function().__name__}Backward"
    out.backward(g)
    names = ("dq", "dk", "dv", "dtable", "dtemperature")
    for name, x, e, b in zip(names, leaves, expected, bounds, strict=True):
        assert_array_like(x.grad, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(x.grad, e, b, name)


def test_torch_captured_table_double_backward(torch_backend):
    """With ``create_graph`` the captured table's gradient is differentiable on the
    blocked path: its second derivative equals the materialized path's."""
    import torch

    arrays, _, _ = _captured_case("float64")
    q, k, v, g, table, temperature = (torch_backend.asarray(a, "float64") for a in arrays)

    def second(implementation, **blocks):
        t = table.clone().requires_grad_(True)
        bias_mod, _ = _own_mods(t, temperature)
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, bias_mod=bias_mod, implementation=implementation, **blocks
        )
        (d_t,) = torch.autograd.grad((out * g).sum(), t, create_graph=True)
        return torch.autograd.grad((d_t * d_t).sum(), t)[0]

    expected = second("materialized")
    got = second("blocked", block_q=3, block_k=4)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-9, atol=1e-12)


def test_torch_captured_tensor_the_wrapper_cannot_take_fails_loudly(torch_backend):
    """A captured tensor of a ``torch.func`` transform (the ``torch.autograd.Function``
    sees it unwrapped level by level): "auto" differentiates the materialized path, an
    explicit "blocked" raises a ``TypeError`` that says what to do."""
    import torch

    arrays, _, _ = _captured_case("float64")
    q, k, v, g, table, temperature = (torch_backend.asarray(a, "float64") for a in arrays)

    def loss(t, implementation, **blocks):
        bias_mod, _ = _own_mods(t, temperature)
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, bias_mod=bias_mod, implementation=implementation, **blocks
        )
        return (out * g).sum()

    reference_grad = torch.func.grad(loss)(table, "materialized")
    np.testing.assert_array_equal(torch.func.grad(loss)(table, "auto").numpy(), reference_grad)
    with pytest.raises(TypeError, match=r"torch\.func transform"):
        torch.func.grad(loss)(table, "blocked", block_q=3)


JAX_CAPTURED_RUNS = [
    pytest.param(False, "blocked", {"block_q": 3, "block_k": 4}, id="blocked-3x4"),
    pytest.param(True, "blocked", {"block_q": 3, "block_k": 4}, id="jit-blocked-3x4"),
    pytest.param(True, "auto", {"block_q": 3}, id="jit-auto"),
]


@pytest.mark.parametrize(("jit", "implementation", "blocks"), JAX_CAPTURED_RUNS)
def test_jax_captured_arrays_get_their_gradients(
    jax_backend, monkeypatch, jit, implementation, blocks
):
    """``jax.grad`` (eager and under ``jax.jit``) of a loss whose table and temperature
    the caller's functions close over (tracers): the blocked kernel's ``jax.custom_vjp``
    takes them as inputs; every gradient against the oracle."""
    import jax

    dtype = "float32"
    arrays, expected, bounds = _captured_case(dtype)
    xs = [jax_backend.asarray(a, dtype) for a in arrays]
    g = xs.pop(3)
    ran = _implementations_run(monkeypatch)

    def loss(q, k, v, table, temperature):
        bias_mod, score_mod = _own_mods(table, temperature)
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, bias_mod=bias_mod, score_mod=score_mod,
            implementation=implementation, **blocks,
        )  # fmt: skip
        return (out * g).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    got = (jax.jit(grad) if jit else grad)(*xs)
    assert set(ran) == {"blocked"}
    names = ("dq", "dk", "dv", "dtable", "dtemperature")
    for name, d, x, e, b in zip(names, got, xs, expected, bounds, strict=True):
        assert_array_like(d, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(d, e, b, name)


def test_jax_captured_arrays_in_forward_mode(jax_backend):
    """Forward mode (``jax.jvp``) through a function closing over a differentiated array:
    "auto" runs the materialized path, an explicit "blocked" (reverse mode only) raises a
    ``TypeError`` that says so."""
    import jax

    arrays, _, _ = _captured_case("float32")
    q, k, v, g, table, temperature = (jax_backend.asarray(a, "float32") for a in arrays)

    def loss(t, implementation, **blocks):
        bias_mod, _ = _own_mods(t, temperature)
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, bias_mod=bias_mod, implementation=implementation, **blocks
        )
        return (out * g).sum()

    tangent = np.linspace(-1.0, 1.0, table.size).reshape(table.shape)
    tangent = jax_backend.asarray(tangent, "float32")
    expected = jax.jvp(lambda t: loss(t, "materialized"), (table,), (tangent,))[1]
    got = jax.jvp(lambda t: loss(t, "auto", block_q=3), (table,), (tangent,))[1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    with pytest.raises(TypeError, match="reverse mode only"):
        jax.jvp(lambda t: loss(t, "blocked", block_q=3), (table,), (tangent,))


def test_torch_captured_tensors_found_in_globals_or_not_found(torch_backend, monkeypatch):
    """A table the caller's function names as a global is found and trained on the blocked
    path; one it reaches otherwise (an attribute of a callable object) is not, and its
    values' dependence on it is seen all the same: "auto" then differentiates the
    materialized path and "blocked" raises a ``TypeError``, neither silently drops the
    gradient."""
    import torch

    arrays, expected, bounds = _captured_case("float64")
    q, k, v, g, table, temperature = (torch_backend.asarray(a, "float64") for a in arrays)
    namespace = {"table": table.requires_grad_(True), "CS": CS}
    exec("def bias_mod(b, h, i, j):\n    return table[h, i - j + CS - 1]", namespace)
    ran = _implementations_run(monkeypatch)
    out = sdpa_array.scaled_dot_product_attention(
        q.requires_grad_(True), k, v, bias_mod=namespace["bias_mod"],
        score_mod=_own_mods(table, temperature)[1], implementation="auto", block_q=3,
    )  # fmt: skip
    assert ran == ["blocked"]
    assert type(out.grad_fn).__name__ == f"{_autograd._torch_function().__name__}Backward"
    out.backward(g)
    assert_within(table.grad, expected[3], bounds[3], "dtable")
    assert_within(q.grad, expected[0], bounds[0], "dq")
    q = q.detach()

    class Bias:
        def __init__(self, t):
            self.t = t

        def __call__(self, b, h, i, j):
            return self.t[h, i - j + CS - 1]

    def table_gradient(implementation, **blocks):
        t = table.detach().clone().requires_grad_(True)
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, bias_mod=Bias(t), implementation=implementation, **blocks
        )
        (out * g).sum().backward()
        return t.grad

    ran.clear()
    got = table_gradient("auto", block_q=3)
    assert ran == ["materialized"]
    np.testing.assert_array_equal(got.numpy(), table_gradient("materialized").numpy())
    with pytest.raises(TypeError, match="cannot take as inputs"):
        table_gradient("blocked", block_q=3)
    assert isinstance(got, torch.Tensor)


#: The peak memory test's script: through "auto" (the blocked kernel), the table's gradient
#: and the inputs', at L = S = 8192, one head, E = 16, float32; prints the growth of the
#: process's peak resident memory (KiB on Linux) over the call and its backward pass.
_PEAK_SCRIPT = """
import resource, sys
import torch, sdpa_array

L, E = 8192, 16
torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, L, E, requires_grad=True) for _ in range(3))

def train(n, **implementation):
    table = torch.randn(2 * n - 1, requires_grad=True)

    def bias_mod(b, h, i, j):
        return table[i - j + n - 1]

    x = (q, k, v) if n == L else (q[..., :n, :], k[..., :n, :], v[..., :n, :])
    out = sdpa_array.scaled_dot_product_attention(*x, bias_mod=bias_mod, **implementation)
    out.sum().backward()
    assert table.grad is not None and bool(torch.isfinite(table.grad).all())
    assert bool((table.grad != 0).any())

train(1024, implementation="blocked")  # the blocked path's code and buffers once
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
train(L)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_torch_captured_table_trains_in_block_memory(torch_backend):
    """A relative position table of the caller's trained through "auto" at L = S = 8192:
    the process's peak memory grows far less than the 256 MiB one ``(L, S)`` float32 score
    matrix takes (the materialized path holds several)."""
    import subprocess

    run = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    growth = int(run.stdout.split()[-1])
    assert growth < 64 * 2**20, f"peak memory grew by {growth / 2**20:.1f} MiB"
