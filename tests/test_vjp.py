"""The backward pass: ``scaled_dot_product_attention_vjp`` on every backend and dtype.

Every feature's gradients on every path, against the oracle, are in the feature's own file
(:mod:`tests.paths`); this file checks what is the backward pass's own:

* the blocked path's batch split against the float64 oracle
  :func:`sdpa_array.reference.scaled_dot_product_attention_vjp` (which forms the softmax
  Jacobian explicitly) within the element-wise bound derived in
  :func:`sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds`;
* against central finite differences of the library's own forward pass, in float64, for
  every feature;
* against torch's autograd of ``torch.nn.functional.scaled_dot_product_attention`` in
  float64, for the features torch has;
* exact zeros for rows with no admissible key and keys nobody attends;
* validation, empty lengths, the blocked plan and the blocked path's ``O(block)`` memory.
"""

from __future__ import annotations

import tracemalloc
import zlib

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array._arrays.compat import array_namespace
from sdpa_array._kernels import vjp_blocked
from sdpa_array._kernels.restrictions import Restrictions
from sdpa_array._kernels.tiling import GRID_RESTRICTED, TILE_BYTES, plan_backward
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import validate
from tests.helpers import (
    KV,
    KV_EV,
    Q_GQA,
    Q,
    assert_array_like,
    assert_within,
    check_vjp_against_oracle,
    rounded,
    vjp_oracle_and_bounds,
)
from tests.libraries import SHAPE_COMPILING_LIBRARIES

#: The generic kernels' numerics, the same code as on NumPy, torch and array-api-strict (the
#: default sessions); on JAX (a compilation per new shape) and Dask (a graph per call) they
#: run in `nox -s tests-slow`, which CI runs. JAX's and Dask's own paths (autodiff, jit, the
#: Dask graph) are tested by default in test_autograd, test_compositions and test_dask_graph.
pytestmark = pytest.mark.slow_on("jax", "dask")

#: (implementation, block sizes): the blocked path with its default blocks holds whole rows
#: in one tile (softmax of the tile); with 3 x 4 blocks it needs several tiles per row in
#: most cases, runs the blocked forward pass and recomputes ``P`` from the log-sum-exp.
VARIANTS = [("materialized", {}), ("blocked", {}), ("blocked", {"block_q": 3, "block_k": 4})]
IMPLEMENTATIONS = [
    pytest.param(*variant, id=name)
    for variant, name in zip(VARIANTS, ("materialized", "blocked", "blocked-3x4"), strict=True)
]

# The cases whose batch axes broadcast or group in different ways, for the batch-split test
# (every feature's gradients on every path are in its own file: tests/paths.py). Each: (id,
# shapes of q, k, v, options, mask shape or None, bias shape or None).
CASES = [
    ("broadcast-batch", (3, 1, 5, 4), (1, 2, 6, 4), (2, 6, 7), {}, None, None),
    ("bias-broadcast-L", Q, KV, KV, {}, None, (2, 1, 1, 7)),
    ("mask+bias", Q, KV, KV, {}, (6, 7), (2, 2, 6, 7)),
    ("gqa", Q_GQA, KV, KV_EV, {"enable_gqa": True}, None, (4, 1, 7)),
    (
        "everything",
        Q_GQA,
        (2, 1, 7, 4),
        (2, 1, 7, 3),
        {
            "enable_gqa": True,
            "window": (4, 2),
            "is_causal": True,
            "softcap": 3.0,
            "scale": 0.5,
            "alignment": "bottom_right",
        },
        (2, 1, 6, 7),
        (4, 6, 7),
    ),
]


def _tiled_cases():
    """The cases, those with shapes of their own (the shapes are what they test) slow on
    libraries that compile every new shape, where the tiles make a few hundred operations
    to compile (seconds a case)."""
    return [
        pytest.param(
            *c,
            id=c[0],
            marks=[]
            if {c[1], c[2], c[3]} <= {Q, KV, Q_GQA, KV_EV}
            else [pytest.mark.slow_on(*SHAPE_COMPILING_LIBRARIES)],
        )
        for c in CASES
    ]


