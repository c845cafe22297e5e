"""Delegation to native kernels: which calls delegate (and to which kernel), which refuse,
each delegation against the float64 oracle, and the ``"auto"`` rule.

Native kernels exist for the libraries of
:data:`sdpa_array._kernels.native.NATIVE_KERNELS` (torch and JAX): the tests of delegation
run on those backends (``native_backend``), the refusal of the others on the rest
(``non_native_backend``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import zlib
from typing import Any

import numpy as np
import pytest

import sdpa_array
from sdpa_array import CannotDelegateError, reference
from sdpa_array._kernels import native
from sdpa_array._kernels.native import Request, plan_native
from sdpa_array._plan import dispatch as _dispatch
from sdpa_array._problem.options import Options
from sdpa_array._problem.outputs import Outputs
from sdpa_array._problem.problem import Inputs, validate
from sdpa_array.testing.backends import BACKENDS
from tests.helpers import (
    KV,
    Q_GQA,
    Q,
    assert_array_like,
    assert_close,
    check_against_oracle,
    check_vjp_against_oracle,
    output_bound,
    rounded,
    score_error,
    spy_native_kernels,
)
from tests.libraries import NATIVE_LIBRARIES, NATIVE_LSE_REFUSED_DTYPES, NATIVE_REFUSED_DTYPES

TORCH_PUBLIC = "torch.nn.functional.scaled_dot_product_attention"
TORCH_CPU_FLASH = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
TORCH_CUDNN = "torch.ops.aten._scaled_dot_product_cudnn_attention"
TORCH_EFFICIENT = "torch.ops.aten._scaled_dot_product_efficient_attention"
JAX = "jax.nn.dot_product_attention"
CUDNN_KERNEL = "jax.nn.dot_product_attention[cudnn]"


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def make_request(backend, dtype, q, k, v, mask=None, bias=None, *, lse=False, weights=False):
    xq, xk, xv = (backend.asarray(a, dtype) for a in (q, k, v))
    xmask = None if mask is None else backend.asarray(mask)
    xbias = None if bias is None else backend.asarray(bias, dtype)
    return Request(Inputs(xq, xk, xv, xmask, xbias), Outputs(weights, lse))


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
    x = req.inputs
    p = validate(x.query, x.key, x.value, Options(mask=x.mask, bias=x.bias, **options))
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
    native_backend_dtype,
    q_shape,
    k_shape,
    v_shape,
    mask_shape,
    bias_shape,
    options,
    torch_k,
    jax_k,
):
    backend, dtype = native_backend_dtype
    expected = torch_k if backend.library == "torch" else jax_k
    result = plan(backend, dtype, q_shape, k_shape, v_shape, mask_shape, bias_shape, **options)
    half = dtype in ("float16", "bfloat16")
    plain = mask_shape is None and bias_shape is None
    if expected == JAX and backend.device == "cuda" and half and plain:  # cuDNN's route
        expected = JAX if result.builds_mask else CUDNN_KERNEL
    if expected is None:
        assert isinstance(result, CannotDelegateError), f"delegated to {result}"
        assert isinstance(result, ValueError)
    else:
        assert not isinstance(result, Exception), str(result)
        assert result.kernel == expected


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "mask_shape", "bias_shape", "options", "torch_k", "jax_k"),
    [c[1:] for c in OUT_ONLY],
    ids=[c[0] for c in OUT_ONLY],
)
def test_refused_dtypes(
    native_refused_backend_dtype,
    q_shape,
    k_shape,
    v_shape,
    mask_shape,
    bias_shape,
    options,
    torch_k,
    jax_k,
):
    """In the dtypes of ``NATIVE_REFUSED_DTYPES`` nothing delegates (output, log-sum-exp or
    weights), and a call the library's kernels take in other dtypes names the dtype's reason."""
    backend, dtype = native_refused_backend_dtype
    reason = NATIVE_REFUSED_DTYPES[backend.library][dtype]
    shapes = (q_shape, k_shape, v_shape, mask_shape, bias_shape)
    for flags in ({}, {"lse": True}, {"weights": True}):
        result = plan(backend, dtype, *shapes, **flags, **options)
        assert isinstance(result, CannotDelegateError), f"delegated to {result}"
    elsewhere = torch_k if backend.library == "torch" else jax_k
    if elsewhere is not None:
        assert reason in str(plan(backend, dtype, *shapes, **options))


def test_the_stated_rules_are_about_native_libraries():
    """The rules that narrow the native fixtures (``tests/conftest.py``) name libraries of
    the delegation table and dtypes of their backends."""
    assert set(NATIVE_REFUSED_DTYPES) <= NATIVE_LIBRARIES
    assert {library for library, _ in NATIVE_LSE_REFUSED_DTYPES} <= NATIVE_LIBRARIES
    for library, refused in NATIVE_REFUSED_DTYPES.items():
        dtypes = {d for b in BACKENDS if b.library == library for d in b.dtypes}
        assert set(refused) <= dtypes
        assert dtypes - set(refused), f"{library}: native would never delegate"


def lse_kernel(backend, dtype: str, *, terms: bool = False) -> str | None:
    """The kernel that must return the log-sum-exp (``None``: every kernel refuses)."""
    if backend.library == "jax":
        return JAX
    if backend.device == "cpu":
        return TORCH_CPU_FLASH
    if dtype in NATIVE_LSE_REFUSED_DTYPES[("torch", "cuda")]:
        return None
    # cuDNN (half precision, no mask or bias) first, else the memory-efficient kernel
    return TORCH_CUDNN if dtype in ("float16", "bfloat16") and not terms else TORCH_EFFICIENT


def test_lse_and_weights_delegation(native_backend_dtype):
    backend, dtype = native_backend_dtype
    result = plan(backend, dtype, B4, BK4, BK4, lse=True)
    expected = lse_kernel(backend, dtype)
    for res in (result, plan(backend, dtype, B4, BK4, BK4, weights=True)):
        if expected is None:
            assert isinstance(res, CannotDelegateError)
            reason = NATIVE_LSE_REFUSED_DTYPES[(backend.library, backend.device)][dtype]
            assert reason in str(res)
        else:
            assert res.kernel == expected
    if backend.device == "cuda" and expected is not None:  # a bias: the efficient kernel
        with_bias = plan(backend, dtype, B4, BK4, BK4, bias_shape=(6, 9), lse=True)
        assert with_bias.kernel == lse_kernel(backend, dtype, terms=True)
    # The kernels that return the log-sum-exp need Ev == E.
    mismatched = plan(backend, dtype, B4, BK4, (2, 3, 9, 5), lse=True)
    assert isinstance(mismatched, CannotDelegateError)
    if expected is not None:
        assert "Ev == E" in str(mismatched)


def test_positional_masks_are_built_only_when_needed(native_backend_dtype):
    backend, dtype = native_backend_dtype
    assert not plan(backend, dtype, B4, BK4, BK4, is_causal=True).builds_mask
    square = (2, 3, 9, 8)
    bottom_right = plan(
        backend, dtype, square, square, square, is_causal=True, alignment="bottom_right"
    )
    assert not bottom_right.builds_mask  # L == S: both alignments are the same diagonal
    assert plan(backend, dtype, B4, BK4, BK4, is_causal=True, alignment="bottom_right").builds_mask
    assert plan(backend, dtype, B4, BK4, BK4, window=(3, 0)).builds_mask


@pytest.mark.parametrize("term", ["mask", "bias"])
def test_masks_and_biases_of_fewer_than_two_axes(native_backend, term):
    """A mask or bias that broadcasts from one axis or none (torch's public kernel indexes
    its attention mask's axis -2); without axes, the output alone (the kernels that
    return the log-sum-exp do not take such terms yet)."""
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, *Q), randn(rng, *KV), randn(rng, *KV)
    keys = rng.random(KV[-2]) < 0.7
    keys[0] = True
    one_axis = {"mask": keys} if term == "mask" else {"bias": randn(rng, KV[-2])}
    check_against_oracle(
        native_backend,
        "float32",
        q,
        k,
        v,
        implementation="native",
        return_weights=False,
        **one_axis,
    )
    if native_backend.library == "jax":
        pytest.xfail("JAX's delegation takes no mask or bias without axes yet")
    no_axis = {"mask": np.array(True)} if term == "mask" else {"bias": np.array(0.5)}
    check_output_only(native_backend, "float32", q, k, v, **no_axis)


def test_libraries_without_kernels_refuse(non_native_backend):
    q = non_native_backend.asarray(np.zeros((2, 4, 3)), "float32")
    with pytest.raises(CannotDelegateError, match=f"no kernel for {non_native_backend.library}"):
        sdpa_array.scaled_dot_product_attention(q, q, q, implementation="native")
    with pytest.raises(CannotDelegateError) as info:
        sdpa_array.scaled_dot_product_attention(q, q, q, return_lse=True, implementation="native")
    for library in NATIVE_LIBRARIES:  # and says where native kernels exist
        assert library in str(info.value)


@pytest.mark.parametrize("return_lse", [False, True])
def test_refusal_names_every_kernel_and_reason(native_backend, return_lse):
    kernels = [row.kernel for row in native.NATIVE_KERNELS if row.library == native_backend.library]
    for dtype in native_backend.dtypes:  # refused dtypes too: the softcap reason comes first
        q = native_backend.asarray(np.zeros((2, 4, 3)), dtype)
        with pytest.raises(CannotDelegateError) as info:
            sdpa_array.scaled_dot_product_attention(
                q, q, q, softcap=2.0, return_lse=return_lse, implementation="native"
            )
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


# (id, q, k (and v) shapes, options, mask shape, bias shape); lengths L != S in both
# directions. The shapes of tests/helpers.py, which the other files' cases share (JAX
# compiles each new shape).
ORACLE_CASES = [
    ("plain", Q, KV, {}, None, None),
    ("mask+bias", Q, KV, {}, (2, 1, 6, 7), (2, 6, 7)),
    ("causal-top-left-L<S", Q, KV, {"is_causal": True}, None, None),
    ("causal-top-left-L>S", KV, Q, {"is_causal": True}, None, None),
    (
        "causal-bottom-right-L<S",
        Q,
        KV,
        {"is_causal": True, "alignment": "bottom_right"},
        None,
        None,
    ),
    (
        "causal-bottom-right-L>S+mask",
        KV,
        Q,
        {"is_causal": True, "alignment": "bottom_right"},
        (7, 6),
        None,
    ),
    ("causal+bias", KV, KV, {"is_causal": True}, None, (1, 2, 7, 7)),
    ("window", KV, KV, {"window": (2, 1), "scale": 0.4}, None, (7, 7)),
    (
        "gqa+mask+causal",
        Q_GQA,
        KV,
        {"enable_gqa": True, "is_causal": True},
        (4, 6, 7),
        None,
    ),
    ("heads-broadcast", Q_GQA, (2, 1, 7, 4), {}, None, None),
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
    native_backend_dtype, monkeypatch, case_id, q_shape, k_shape, options, mask_shape, bias_shape
):
    backend, dtype = native_backend_dtype
    called = spy_native_kernels(monkeypatch)
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
    native_lse_backend_dtype,
    monkeypatch,
    case_id,
    q_shape,
    k_shape,
    options,
    mask_shape,
    bias_shape,
):
    backend, dtype = native_lse_backend_dtype
    called = spy_native_kernels(monkeypatch)
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
    terms = mask is not None or bias is not None
    positional = options.get("is_causal") and (
        options.get("alignment") == "bottom_right" and q_shape[-2] != k_shape[-2]
    )
    restricted = terms or positional or "window" in options
    assert called == [lse_kernel(backend, dtype, terms=restricted)]
    if mask is not None or bias is not None:
        assert np.isneginf(reference.to_numpy(lse)).any(), "the case has an empty row"


@pytest.mark.parametrize(
    ("case_id", "q_shape", "k_shape", "options", "mask_shape", "bias_shape"),
    ORACLE_CASES,
    ids=[c[0] for c in ORACLE_CASES],
)
def test_native_vjp_matches_oracle(
    native_backend_dtype, monkeypatch, case_id, q_shape, k_shape, options, mask_shape, bias_shape
):
    """``implementation="native"`` in the VJP differentiates the delegated call (torch
    autograd, ``jax.vjp``): every gradient, the bias's too, against the oracle."""
    backend, dtype = native_backend_dtype
    called = spy_native_kernels(monkeypatch)
    rng, mask, bias = oracle_inputs(case_id, q_shape, k_shape, mask_shape, bias_shape)
    out_shape = (*q_shape[:-1], k_shape[-1])
    check_vjp_against_oracle(
        backend,
        dtype,
        randn(rng, *q_shape),
        randn(rng, *k_shape),
        randn(rng, *k_shape),
        randn(rng, *out_shape),
        mask=mask,
        bias=bias,
        implementation="native",
        **options,
    )
    assert called == [TORCH_PUBLIC if backend.library == "torch" else JAX]


