"""The NumPy path's optional kernels (:func:`sdpa_array.set_optional_kernels`): off by
default, torch's kernels on NumPy memory once allowed, against the float64 oracle and the
library's own path, forward and VJP. Tests that allow them skip without torch."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import sdpa_array
from sdpa_array import CannotDelegateError
from tests.helpers import (
    KV,
    Q_GQA,
    Q,
    check_against_oracle,
    check_vjp_against_oracle,
    spy_native_kernels,
)

TORCH_PUBLIC = "torch.nn.functional.scaled_dot_product_attention on NumPy memory"
TORCH_CPU_FLASH = "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu on NumPy memory"

#: Calls torch's kernels compute exactly (``window``: with a mask built for it).
OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bottom_right": {"is_causal": True, "alignment": "bottom_right"},
    "window": {"window": (2, 1)},
    "scale": {"scale": 0.3},
}


@pytest.fixture
def torch_allowed() -> Iterator[None]:
    """torch's kernels allowed for the test (skipped without torch), off afterwards."""
    pytest.importorskip("torch")
    sdpa_array.set_optional_kernels("torch")
    try:
        yield
    finally:
        sdpa_array.set_optional_kernels()


def arrays(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in shapes]


def test_off_by_default(numpy_backend):
    """Nothing is allowed unless asked for: ``auto`` keeps the library's own path, and
    ``"native"`` refuses, naming the setting."""
    assert sdpa_array.get_optional_kernels() == ()
    q = numpy_backend.asarray(np.zeros((2, 4, 3)), "float32")
    explanation = sdpa_array.explain(q, q, q)
    assert explanation.forward != "native"
    assert "set_optional_kernels('torch')" in "\n".join(explanation.forward_why)
    with pytest.raises(CannotDelegateError, match="no kernel for numpy"):
        sdpa_array.scaled_dot_product_attention(q, q, q, implementation="native")
    with pytest.raises(CannotDelegateError, match="no backward for numpy"):
        sdpa_array.scaled_dot_product_attention_vjp(q, q, q, q, implementation="native")


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown optional kernels"):
        sdpa_array.set_optional_kernels("numexpr")
    assert sdpa_array.get_optional_kernels() == ()


@pytest.mark.parametrize("case", list(OPTIONS))
def test_forward_against_the_oracle(numpy_backend_dtype, torch_allowed, case):
    backend, dtype = numpy_backend_dtype
    q, k, v = arrays(Q, KV, KV)
    for implementation in ("native", "auto"):
        check_against_oracle(
            backend, dtype, q, k, v, implementation=implementation, **OPTIONS[case]
        )


def test_masks_bias_and_grouped_heads(numpy_backend_dtype, torch_allowed):
    backend, dtype = numpy_backend_dtype
    q, k, v, bias = arrays(Q, KV, KV, (Q[-2], KV[-2]))
    mask = np.random.default_rng(1).random((Q[-2], KV[-2])) < 0.7
    check_against_oracle(backend, dtype, q, k, v, mask=mask, implementation="native")
    check_against_oracle(backend, dtype, q, k, v, bias=bias, implementation="native")
    check_against_oracle(backend, dtype, q, k, v, bias=bias[0, :], implementation="native")
    f = sdpa_array.scaled_dot_product_attention
    xq, xk, xv = (backend.asarray(a, dtype) for a in (q, k, v))
    scalar = np.float64(0.5)  # a NumPy scalar: read-only, no axis
    got = f(xq, xk, xv, bias=scalar, implementation="native")
    np.testing.assert_allclose(got, f(xq, xk, xv, bias=scalar), rtol=2e-3, atol=2e-3)
    q, k, v = arrays(Q_GQA, KV, KV)
    check_against_oracle(backend, dtype, q, k, v, enable_gqa=True, implementation="native")


@pytest.mark.parametrize("case", list(OPTIONS))
def test_vjp_against_the_oracle(numpy_backend_dtype, torch_allowed, case):
    backend, dtype = numpy_backend_dtype
    q, k, v, g = arrays(Q, KV, KV, Q)
    check_vjp_against_oracle(backend, dtype, q, k, v, g, implementation="native", **OPTIONS[case])