def _draw(case_id: str, q_shape, k_shape, v_shape, mask_shape, bias_shape, options):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, v_shape))
    mask = None if mask_shape is None else rng.random(mask_shape) > 0.3
    bias = None if bias_shape is None else rng.standard_normal(bias_shape)
    out = reference.scaled_dot_product_attention(q, k, v, mask=mask, bias=bias, **options)
    d_out = rng.standard_normal(out.shape)
    return q, k, v, d_out, mask, bias


CASE_FIELDS = ("case_id", "q_shape", "k_shape", "v_shape", "options", "mask_shape", "bias_shape")


@pytest.mark.parametrize(CASE_FIELDS, _tiled_cases())
def test_blocked_vjp_with_the_batch_split_matches_oracle(
    backend, monkeypatch, case_id, q_shape, k_shape, v_shape, options, mask_shape, bias_shape
):
    """A tile budget of a few bytes makes the blocked path loop over every batch entry (as
    it does for large calls), summing dK, dV and dBias over the entries that share them."""
    monkeypatch.setattr(vjp_blocked, "tile_bytes", lambda p: 64)
    splits = []
    original = vjp_blocked.batch_slices

    def spy(batch, per_item, **options):
        split, indices = original(batch, per_item, **options)
        splits.append(split)
        return split, indices

    monkeypatch.setattr(vjp_blocked, "batch_slices", spy)
    q, k, v, d_out, mask, bias = _draw(
        case_id, q_shape, k_shape, v_shape, mask_shape, bias_shape, options
    )
    for blocks in ({}, {"block_q": 3, "block_k": 4}):
        check_vjp_against_oracle(
            backend,
            "float32",
            q,
            k,
            v,
            d_out,
            mask=mask,
            bias=bias,
            implementation="blocked",
            **blocks,
            **options,
        )
    assert len(splits) == 2
    assert all(split > 0 for split in splits), f"the batch was not split: {splits}"


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS)
def test_large_logits_do_not_overflow(backend_dtype, implementation, blocks):
    # Scores in the thousands: exp overflows unless P comes from max-subtracted scores or
    # from the log-sum-exp, and float16 inputs only work if everything runs in float32.
    backend, dtype = backend_dtype
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 6, 16)) * 40.0
    k = rng.standard_normal((2, 9, 16)) * 40.0
    v = rng.standard_normal((2, 9, 4))
    d_out = rng.standard_normal((2, 6, 4))
    grads = check_vjp_against_oracle(
        backend, dtype, q, k, v, d_out, scale=1.0, implementation=implementation, **blocks
    )
    assert all(np.isfinite(reference.to_numpy(g)).all() for g in grads)


# --------------------------------------------------------------------------------------
# rows with no admissible key, keys nobody attends
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS)
def test_fully_masked_rows_have_exactly_zero_gradients(backend_dtype, implementation, blocks):
    backend, dtype = backend_dtype
    rng = np.random.default_rng(5)
    q, k, v = (
        rng.standard_normal((2, 5, 4)),
        rng.standard_normal((2, 6, 4)),
        rng.standard_normal((2, 6, 3)),
    )
    d_out = rng.standard_normal((2, 5, 3))
    mask = rng.random((2, 5, 6)) > 0.4
    mask[:, :, 0] = True
    mask[0, 1] = False  # head 0, query 1: excluded by the mask
    mask[:, :, 5] = False  # key 5: nobody may attend it
    bias = rng.standard_normal((2, 5, 6))
    bias[1, 3] = -np.inf  # head 1, query 3: excluded by the bias
    dq, dk, dv, dbias = check_vjp_against_oracle(
        backend,
        dtype,
        q,
        k,
        v,
        d_out,
        mask=mask,
        bias=bias,
        softcap=2.0,
        implementation=implementation,
        **blocks,
    )
    dq, dk, dv, dbias = (reference.to_numpy(g) for g in (dq, dk, dv, dbias))
    for head, row in ((0, 1), (1, 3)):
        assert np.all(dq[head, row] == 0)
        assert np.all(dbias[head, row] == 0)
    assert np.all(dk[:, 5] == 0)
    assert np.all(dv[:, 5] == 0)
    assert np.all(dbias[:, :, 5] == 0)


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS)
def test_rows_before_the_diagonal_have_exactly_zero_gradients(
    backend_dtype, implementation, blocks
):
    # bottom_right with L > S: the first L - S queries have their diagonal before key 0;
    # the window (0, 0) then lets each other query see exactly one key.
    backend, dtype = backend_dtype
    rng = np.random.default_rng(6)
    q, k, v = (
        rng.standard_normal((1, 7, 4)),
        rng.standard_normal((1, 3, 4)),
        rng.standard_normal((1, 3, 2)),
    )
    d_out = rng.standard_normal((1, 7, 2))
    for options in ({"is_causal": True}, {"window": (0, 0)}):
        dq, _, _ = check_vjp_against_oracle(
            backend,
            dtype,
            q,
            k,
            v,
            d_out,
            alignment="bottom_right",
            implementation=implementation,
            **blocks,
            **options,
        )
        assert np.all(reference.to_numpy(dq)[0, :4] == 0)