def test_native_vjp_refusals(backend):
    """The VJP's native implementation exists where a library differentiates its kernels,
    and refuses what those kernels do not compute, naming the reason."""
    q = backend.asarray(np.zeros((2, 4, 3)), "float32")
    g = backend.asarray(np.zeros((2, 4, 3)), "float32")
    vjp = sdpa_array.scaled_dot_product_attention_vjp
    if backend.library not in NATIVE_LIBRARIES:
        with pytest.raises(CannotDelegateError, match=f"no backward for {backend.library}"):
            vjp(q, q, q, g, implementation="native")
        return
    with pytest.raises(CannotDelegateError, match="softcap"):
        vjp(q, q, q, g, softcap=2.0, implementation="native")


def test_vjp_auto_takes_the_native_backward_on_cuda_only(eager_backend):
    """``"auto"`` differentiates the native kernel on a CUDA device (torch's fused backward
    kernels), and keeps the library's own backward kernels elsewhere."""
    backend = eager_backend
    q = lazy_zeros(backend, (1, 2, 64, 8))
    p = validate(q, q, q, Options())
    choice = _dispatch.choose(p, "auto", vjp_inputs=Inputs(q, q, q))
    expected = "materialized"
    if backend.device == "cuda":  # torch's backward kernels, else our Triton kernels
        triton = importlib.util.find_spec("triton") is not None
        takes_triton = triton and backend.library in ("torch", "cupy")  # not JAX's arrays
        expected = "native" if backend.library == "torch" else expected
        expected = "triton" if expected != "native" and takes_triton else expected
    assert choice.name == expected


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
    p = validate(q, k, v, Options(**options))
    req = Request(Inputs(q, k, v), Outputs(return_weights, return_lse))
    choice = _dispatch.choose(p, "auto", blocks, request=req)
    assert choice.automatic
    return choice.name