def test_the_same_as_the_generic_path(numpy_backend, torch_allowed):
    """torch's route and the library's own path agree to float32 rounding, forward and VJP."""
    xq, xk, xv, xg = (
        numpy_backend.asarray(a, "float32")
        for a in arrays((2, 3, 40, 16), (2, 3, 50, 16), (2, 3, 50, 16), (2, 3, 40, 16))
    )
    f = sdpa_array.scaled_dot_product_attention
    vjp = sdpa_array.scaled_dot_product_attention_vjp
    for options in OPTIONS.values():
        ours = f(xq, xk, xv, implementation="materialized", return_lse=True, **options)
        theirs = f(xq, xk, xv, implementation="native", return_lse=True, **options)
        for a, b in zip(ours, theirs, strict=True):
            assert isinstance(b, np.ndarray)
            assert b.dtype == np.float32
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6)
        ours = vjp(xq, xk, xv, xg, implementation="materialized", **options)
        theirs = vjp(xq, xk, xv, xg, implementation="native", **options)
        for a, b in zip(ours, theirs, strict=True):
            assert isinstance(b, np.ndarray)
            assert b.dtype == np.float32
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-5)


def test_auto_takes_it_for_the_forward_only(numpy_backend, torch_allowed, monkeypatch):
    """``auto`` runs torch's kernel for the forward call, ``explain()`` names it; the VJP's
    ``auto`` keeps the library's own backward; return_lse takes torch's CPU flash kernel."""
    called = spy_native_kernels(monkeypatch)
    q = numpy_backend.asarray(np.ones((2, 4, 3)), "float32")
    explanation = sdpa_array.explain(q, q, q)
    assert (explanation.forward, explanation.forward_kernel) == ("native", TORCH_PUBLIC)
    assert explanation.vjp != "native"
    assert sdpa_array.explain(q, q, q, return_lse=True).forward_kernel == TORCH_CPU_FLASH
    sdpa_array.scaled_dot_product_attention(q, q, q)
    assert called == ["torch's kernels on NumPy memory"]


def test_turning_it_on_and_off_replans_kept_calls(numpy_backend):
    """The plans kept for repeated calls (``sdpa_array._plan.cache``) follow the setting."""
    pytest.importorskip("torch")
    q = numpy_backend.asarray(np.ones((2, 4, 3)), "float32")
    f = sdpa_array.scaled_dot_product_attention
    before = f(q, q, q)
    try:
        sdpa_array.set_optional_kernels("torch")
        assert sdpa_array.get_optional_kernels() == ("torch",)
        assert sdpa_array.explain(q, q, q).forward == "native"
        np.testing.assert_allclose(f(q, q, q), before, rtol=1e-6)
    finally:
        sdpa_array.set_optional_kernels()
    assert sdpa_array.explain(q, q, q).forward != "native"


def test_read_only_and_reversed_arrays(numpy_backend, torch_allowed):
    """Arrays torch cannot share (read-only, negative strides) are copied, not changed."""
    q, k, v = (a.astype(np.float32) for a in arrays(Q, KV, KV))
    expected = sdpa_array.scaled_dot_product_attention(q, k, v, implementation="materialized")
    k_reversed = np.ascontiguousarray(k[..., ::-1, :])[..., ::-1, :]
    q.flags.writeable = False
    got = sdpa_array.scaled_dot_product_attention(q, k_reversed, v, implementation="native")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-6)
    assert not q.flags.writeable
    mask = np.random.default_rng(1).random((Q[-2], KV[-2])) < 0.7
    broadcast = np.broadcast_to(mask, (*Q[:-1], KV[-2]))  # read-only, strides 0
    f = sdpa_array.scaled_dot_product_attention
    expected = f(q, k, v, mask=broadcast, implementation="materialized")
    got = f(q, k, v, mask=broadcast, implementation="native")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-6)


def test_what_torch_is_not_given_falls_back(numpy_backend, torch_allowed):
    """Lengths (and what torch's kernels refuse) keep the library's own path under auto,
    with the reason in ``explain()``."""
    q = numpy_backend.asarray(np.ones((2, 4, 3)), "float32")
    explanation = sdpa_array.explain(q, q, q, key_lengths=3)
    assert explanation.forward != "native"
    assert "lengths" in "\n".join(explanation.forward_why)
    with pytest.raises(CannotDelegateError, match="softcap"):
        sdpa_array.scaled_dot_product_attention(q, q, q, softcap=2.0, implementation="native")
