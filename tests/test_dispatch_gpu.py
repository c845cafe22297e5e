"""``"auto"`` on a GPU and :func:`sdpa_array.explain`, checked on the CPU.

The dispatcher decides from the validated :class:`~sdpa_array._problem.problem.Problem`; a problem
marked ``on_gpu`` (as arrays on a GPU would make it) shows the GPU rule on any machine.
Nothing runs: only plans are made.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sdpa_array
from sdpa_array._kernels.native import Request, plan_native
from sdpa_array._kernels.triton import CannotUseTritonError, plan_triton
from sdpa_array._plan import dispatch as _dispatch
from sdpa_array._problem.options import Options
from sdpa_array._problem.outputs import Outputs
from sdpa_array._problem.problem import Inputs, validate


def gpu_choice(backend, q_shape, k_shape, *, return_lse=False, **options):
    """``"auto"``'s choice (forward, VJP) for a call marked as on a GPU."""
    q = backend.asarray(np.zeros(q_shape), "float16")
    k = backend.asarray(np.zeros(k_shape), "float16")
    p = validate(q, k, k, Options(**options))
    p = dataclasses.replace(p, on_gpu=True)
    x = Inputs(q, k, k, options.get("mask"), options.get("bias"), None, options.get("sinks"))
    forward = _dispatch.choose(p, "auto", request=Request(x, Outputs(False, return_lse)))
    vjp = _dispatch.choose(p, "auto", vjp_inputs=x)
    return p, x, forward, vjp


def triton_runs(p, x) -> bool:
    """Whether the Triton kernels would take the call here (triton installed, and under
    its interpreter for CPU tensors)."""
    try:
        plan_triton(p, x)
    except CannotUseTritonError:
        return False
    return True


def test_torch_native_first_on_a_gpu(torch_backend):
    _, _, forward, vjp = gpu_choice(torch_backend, (2, 4, 64, 16), (2, 4, 64, 16), is_causal=True)
    assert (forward.name, vjp.name) == ("native", "native")
    assert not forward.why


@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True, "alignment": "bottom_right"},  # L != S: a mask would be built
        {"window": (8, 0)},
        {"softcap": 5.0},
    ],
    ids=["causal-bottom-right", "window", "softcap"],
)
def test_triton_where_torch_cannot_on_a_gpu(torch_backend, options):
    """Where torch's kernels would need a built mask or cannot compute the call, ``"auto"``
    takes the Triton kernels when they run here, and says why native was passed over."""
    p, x, forward, vjp = gpu_choice(torch_backend, (2, 4, 32, 16), (2, 4, 96, 16), **options)
    expected = "triton" if triton_runs(p, x) else ("materialized", "native")
    if expected == "triton":
        assert forward.name == vjp.name == "triton"
    else:  # the reason the Triton kernels were passed over is given
        assert forward.name in expected
        assert any(reason.startswith("triton: ") for reason in forward.why)
    assert any("native" in reason or "softcap" in reason for reason in forward.why)


def test_autograd_lse_cotangent_never_takes_the_native_backward(torch_backend):
    """A backward that receives a log-sum-exp cotangent cannot use torch's kernels."""
    q = torch_backend.asarray(np.zeros((2, 4, 64, 16)), "float16")
    p = dataclasses.replace(validate(q, q, q, Options()), on_gpu=True)
    choice = _dispatch.choose(p, "auto", vjp_inputs=Inputs(q, q, q), lse_cotangent=True)
    assert choice.name != "native"
    assert any("log-sum-exp cotangent" in reason for reason in choice.why)


def test_cpu_rule_unchanged(torch_cpu_backend):
    """Off a GPU the Triton kernels are never chosen automatically."""
    q = torch_cpu_backend.asarray(np.zeros((2, 4, 32, 16)), "float32")
    k = torch_cpu_backend.asarray(np.zeros((2, 4, 96, 16)), "float32")
    explanation = sdpa_array.explain(q, k, k, softcap=3.0)
    assert explanation.forward == "materialized"
    assert "softcap" in " ".join(explanation.forward_why)
    assert explanation.vjp == "materialized"
    assert any(reason.startswith("triton: ") for reason in explanation.vjp_why)


def test_explain_names_the_native_kernel(torch_backend):
    q = torch_backend.asarray(np.zeros((2, 4, 32, 16)), "float32")
    explanation = sdpa_array.explain(q, q, q, return_lse=True)
    assert explanation.forward == "native"
    # float32 on CUDA: the memory-efficient kernel (cuDNN and flash take half precision)
    kernel = "efficient_attention" if torch_backend.device == "cuda" else "flash_attention_for_cpu"
    assert explanation.forward_kernel == f"torch.ops.aten._scaled_dot_product_{kernel}"
    text = str(explanation)
    assert text.startswith("forward: native (torch.ops.aten.")
    assert "vjp: " in text


def test_explain_validates_like_the_call(backend):
    q = backend.asarray(np.zeros((2, 4, 8)), "float32")
    k = backend.asarray(np.zeros((2, 5, 7)), "float32")
    with pytest.raises(ValueError, match="E"):
        sdpa_array.explain(q, k, k)
    with pytest.raises(ValueError, match="implementation"):
        sdpa_array.explain(q, q, q, implementation="fastest")


def _plan_lse_on_cuda(backend, dtype, E, options, bias):
    q = backend.asarray(np.zeros((2, 4, 24, E)), dtype)
    b = backend.asarray(np.zeros((24, 24)), dtype) if bias else None
    p = dataclasses.replace(validate(q, q, q, Options(bias=b, **options)), on_gpu=True)
    return plan_native(p, Request(Inputs(q, q, q, None, b), Outputs(False, True)))


@pytest.mark.parametrize(
    ("dtype", "E", "options", "bias", "kernel"),
    [
        ("float16", 64, {"is_causal": True}, False, "_scaled_dot_product_cudnn_attention"),
        ("bfloat16", 4, {}, False, "_scaled_dot_product_cudnn_attention"),  # padded to 8
        ("float16", 192, {}, False, "_scaled_dot_product_flash_attention"),  # cuDNN: <= 128
        ("float16", 64, {}, True, "_scaled_dot_product_efficient_attention"),
        ("float16", 64, {"window": (3, 0)}, False, "_scaled_dot_product_efficient_attention"),
        ("float32", 64, {}, False, "_scaled_dot_product_efficient_attention"),
    ],
)
def test_cuda_kernels_returning_the_lse(torch_backend, dtype, E, options, bias, kernel):
    """Which of torch's CUDA kernels returns the log-sum-exp (planned, not run): cuDNN for
    half precision without a mask or bias, flash for head dims cuDNN does not take, the
    memory-efficient kernel for masks, biases and float32."""
    delegation = _plan_lse_on_cuda(torch_backend, dtype, E, options, bias)
    assert delegation.kernel == f"torch.ops.aten.{kernel}"
    assert not delegation.lse_differentiable  # autograd runs our backward for the lse
    assert delegation.builds_mask == ("window" in options)


@pytest.mark.parametrize(
    ("dtype", "E", "reason"),
    [("float64", 64, "computes float64"), ("float16", 320, "head dims up to 256")],
)
def test_no_cuda_kernel_returns_this_lse(torch_backend, dtype, E, reason):
    with pytest.raises(sdpa_array.CannotDelegateError, match=reason):
        _plan_lse_on_cuda(torch_backend, dtype, E, {}, False)