def lazy_zeros(backend, shape, dtype="float32"):
    """Zeros of ``shape`` without allocating them where the library allows (broadcast)."""
    one = backend.asarray(np.zeros((1,) * len(shape)), dtype)
    xp = backend.namespace()
    return xp.broadcast_to(one, shape)


def test_auto_rule(host_backend):
    """Off a GPU (Dask: tests/test_dask_graph.py, where auto builds its graph; on a GPU:
    tests/test_dispatch_gpu.py)."""
    backend = host_backend
    small = lazy_zeros(backend, (1, 2, 64, 8))
    # 512 MiB of float32 scores: above every library's threshold (AUTO_MAX_SCORE_BYTES)
    large = lazy_zeros(backend, (1, 2, 8192, 8))
    native = backend.library in NATIVE_LIBRARIES
    assert chosen(backend, small, small, small) == ("native" if native else "materialized")
    assert chosen(backend, small, small, small, return_weights=True) == "materialized"
    assert chosen(backend, small, small, small, softcap=2.0) == "materialized"
    assert chosen(backend, small, small, small, blocks=(16, None)) == "blocked"
    assert chosen(backend, large, large, large, softcap=2.0) == "blocked"
    # a large call goes native only to a memory-efficient kernel that needs no built mask
    torch = backend.library == "torch"
    assert chosen(backend, large, large, large) == ("native" if torch else "blocked")
    assert chosen(backend, large, large, large, window=(64, 0)) == "blocked"
    assert chosen(backend, large, large, large, is_causal=True) == (
        "native" if torch else "blocked"
    )