@pytest.mark.parametrize(("L", "S"), [(0, 5), (4, 0), (0, 0)])
def test_empty_lengths_give_zero_gradients(backend, L, S):
    rng = np.random.default_rng(7)
    xq, xk, xv, xg, xb = (
        backend.asarray(rng.standard_normal(s), "float32")
        for s in ((2, L, 4), (2, S, 4), (2, S, 3), (2, L, 3), (2, L, S))
    )
    grads = sdpa_array.scaled_dot_product_attention_vjp(xq, xk, xv, xg, bias=xb)
    for g, x in zip(grads, (xq, xk, xv, xb), strict=True):
        assert_array_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert np.all(reference.to_numpy(g) == 0)


# --------------------------------------------------------------------------------------
# central finite differences of the library's own forward pass, float64
# --------------------------------------------------------------------------------------

#: Step of the central differences. With O(1) inputs, the truncation error
#: ``h² |f'''| / 6`` is about 1e-11 and the rounding error ``u |f| / h`` about 1e-11 too.
FD_STEP = 1e-5

#: Allowed gap, relative to the largest gradient entry (at least 1): a hundred times the
#: two errors above, far below the first-order size of any mistake in a gradient.
FD_TOLERANCE = 1e-8

# (id, q, k, v shapes, options, mask shape, bias shape); rows keep an admissible key.
FD_CASES = [
    ("L!=S,Ev!=E", (2, 5, 3), (2, 3, 3), (2, 3, 1), {}, None, None),
    ("scale", (3, 2), (4, 2), (4, 3), {"scale": 1.7}, None, None),
    ("mask", (2, 3, 2), (2, 4, 2), (2, 4, 2), {}, (2, 3, 4), None),
    ("bias-broadcast", (2, 2, 3, 2), (2, 2, 4, 2), (2, 2, 4, 2), {}, None, (2, 1, 4)),
    ("causal-top-left", (2, 3, 2), (2, 5, 2), (2, 5, 2), {"is_causal": True}, None, None),
    (
        "causal-bottom-right",
        (2, 3, 2),
        (2, 5, 2),
        (2, 5, 2),
        {"is_causal": True, "alignment": "bottom_right"},
        None,
        None,
    ),
    ("window-top-left", (4, 2), (5, 2), (5, 2), {"window": (1, 1)}, None, None),
    (
        "window-bottom-right",
        (4, 2),
        (5, 2),
        (5, 2),
        {"window": (1, 0), "alignment": "bottom_right"},
        None,
        None,
    ),
    ("softcap+bias", (2, 3, 2), (2, 4, 2), (2, 4, 2), {"softcap": 1.2}, None, (3, 4)),
    ("gqa+bias", (4, 2, 2), (2, 3, 2), (2, 3, 3), {"enable_gqa": True}, None, (4, 1, 3)),
    ("broadcast-batch", (2, 1, 2, 2), (1, 2, 3, 2), (3, 2), {}, None, None),
    (
        "everything",
        (2, 4, 3, 2),
        (1, 2, 4, 2),
        (2, 2, 4, 3),
        {
            "is_causal": True,
            "window": (2, None),
            "alignment": "bottom_right",
            "softcap": 1.5,
            "scale": 0.9,
            "enable_gqa": True,
        },
        (1, 4, 3, 4),
        (4, 1, 4),
    ),
]


