"""The Triton kernels through the public API: dispatch, autograd and double backward.

``tests/test_triton.py`` checks the kernels against the oracle; this file checks that the
public entries run exactly those kernels (``implementation="triton"``), that torch autograd
differentiates them with their own backward kernel, and that a double backward, which a
fused kernel's gradients cannot give, runs the blocked backward kernel instead. Runs where
the kernels run: under ``TRITON_INTERPRET=1`` on CPU torch tensors, else on a GPU.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install triton): the Triton kernels need it",
        allow_module_level=True,
    )

import sdpa_array
from sdpa_array._kernels.result import finalize
from sdpa_array._kernels.triton import triton_attention
from sdpa_array._kernels.triton.configs import interpreting
from sdpa_array._plan import autograd as _autograd
from sdpa_array._problem.options import Options
from sdpa_array._problem.outputs import Outputs
from sdpa_array._problem.problem import Inputs, validate
from sdpa_array.testing import get_backend

BACKEND = get_backend("torch" if interpreting() else "torch:cuda")
if not BACKEND.is_available():
    pytest.skip(
        "the Triton kernels need a CUDA device (or TRITON_INTERPRET=1), absent here",
        allow_module_level=True,
    )

OPTIONS = {"is_causal": True, "alignment": "bottom_right", "softcap": 4.0}


def _inputs(requires_grad=False):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in ((2, 2, 24, 16), (2, 2, 40, 16), (2, 2, 40, 16))]
    tensors = [BACKEND.asarray(a, "float32") for a in arrays]
    if requires_grad:
        tensors = [t.requires_grad_() for t in tensors]
    return tensors


def _spy_backward(monkeypatch):
    """Record the implementation whose backward kernel the autograd wrapper runs."""
    seen: list[str] = []
    original = _autograd._gradients

    def spy(choice, *args):
        seen.append(choice.name)
        return original(choice, *args)

    monkeypatch.setattr(_autograd, "_gradients", spy)
    return seen


def test_public_call_runs_the_triton_kernel():
    q, k, v = _inputs()
    out, lse = sdpa_array.scaled_dot_product_attention(
        q, k, v, implementation="triton", return_lse=True, **OPTIONS
    )
    p = validate(q, k, v, Options(**OPTIONS))
    direct = triton_attention(p, Inputs(q, k, v), Outputs(lse=True))
    assert bool((out == direct.out).all())
    assert bool((lse == direct.lse).all())
    explained = sdpa_array.explain(q, k, v, implementation="triton", **OPTIONS)
    assert (explained.forward, explained.vjp) == ("triton", "triton")


def test_autograd_runs_the_triton_backward(monkeypatch):
    """torch autograd through ``implementation="triton"`` is the VJP's Triton kernel; the
    maximum scores come from the Triton forward kernel, detached."""
    import torch

    seen = _spy_backward(monkeypatch)
    q, k, v = _inputs(requires_grad=True)
    out, best = sdpa_array.scaled_dot_product_attention(
        q, k, v, implementation="triton", return_max_scores=True, **OPTIONS
    )
    assert not best.requires_grad  # the kernel's maximum scores, a statistic
    p = validate(q, k, v, Options(**OPTIONS))
    direct = triton_attention(p, Inputs(q, k, v), Outputs(max_scores=True))
    assert bool((best == finalize(p, direct, Outputs(max_scores=True))[1]).all())
    g = torch.ones_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert seen == ["triton"]
    expected = sdpa_array.scaled_dot_product_attention_vjp(
        q.detach(), k.detach(), v.detach(), g, implementation="triton", **OPTIONS
    )
    for got, want in zip(grads, expected, strict=True):
        assert bool((got == want).all())


def test_double_backward_runs_the_blocked_backward(monkeypatch):
    """``create_graph=True``: the gradients must be differentiable, which a fused kernel's
    are not, so the blocked backward kernel (written with torch operations) runs, and its
    gradients have a graph that reaches the inputs."""
    import torch

    seen = _spy_backward(monkeypatch)
    q, k, v = _inputs(requires_grad=True)
    out = sdpa_array.scaled_dot_product_attention(q, k, v, implementation="triton", **OPTIONS)
    (dq,) = torch.autograd.grad((out**2).sum(), (q,), create_graph=True)
    assert seen == ["blocked"]
    assert dq.requires_grad
    (dv,) = torch.autograd.grad((dq**2).sum(), (v,))
    assert bool(torch.isfinite(dv).all())
    assert float(dv.abs().max()) > 0