@pytest.mark.parametrize("implementation", ["native", "auto"])
def test_a_call_plans_its_native_kernel_once(native_backend, monkeypatch, implementation):
    """The dispatcher's plan is the one that runs: the delegation table is asked once."""
    plans = []
    rows = []
    for row in native.NATIVE_KERNELS:

        def counted(p, req, plan=row.plan, kernel=row.kernel):
            plans.append(kernel)
            return plan(p, req)

        rows.append(dataclasses.replace(row, plan=counted))
    monkeypatch.setattr(native, "NATIVE_KERNELS", tuple(rows))
    q = native_backend.asarray(np.zeros((2, 4, 3)), "float32")
    sdpa_array.scaled_dot_product_attention(q, q, q, implementation=implementation)
    assert plans == [TORCH_PUBLIC if native_backend.library == "torch" else JAX]


def test_jax_asks_for_cudnn_on_a_gpu_where_it_applies():
    """The rule of JAX's cuDNN route (:func:`~sdpa_array._kernels.native.jax_kernel.
    cudnn_reason`), on problems as a GPU call would have them: float16 and bfloat16 without
    terms or the log-sum-exp, head dims that are multiples of 8 up to 128."""
    from dataclasses import replace

    from sdpa_array._kernels.native.jax_kernel import CUDNN_MAX_HEAD_DIM, cudnn_reason

    def problem(dtype: str, E: int = 64, on_gpu: bool = True):
        q = np.zeros((1, 2, 4, E), dtype=dtype)
        return replace(validate(q, q, q, Options()), on_gpu=on_gpu)

    assert cudnn_reason(problem("float16"), False, False) is None
    assert cudnn_reason(problem("float16", CUDNN_MAX_HEAD_DIM), False, False) is None
    assert "not on a GPU" in cudnn_reason(problem("float16", on_gpu=False), False, False)
    assert "float16 or bfloat16" in cudnn_reason(problem("float32"), False, False)
    assert "mask or bias" in cudnn_reason(problem("float16"), True, False)
    assert "log-sum-exp" in cudnn_reason(problem("float16"), False, True)
    assert "multiples of 8" in cudnn_reason(problem("float16", 12), False, False)
    assert "multiples of 8" in cudnn_reason(
        problem("float16", 2 * CUDNN_MAX_HEAD_DIM), False, False
    )