def _finite_differences(backend, arrays, d_out, mask, options):
    """Central differences of ``sum(out * d_out)`` for every entry of every array.

    One forward call (materialized): each of the ``2 n`` perturbations (``n`` entries in all
    the arrays, each moved up and down) is one entry of a new leading batch axis, along
    which every argument is stacked.
    """
    ndim = max(a.ndim for a in arrays[:3])  # that of the scores, too
    padded = [a.reshape((1,) * (ndim - a.ndim) + a.shape) for a in arrays]
    sizes = [a.size for a in padded]
    n = sum(sizes)
    stacks = [np.broadcast_to(a, (2 * n, *a.shape)).copy() for a in padded]
    entry = 0
    for which, a in enumerate(padded):
        for flat in range(a.size):
            idx = np.unravel_index(flat, a.shape)
            stacks[which][(entry, *idx)] += FD_STEP
            stacks[which][(n + entry, *idx)] -= FD_STEP
            entry += 1
    xmask = None
    if mask is not None:
        xmask = backend.asarray(mask.reshape((1,) * (ndim - mask.ndim) + mask.shape))
    xs = [backend.asarray(s, "float64") for s in stacks]
    out = sdpa_array.scaled_dot_product_attention(
        *xs[:3],
        mask=xmask,
        bias=xs[3] if len(xs) > 3 else None,
        implementation="materialized",
        **options,
    )
    loss = np.sum(reference.to_numpy(out) * d_out, axis=tuple(range(1, out.ndim)))
    diff = (loss[:n] - loss[n:]) / (2 * FD_STEP)
    bounds = np.cumsum([0, *sizes])
    return [diff[bounds[i] : bounds[i + 1]].reshape(a.shape) for i, a in enumerate(arrays)]


# Slow on JAX: each case stacks its own number of perturbations, a new shape to compile.
# There the oracle comparisons above check the same gradients; the differences check the
# oracle-independent maths, the same code on every backend.
@pytest.mark.slow_on(*SHAPE_COMPILING_LIBRARIES)
@pytest.mark.parametrize(
    ("case_id", "q_shape", "k_shape", "v_shape", "options", "mask_shape", "bias_shape"),
    [pytest.param(*c, id=c[0]) for c in FD_CASES],
)
def test_vjp_matches_finite_differences(
    backend, case_id, q_shape, k_shape, v_shape, options, mask_shape, bias_shape
):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, v_shape))
    mask = None
    if mask_shape is not None:
        mask = rng.random(mask_shape) < 0.7
        mask[..., 0] = True
    bias = None if bias_shape is None else rng.standard_normal(bias_shape)
    out = reference.scaled_dot_product_attention(q, k, v, mask=mask, bias=bias, **options)
    d_out = rng.standard_normal(out.shape)
    arrays = [q, k, v] + ([bias] if bias is not None else [])
    expected = _finite_differences(backend, arrays, d_out, mask, options)
    xs = [backend.asarray(a, "float64") for a in (q, k, v, d_out)]
    for implementation, blocks in VARIANTS:
        got = sdpa_array.scaled_dot_product_attention_vjp(
            *xs,
            mask=None if mask is None else backend.asarray(mask),
            bias=None if bias is None else backend.asarray(bias, "float64"),
            implementation=implementation,
            **blocks,
            **options,
        )
        assert len(got) == len(expected)
        for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, expected, strict=False):
            g = reference.to_numpy(g)
            assert g.shape == e.shape
            tolerance = FD_TOLERANCE * max(1.0, float(np.max(np.abs(e))))
            err = float(np.max(np.abs(g - e)))
            assert err <= tolerance, (
                f"{implementation} {blocks} {name}: {err:.2e} > {tolerance:.2e}"
            )


# --------------------------------------------------------------------------------------
# against torch's autograd of its own attention, float64
# --------------------------------------------------------------------------------------

