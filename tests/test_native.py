"""Delegation to native kernels: which calls delegate (and to which kernel), which refuse,
each delegation against the float64 oracle, and the ``"auto"`` rule.

Native kernels exist for torch and JAX; for the other backends every test here is skipped.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

import sdpa_array
from sdpa_array import _api, _native, reference
from sdpa_array._native import CannotDelegateError, Request, plan_native
from sdpa_array._problem import validate
from tests.helpers import (
    assert_array_like,
    assert_close,
    check_against_oracle,
    output_bound,
    rounded,
    score_error,
)

NATIVE_LIBRARIES = {"torch", "jax"}
TORCH_PUBLIC = "torch.nn.functional.scaled_dot_product_attention"
TORCH_CPU_FLASH = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
JAX = "jax.nn.dot_product_attention"


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


@pytest.fixture
def native_backend(backend_dtype):
    backend, dtype = backend_dtype
    if backend.library not in NATIVE_LIBRARIES:
        pytest.skip(f"no native kernel for {backend.library}")
    return backend, dtype


def make_request(backend, dtype, q, k, v, mask=None, bias=None, *, lse=False, weights=False):
    xq, xk, xv = (backend.asarray(a, dtype) for a in (q, k, v))
    xmask = None if mask is None else backend.asarray(mask)
    xbias = None if bias is None else backend.asarray(bias, dtype)
    return Request(xq, xk, xv, xmask, xbias, weights, lse)


def plan(backend, dtype, q_shape, k_shape, v_shape, mask_shape=None, bias_shape=None, **kw):
    """Plan a call with zero inputs of the given shapes; return the Delegation or the error."""
    lse, weights = kw.pop("lse", False), kw.pop("weights", False)
    z = np.zeros
    req = make_request(
        backend,
        dtype,
        z(q_shape),
        z(k_shape),
        z(v_shape),
        None if mask_shape is None else np.ones(mask_shape, dtype=bool),
        None if bias_shape is None else z(bias_shape),
        lse=lse,
        weights=weights,
    )
    options = {
        "is_causal": False,
        "window": None,
        "alignment": "top_left",
        "scale": None,
        "softcap": None,
        "enable_gqa": False,
        **kw,
    }
    p = validate(req.query, req.key, req.value, mask=req.mask, bias=req.bias, **options)
    try:
        return plan_native(p, req)
    except CannotDelegateError as exc:
        return exc


B4 = (2, 3, 6, 8)
BK4 = (2, 3, 9, 8)

# (id, shapes q/k/v, mask, bias, options, kernel for torch CPU, kernel for JAX); None = must
# refuse. Output only (no lse, no weights).
OUT_ONLY = [
    ("plain", B4, BK4, BK4, None, None, {}, TORCH_PUBLIC, JAX),
    ("mask", B4, BK4, BK4, (6, 9), None, {}, TORCH_PUBLIC, JAX),
    ("bias", B4, BK4, BK4, None, (3, 6, 9), {}, TORCH_PUBLIC, JAX),
    ("mask+bias", B4, BK4, BK4, (2, 1, 6, 9), (9,), {}, TORCH_PUBLIC, JAX),
    ("causal", B4, BK4, BK4, None, None, {"is_causal": True}, TORCH_PUBLIC, JAX),
    (
        "causal-bottom-right",
        B4,
        BK4,
        BK4,
        None,
        None,
        {"is_causal": True, "alignment": "bottom_right"},
        TORCH_PUBLIC,
        JAX,
    ),
    ("window", B4, BK4, BK4, None, None, {"window": (2, 1)}, TORCH_PUBLIC, JAX),
    ("gqa", (2, 6, 6, 8), BK4, BK4, None, None, {"enable_gqa": True}, TORCH_PUBLIC, JAX),
    ("Ev!=E", B4, BK4, (2, 3, 9, 5), None, None, {}, TORCH_PUBLIC, None),
    ("2-D", (6, 8), (9, 8), (9, 8), None, None, {}, TORCH_PUBLIC, JAX),
    ("5-D", (2, 2, 3, 6, 8), (2, 2, 3, 9, 8), (2, 2, 3, 9, 8), None, None, {}, TORCH_PUBLIC, JAX),
    ("broadcast-batch", B4, (1, 3, 9, 8), (1, 3, 9, 8), None, None, {}, TORCH_PUBLIC, None),
    ("softcap", B4, BK4, BK4, None, None, {"softcap": 5.0}, None, None),
]


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "mask_shape", "bias_shape", "options", "torch_k", "jax_k"),
    [c[1:] for c in OUT_ONLY],
    ids=[c[0] for c in OUT_ONLY],
)
def test_which_calls_delegate(
    native_backend, q_shape, k_shape, v_shape, mask_shape, bias_shape, options, torch_k, jax_k
):
    backend, dtype = native_backend
    if dtype == "float64" and backend.library == "jax":
        jax_k = None  # JAX's softmax runs in float32
    expected = torch_k if backend.library == "torch" else jax_k
    result = plan(backend, dtype, q_shape, k_shape, v_shape, mask_shape, bias_shape, **options)
    if expected is None:
        assert isinstance(result, CannotDelegateError), f"delegated to {result}"
        assert isinstance(result, ValueError)
    else:
        assert not isinstance(result, Exception), str(result)
        assert result.kernel == expected


def test_lse_and_weights_delegation(native_backend):
    backend, dtype = native_backend
    on_cpu = backend.device == "cpu"
    result = plan(backend, dtype, B4, BK4, BK4, lse=True)
    if backend.library == "torch":
        expected = TORCH_CPU_FLASH if on_cpu else None
    else:
        expected = None if dtype == "float64" else JAX
    for res in (result, plan(backend, dtype, B4, BK4, BK4, weights=True)):
        if expected is None:
            assert isinstance(res, CannotDelegateError)
        else:
            assert res.kernel == expected
    # The kernels that return the log-sum-exp need Ev == E.
    mismatched = plan(backend, dtype, B4, BK4, (2, 3, 9, 5), lse=True)
    assert isinstance(mismatched, CannotDelegateError)
    if expected is not None:
        assert "Ev == E" in str(mismatched)


def test_positional_masks_are_built_only_when_needed(native_backend):
    backend, dtype = native_backend
    if backend.library == "jax" and dtype == "float64":
        pytest.skip("JAX does not delegate float64")
    assert not plan(backend, dtype, B4, BK4, BK4, is_causal=True).builds_mask
    square = (2, 3, 9, 8)
    bottom_right = plan(
        backend, dtype, square, square, square, is_causal=True, alignment="bottom_right"
    )
    assert not bottom_right.builds_mask  # L == S: both alignments are the same diagonal
    assert plan(backend, dtype, B4, BK4, BK4, is_causal=True, alignment="bottom_right").builds_mask
    assert plan(backend, dtype, B4, BK4, BK4, window=(3, 0)).builds_mask


@pytest.mark.parametrize(
    ("library", "message"),
    [("numpy", "no kernel for numpy"), ("strict", "no kernel for array_api_strict")],
)
def test_libraries_without_kernels_refuse(library, message):
    from sdpa_array.backends import get_backend

    backend = get_backend(library)
    if not backend.is_available():
        pytest.skip(f"{library} is not installed")
    q = backend.asarray(np.zeros((2, 4, 3)), "float32")
    with pytest.raises(CannotDelegateError, match=message):
        sdpa_array.scaled_dot_product_attention(q, q, q, implementation="native")


def test_refusal_names_every_kernel_and_reason(native_backend):
    backend, dtype = native_backend
    q = backend.asarray(np.zeros((2, 4, 3)), dtype)
    with pytest.raises(CannotDelegateError) as info:
        sdpa_array.scaled_dot_product_attention(q, q, q, softcap=2.0, implementation="native")
    kernels = [row.kernel for row in _native.NATIVE_KERNELS if row.library == backend.library]
    for kernel in kernels:
        assert kernel in str(info.value)
    assert "softcap" in str(info.value)


def test_block_sizes_do_not_apply_to_native(backend):
    q = backend.asarray(np.zeros((2, 4, 3)), "float32")
    with pytest.raises(ValueError, match="apply to the blocked implementation"):
        sdpa_array.scaled_dot_product_attention(q, q, q, implementation="native", block_k=2)


# ----------------------------------------------------------------------------------------
# every delegation against the oracle
# ----------------------------------------------------------------------------------------


def check_output_only(backend, dtype, q, k, v, *, mask=None, bias=None, **options) -> Any:
    """Like ``check_against_oracle`` for the output alone (kernels without lse)."""
    xq, q64 = rounded(backend, q, dtype)
    xk, k64 = rounded(backend, k, dtype)
    xv, v64 = rounded(backend, v, dtype)
    xmask = None if mask is None else backend.asarray(mask)
    xbias, bias64 = (None, None) if bias is None else rounded(backend, bias, dtype)
    out = sdpa_array.scaled_dot_product_attention(
        xq, xk, xv, mask=xmask, bias=xbias, implementation="native", **options
    )
    ref = reference.scaled_dot_product_attention(q64, k64, v64, mask=mask, bias=bias64, **options)
    assert_array_like(out, xq, shape=ref.shape, dtype=xq.dtype)
    scale = options.get("scale") or 1.0 / np.sqrt(q.shape[-1])
    ds = score_error(dtype, q64, k64, scale, bias64, options.get("softcap"))
    bound = output_bound(
        dtype,
        S=k.shape[-2],
        ds=ds,
        v_max=float(np.max(np.abs(v64))),
        out_max=float(np.max(np.abs(ref))),
    )
    assert_close(out, ref, bound)
    return out


def spy_kernels(monkeypatch) -> list[str]:
    """Record each native kernel that runs (the table's rows wrapped at their call)."""
    called: list[str] = []
    rows = []
    for row in _native.NATIVE_KERNELS:

        def plan_and_record(p, req, plan=row.plan, kernel=row.kernel):
            delegation = plan(p, req)

            def run(run=delegation.run):
                called.append(kernel)
                return run()

            return _native.Delegation(
                delegation.kernel, delegation.memory_efficient, delegation.builds_mask, run
            )

        rows.append(_native.NativeKernel(row.kernel, row.library, plan_and_record))
    monkeypatch.setattr(_native, "NATIVE_KERNELS", tuple(rows))
    return called


# (id, q, k, v shapes, options, mask shape, bias shape); lengths L != S in both directions.
ORACLE_CASES = [
    ("plain", (2, 3, 6, 8), (2, 3, 9, 8), {}, None, None),
    ("mask+bias", (2, 2, 6, 8), (2, 2, 9, 8), {}, (2, 1, 6, 9), (2, 6, 9)),
    ("causal-top-left-L<S", (1, 2, 5, 8), (1, 2, 9, 8), {"is_causal": True}, None, None),
    ("causal-top-left-L>S", (1, 2, 9, 8), (1, 2, 5, 8), {"is_causal": True}, None, None),
    (
        "causal-bottom-right-L<S",
        (1, 2, 5, 8),
        (1, 2, 9, 8),
        {"is_causal": True, "alignment": "bottom_right"},
        None,
        None,
    ),
    (
        "causal-bottom-right-L>S+mask",
        (1, 2, 9, 8),
        (1, 2, 5, 8),
        {"is_causal": True, "alignment": "bottom_right"},
        (9, 5),
        None,
    ),
    ("causal+bias", (1, 2, 7, 8), (1, 2, 7, 8), {"is_causal": True}, None, (1, 2, 7, 7)),
    ("window", (1, 2, 9, 8), (1, 2, 9, 8), {"window": (2, 1), "scale": 0.4}, None, (9, 9)),
    (
        "gqa+mask+causal",
        (2, 6, 6, 8),
        (2, 2, 8, 8),
        {"enable_gqa": True, "is_causal": True},
        (6, 6, 8),
        None,
    ),
    ("heads-broadcast", (2, 4, 6, 8), (2, 1, 8, 8), {}, None, None),
]


def oracle_inputs(case_id, q_shape, k_shape, mask_shape, bias_shape):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    mask = None if mask_shape is None else rng.random(mask_shape) > 0.3
    bias = None if bias_shape is None else randn(rng, *bias_shape)
    if mask is not None:
        mask[(0,) * (mask.ndim - 1)] = False  # one fully masked row
    if bias is not None:
        bias[(-1,) * (bias.ndim - 1)] = -np.inf  # one row excluded by the bias
    return rng, mask, bias


@pytest.mark.parametrize(
    ("case_id", "q_shape", "k_shape", "options", "mask_shape", "bias_shape"),
    ORACLE_CASES,
    ids=[c[0] for c in ORACLE_CASES],
)
def test_output_delegation_matches_oracle(
    native_backend, monkeypatch, case_id, q_shape, k_shape, options, mask_shape, bias_shape
):
    backend, dtype = native_backend
    if backend.library == "jax" and dtype == "float64":
        pytest.skip("JAX does not delegate float64 (its softmax runs in float32)")
    called = spy_kernels(monkeypatch)
    rng, mask, bias = oracle_inputs(case_id, q_shape, k_shape, mask_shape, bias_shape)
    check_output_only(
        backend,
        dtype,
        randn(rng, *q_shape),
        randn(rng, *k_shape),
        randn(rng, *k_shape),
        mask=mask,
        bias=bias,
        **options,
    )
    assert called == [TORCH_PUBLIC if backend.library == "torch" else JAX]


@pytest.mark.parametrize(
    ("case_id", "q_shape", "k_shape", "options", "mask_shape", "bias_shape"),
    ORACLE_CASES,
    ids=[c[0] for c in ORACLE_CASES],
)
def test_lse_and_weights_delegation_matches_oracle(
    native_backend, monkeypatch, case_id, q_shape, k_shape, options, mask_shape, bias_shape
):
    backend, dtype = native_backend
    if backend.library == "jax" and dtype == "float64":
        pytest.skip("JAX does not delegate float64 (its softmax runs in float32)")
    if backend.library == "torch" and backend.device != "cpu":
        pytest.skip("torch's kernel returning the log-sum-exp is CPU-only")
    called = spy_kernels(monkeypatch)
    rng, mask, bias = oracle_inputs(case_id, q_shape, k_shape, mask_shape, bias_shape)
    _, _, lse = check_against_oracle(
        backend,
        dtype,
        randn(rng, *q_shape),
        randn(rng, *k_shape),
        randn(rng, *k_shape),
        mask=mask,
        bias=bias,
        implementation="native",
        **options,
    )
    assert called == [TORCH_CPU_FLASH if backend.library == "torch" else JAX]
    if mask is not None or bias is not None:
        assert np.isneginf(reference.to_numpy(lse)).any(), "the case has an empty row"


# ----------------------------------------------------------------------------------------
# the "auto" rule
# ----------------------------------------------------------------------------------------


def chosen(backend, q, k, v, *, return_weights=False, return_lse=False, blocks=(None, None), **kw):
    options = {
        "is_causal": False,
        "window": None,
        "alignment": "top_left",
        "scale": None,
        "softcap": None,
        "enable_gqa": False,
        **kw,
    }
    p = validate(q, k, v, mask=None, bias=None, **options)
    req = Request(q, k, v, None, None, return_weights, return_lse)
    impl = _api._choose(p, "auto", req, blocks)
    return getattr(impl, "func", impl).__name__


def lazy_zeros(backend, shape, dtype="float32"):
    """Zeros of ``shape`` without allocating them where the library allows (broadcast)."""
    one = backend.asarray(np.zeros((1,) * len(shape)), dtype)
    xp = backend.namespace()
    return xp.broadcast_to(one, shape)


def test_auto_rule(backend):
    small = lazy_zeros(backend, (1, 2, 64, 8))
    large = lazy_zeros(backend, (1, 2, 2048, 8))  # 32 MiB of float32 scores
    native = backend.library in NATIVE_LIBRARIES
    assert chosen(backend, small, small, small) == (
        "native_attention" if native else "materialized_attention"
    )
    assert chosen(backend, small, small, small, return_weights=True) == "materialized_attention"
    assert chosen(backend, small, small, small, softcap=2.0) == "materialized_attention"
    assert chosen(backend, small, small, small, blocks=(16, None)) == "blocked_attention"
    assert chosen(backend, large, large, large, softcap=2.0) == "blocked_attention"
    # a large call goes native only to a memory-efficient kernel that needs no built mask
    torch_cpu = backend.library == "torch"
    assert chosen(backend, large, large, large) == (
        "native_attention" if torch_cpu else "blocked_attention"
    )
    assert chosen(backend, large, large, large, window=(64, 0)) == "blocked_attention"
    assert chosen(backend, large, large, large, is_causal=True) == (
        "native_attention" if torch_cpu else "blocked_attention"
    )