def test_jax_arrays_count_as_on_a_gpu_by_their_platform(monkeypatch):
    """A JAX array is on a GPU when its device's platform is ``gpu`` (so the cuDNN route
    and the GPU rules apply to it); a tracer, which has no device, is taken to run on JAX's
    default backend."""
    jax = pytest.importorskip("jax")
    from sdpa_array._arrays.compat import on_gpu

    x = jax.numpy.ones(3)
    real = jax.default_backend()
    assert on_gpu(x) == (x.device.platform == "gpu")
    seen = []
    jax.jit(lambda a: seen.append(on_gpu(a)) or a)(x)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jax.jit(lambda a: seen.append(on_gpu(a)) or a * 2)(x)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    jax.jit(lambda a: seen.append(on_gpu(a)) or a * 3)(x)
    assert seen == [real == "gpu", True, False]


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("implementation", ["native", "auto", "materialized", "blocked"])
def test_nan_query_row_under_autograd(torch_cpu_backend, implementation, return_lse):
    """Under torch autograd a NaN query row comes out NaN on every implementation (torch's
    kernels give it zeros at 5 keys), its log-sum-exp too, and so does its gradient."""
    import torch

    rng = np.random.default_rng(11)
    q, k, v = (
        torch.tensor(rng.standard_normal((1, 2, n, 8)), dtype=torch.float32) for n in (4, 5, 5)
    )
    q[0, 1, 2, 3] = float("nan")
    q.requires_grad_(True)
    result = sdpa_array.scaled_dot_product_attention(
        q, k, v, implementation=implementation, return_lse=return_lse
    )
    out = result[0] if return_lse else result
    (dq,) = torch.autograd.grad(out.nan_to_num(0.0).sum() + out[0, 1, 2].sum(), q)
    assert torch.isnan(out[0, 1, 2]).all()
    assert torch.isfinite(out[0, 0]).all()
    if return_lse:
        assert torch.isnan(result[1][0, 1, 2])
    assert torch.isnan(dq[0, 1, 2]).all()