# (id, q, k, v shapes, options, torch's attn_mask kind): features torch's function has.
TORCH_CASES = [
    ("plain", (2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 5), {}, None),
    ("Ev!=E", (2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 2), {}, None),
    ("scale", (2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 5), {"scale": 0.6}, None),
    ("mask", (2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 5), {}, "mask"),
    ("bias", (2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 5), {}, "bias"),
    ("causal-L<S", (2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 5), {"is_causal": True}, None),
    ("causal-L>S", (1, 2, 7, 5), (1, 2, 5, 5), (1, 2, 5, 3), {"is_causal": True}, None),
    ("gqa", (2, 6, 4, 5), (2, 2, 6, 5), (2, 2, 6, 3), {"enable_gqa": True}, None),
]


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("case_id", "q_shape", "k_shape", "v_shape", "options", "term"),
    [pytest.param(*c, id=c[0]) for c in TORCH_CASES],
)
def test_vjp_matches_torch_autograd(
    torch_interop_backend, implementation, blocks, case_id, q_shape, k_shape, v_shape, options, term
):
    """Our VJP and torch's autograd (CPU) are each within the oracle bound of the exact
    gradients, so they are within twice that bound of each other. Run on the arrays torch
    shares memory with (NumPy, torch); every backend is compared with the oracle above."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    if options.get("enable_gqa") and "enable_gqa" not in F.scaled_dot_product_attention.__doc__:
        pytest.skip("this torch has no enable_gqa")
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, v_shape))
    mask = bias = attn_mask = None
    if term == "mask":
        mask = rng.random((*q_shape[:-1], k_shape[-2])) < 0.7
        mask[..., 0] = True  # torch's handling of rows without keys varies by version
        attn_mask = torch.from_numpy(mask)
    elif term == "bias":
        bias = rng.standard_normal((q_shape[-3], q_shape[-2], k_shape[-2]))
        attn_mask = torch.from_numpy(bias).requires_grad_(True)
    d_out = rng.standard_normal((*q_shape[:-1], v_shape[-1]))
    tq, tk, tv = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
    F.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask, **options).backward(
        torch.from_numpy(d_out)
    )
    expected = [tq.grad, tk.grad, tv.grad] + ([attn_mask.grad] if bias is not None else [])
    got = sdpa_array.scaled_dot_product_attention_vjp(
        *(torch_interop_backend.asarray(a, "float64") for a in (q, k, v, d_out)),
        mask=None if mask is None else torch_interop_backend.asarray(mask),
        bias=None if bias is None else torch_interop_backend.asarray(bias, "float64"),
        implementation=implementation,
        **blocks,
        **options,
    )
    _, bounds = vjp_oracle_and_bounds("float64", q, k, v, d_out, mask=mask, bias=bias, **options)
    assert len(got) == len(expected)
    for g, e, b in zip(got, expected, bounds, strict=True):
        err = np.abs(reference.to_numpy(g) - e.numpy())
        assert np.all(err <= 2 * b), f"max error {err.max():.2e}"


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------


def _arrays(xp_like, dtype="float32"):
    rng = np.random.default_rng(8)
    return [
        xp_like.asarray(rng.standard_normal(s), dtype) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 6))
    ]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"grad_shape": (2, 3, 5)}, ValueError, r"grad_output has shape \(2, 3, 5\)"),
        ({"grad_dtype": "float64"}, TypeError, "grad_output must have the output's dtype"),
        (
            {"grad_library": "list"},
            TypeError,
            "grad_output must be an array of the inputs' library",
        ),
        ({"implementation": "flash"}, ValueError, "implementation must be one of"),
        (
            {"implementation": "materialized", "block_q": 4},
            ValueError,
            "apply to the blocked implementation",
        ),
        ({"block_k": 0}, ValueError, "block_k must be a positive int"),
        ({"key_shape": (2, 5, 3)}, ValueError, "same feature size E"),
        ({"softcap": -1.0}, ValueError, "softcap must be a positive finite number"),
        ({"mask_dtype": "float32"}, TypeError, "mask must be boolean"),
    ],
)
def test_validation(backend, change, error, match):
    q, k, v = _arrays(backend)
    if "key_shape" in change:
        k = backend.asarray(np.ones(change["key_shape"]), "float32")
    g_shape = change.get("grad_shape", (2, 3, 6))
    g = backend.asarray(np.ones(g_shape), change.get("grad_dtype", "float32"))
    if change.get("grad_library") == "list":
        g = np.ones(g_shape, dtype=np.float32).tolist()
    kwargs = {
        key: change[key]
        for key in ("implementation", "block_q", "block_k", "softcap")
        if key in change
    }
    if "mask_dtype" in change:
        kwargs["mask"] = backend.asarray(np.ones((3, 5)), "float32")
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **kwargs)


def test_grad_output_of_another_library_is_a_type_error(non_numpy_backend):
    q, k, v = _arrays(non_numpy_backend)
    g = np.ones((2, 3, 6), dtype=np.float32)
    with pytest.raises(TypeError, match="grad_output must be an array of the inputs' library"):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g)


def test_validation_of_the_inputs_comes_before_the_cotangent(backend):
    # A forward-argument error is reported as the forward reports it, whatever grad_output.
    q, k, v = _arrays(backend)
    with pytest.raises(ValueError, match="same length S"):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v[..., :4, :], np.ones(1))


# --------------------------------------------------------------------------------------
# the blocked plan and the blocked path's memory
# --------------------------------------------------------------------------------------


def _problem(L: int, S: int, E: int = 8, **options):
    q, k = np.zeros((L, E), dtype=np.float32), np.zeros((S, E), dtype=np.float32)
    return validate(q, k, k, Options(**options))


def _plan(p, block_q=None, block_k=None):
    """The backward plan of ``p`` under its causal/window band (no mask)."""
    return plan_backward(p, Restrictions((p.band,), p.L, p.S), block_q, block_k)


def test_plan_holds_whole_rows_when_they_fit_and_skips_excluded_keys():
    plan = _plan(_problem(2048, 2048))
    assert plan.rows_fit_one_tile
    assert all(b.tiles == ((0, 2048),) for b in plan.blocks)
    causal = _plan(_problem(2048, 2048, is_causal=True))
    assert causal.rows_fit_one_tile
    assert causal.grid == GRID_RESTRICTED
    visited = sum((b.stop - b.start) * (t[1] - t[0]) for b in causal.blocks for t in b.tiles)
    # about half the square, plus at most one grid block per query block on the diagonal
    assert visited <= 2048 * 2048 / 2 + 2048 * (causal.block_q + GRID_RESTRICTED)
    band = _problem(2048, 2048, is_causal=True).band
    for b in causal.blocks:  # every admissible key of the block is inside its tile
        lo, hi = band.key_range(b.start, b.stop)
        assert b.tiles[0][0] <= lo
        assert b.tiles[-1][1] >= hi


def test_plan_splits_long_rows_and_empty_blocks():
    long = _plan(_problem(64, 10_000))
    assert not long.rows_fit_one_tile
    assert all(t[1] - t[0] <= long.width for b in long.blocks for t in b.tiles)
    dead = _plan(_problem(9, 3, is_causal=True, alignment="bottom_right"), 2, 2)
    assert [b.tiles for b in dead.blocks[:3]] == [(), (), ()]
    assert dead.blocks[3].tiles == ((0, 2),)


@pytest.mark.parametrize(
    ("L", "S", "options"),
    [
        pytest.param(16_384, 2048, {}, id="whole-rows-per-tile"),
        pytest.param(4096, 8192, {}, id="log-sum-exp-tiles"),
        pytest.param(8192, 8192, {"is_causal": True, "enable_gqa": True}, id="causal-gqa"),
    ],
)
def test_blocked_vjp_memory_is_of_the_order_of_a_block(L, S, options):
    """Peak traced memory of the blocked VJP on NumPy float32 stays far below one score
    matrix (``L * S * 4`` bytes): at most the inputs, the gradients, and a few tiles of
    :data:`TILE_BYTES` per thread (of at most 4) in flight."""
    rng = np.random.default_rng(9)
    E = 8
    heads = (2, 1) if options.get("enable_gqa") else (1, 1)
    q = rng.standard_normal((heads[0], L, E), dtype=np.float32)
    k = rng.standard_normal((heads[1], S, E), dtype=np.float32)
    v = rng.standard_normal((heads[1], S, E), dtype=np.float32)
    g = rng.standard_normal((heads[0], L, E), dtype=np.float32)
    data = sum(x.nbytes for x in (q, k, v, g))
    tracemalloc.start()
    try:
        grads = sdpa_array.scaled_dot_product_attention_vjp(
            q, k, v, g, implementation="blocked", **options
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(np.isfinite(x).all() for x in grads)
    score_matrix = L * S * 4 * heads[0]
    assert peak < 4 * data + 24 * TILE_BYTES
    assert peak < score_matrix / 4, f"peak {peak / 2**20:.0f} MiB"


def test_gradients_keep_the_input_dtypes(float64_backend):
    # A float64 bias with float32 query/key/value: its gradient comes back in float64.
    rng = np.random.default_rng(10)
    (q, q64), (k, k64), (v, v64), (g, g64) = (
        rounded(float64_backend, rng.standard_normal(s), "float32")
        for s in ((3, 4), (5, 4), (5, 2), (3, 2))
    )
    bias, b64 = rounded(float64_backend, rng.standard_normal((3, 5)), "float64")
    xp = array_namespace({"q": q})
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, bias=bias)
    assert [x.dtype for x in grads] == [xp.float32] * 3 + [xp.float64]
    # float32 arithmetic: the float32 bound covers the float64 bias gradient too
    expected, bounds = vjp_oracle_and_bounds("float32", q64, k64, v64, g64, bias=b64)
    for name, x, e, b in zip(("dq", "dk", "dv", "dbias"), grads, expected, bounds, strict=True):
        assert_within(x, e, b, name)


def test_blocked_vjp_sums_leave_their_parts_unchanged():
    """The backward pass's partial sums: later parts add in place into a sum the first
    addition made, never into a part (a tile's result, or a view of one)."""
    from sdpa_array._kernels.vjp_blocked import _Acc, _add

    parts = [np.full((3, 2), float(i + 1)) for i in range(4)]
    kept = [x.copy() for x in parts]
    acc = _Acc()
    for x in parts:
        _add(acc, "k", x)
    np.testing.assert_array_equal(acc["k"], np.full((3, 2), 10.0))
    for x, y in zip(parts, kept, strict=True):
        np.testing.assert_array_equal(x, y)


def test_blocked_vjp_assembles_the_same_with_and_without_filling(monkeypatch):
    """dQ, dK and dV written block by block into new arrays (NumPy) equal the concatenated
    ones (libraries that cannot write), bit for bit, with a skipped tile's zeros."""
    from sdpa_array._kernels import vjp_blocked

    rng = np.random.default_rng(3)
    q, g = (rng.standard_normal((2, 3, 48, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, 80, 16)).astype(np.float32) for _ in range(2))
    vjp = sdpa_array.scaled_dot_product_attention_vjp
    opts = {"implementation": "blocked", "block_q": 16, "block_k": 16, "is_causal": True}
    filled = vjp(q, k, v, g, **opts)
    assert not filled[1][..., 48:, :].any()  # keys no query reaches: no tile, zeros
    monkeypatch.setattr(vjp_blocked._Assembly, "rows_into", lambda *a: None)
    concatenated = vjp(q, k, v, g, **opts)
    for a, b in zip(filled, concatenated, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(CASE_FIELDS, [c for c in _tiled_cases() if c.id != "gqa"])
def test_transposed_score_tiles_match_oracle(
    monkeypatch, case_id, q_shape, k_shape, v_shape, options, mask_shape, bias_shape
):
    """NumPy computes a wide tile's scores and ``dP`` as transposed products
    (``products.scores``; their rows strided): the gradients match the oracle with and
    without, and the transposed products were taken where the tiles are wider than tall
    (not across GQA groups)."""
    from sdpa_array._arrays import products
    from sdpa_array.testing import get_backend

    numpy_backend = get_backend("numpy")
    q, k, v, d_out, mask, bias = _draw(
        case_id, q_shape, k_shape, v_shape, mask_shape, bias_shape, options
    )
    taken = []
    original = products.transposes

    def spy(xp, a, b):
        taken.append(original(xp, a, b))
        return taken[-1]

    for transposes in (spy, lambda *a: False):
        monkeypatch.setattr(products, "transposes", transposes)
        for blocks in ({}, {"block_q": 3, "block_k": 4}):
            check_vjp_against_oracle(
                numpy_backend,
                "float32",
                q,
                k,
                v,
                d_out,
                mask=mask,
                bias=bias,
                implementation="blocked",
                **blocks,
                **options,
            )
    assert any(taken), case_id
