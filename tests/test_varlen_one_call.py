"""A packed self-attention call as one call with the sequences as segment ids.

Where every sequence attends its own tokens (equal offsets), with no mask, bias or score
function and no dropout, off a GPU, ``auto`` and ``blocked`` run the packed tokens as one
call (:mod:`sdpa_array._api.varlen.one_call`). Each such call is checked against the
float64 oracle with its bound (``sdpa_array.testing``), forward and VJP, for every option
that applies; and the calls that do not qualify keep one call per sequence.
"""

from __future__ import annotations

from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import sdpa_array
from sdpa_array._api.varlen import forward as varlen_forward
from sdpa_array._api.varlen import one_call
from sdpa_array.testing import assert_varlen_close_to_oracle, assert_varlen_vjp_close_to_oracle

HQ, HKV, E = 4, 2, 8
#: Four sequences, an empty one among them; each attends its own tokens.
CU = [0, 5, 5, 12, 20]

#: The options of such a call, one feature each (with GQA throughout).
CASES = {
    "plain": {},
    "causal-top-left": {"is_causal": True},
    "causal-bottom-right": {"is_causal": True, "alignment": "bottom_right"},
    "window": {"window": (2, 1)},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    "scale-array": {"scale": np.asarray(0.3)},
}


def _arrays(backend: Any, dtype: str, total: int, seed: int = 0) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    shapes = ((total, HQ, E), (total, HKV, E), (total, HKV, E), (total, HQ, E))
    return tuple(backend.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _on(backend: Any, dtype: str, options: dict[str, Any]) -> dict[str, Any]:
    out = dict(options)
    for name in ("sinks", "scale"):
        if name in out:
            out[name] = backend.asarray(out[name], dtype)
    return out


@pytest.fixture
def one_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The packed calls run as one call (``"forward"``, ``"vjp"``)."""
    seen: list[str] = []
    forward, vjp = one_call.one_forward, one_call.one_vjp
    monkeypatch.setattr(
        varlen_forward, "one_forward", lambda *a: seen.append("forward") or forward(*a)
    )
    from sdpa_array._api.varlen import vjp as varlen_vjp

    monkeypatch.setattr(varlen_vjp, "one_vjp", lambda *a: seen.append("vjp") or vjp(*a))
    return seen


@pytest.mark.parametrize("implementation", ["auto", "blocked"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_call_against_the_oracle(host_backend_dtype, case, implementation, one_calls):
    backend, dtype = host_backend_dtype
    q, k, v, g = _arrays(backend, dtype, CU[-1])
    options = {**_on(backend, dtype, CASES[case]), "enable_gqa": True}
    run = {**options, "implementation": implementation}
    result = sdpa_array.scaled_dot_product_attention_varlen(q, k, v, CU, CU, return_lse=True, **run)
    assert_varlen_close_to_oracle(result, q, k, v, CU, CU, return_lse=True, **options)
    grads = sdpa_array.scaled_dot_product_attention_varlen_vjp(q, k, v, g, CU, CU, **run)
    assert_varlen_vjp_close_to_oracle(grads, q, k, v, g, CU, CU, **options)
    assert one_calls == ["forward", "vjp"]


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    lengths=st.lists(st.integers(0, 12), min_size=2, max_size=6),
    causal=st.booleans(),
    window=st.none() | st.tuples(st.none() | st.integers(0, 4), st.none() | st.integers(0, 4)),
    blocks=st.sampled_from([(None, None), (2, 3), (4, 4)]),
    seed=st.integers(0, 2**16),
)
def test_drawn_sequences_as_one_call(lengths, causal, window, blocks, seed):
    """NumPy float32: any sequences (empty ones included), causal or windowed, any tiles."""
    from sdpa_array.testing import get_backend

    cu = [0, *np.cumsum(lengths).tolist()]
    q, k, v, g = _arrays(get_backend("numpy"), "float32", cu[-1], seed)
    options = {"is_causal": causal, "window": window, "enable_gqa": True}
    run = {**options, "implementation": "blocked", "block_q": blocks[0], "block_k": blocks[1]}
    assert one_call.segments_call(q, _packed(cu), _options(options), "blocked", False) is not None
    result = sdpa_array.scaled_dot_product_attention_varlen(q, k, v, cu, cu, return_lse=True, **run)
    assert_varlen_close_to_oracle(result, q, k, v, cu, cu, return_lse=True, **options)
    grads = sdpa_array.scaled_dot_product_attention_varlen_vjp(q, k, v, g, cu, cu, **run)
    assert_varlen_vjp_close_to_oracle(grads, q, k, v, g, cu, cu, **options)


def _packed(cu: list[int]) -> Any:
    from sdpa_array._problem.packed import Packed

    offsets = np.asarray(cu, dtype=np.int64)
    return Packed(offsets, offsets)


def _options(options: dict[str, Any]) -> Any:
    from sdpa_array._problem.options import Options

    return Options(**options)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"cu_k": [0, 4, 4, 12, 20]}, "offsets differ"),
        ({"return_max_scores": True}, "one maximum per sequence"),
        ({"dropout_p": 0.5, "dropout_seed": 3}, "bits drawn per sequence"),
        ({"mask_mod": sdpa_array.mods.causal()}, "positions are the sequence's"),
        ({"implementation": "materialized"}, "an implementation asked for"),
    ],
)
def test_other_calls_keep_one_call_per_sequence(change, why, one_calls, monkeypatch):
    from sdpa_array.testing import get_backend

    q, k, v, _ = _arrays(get_backend("numpy"), "float64", CU[-1])
    calls: list[int] = []
    original = varlen_forward.run_forward
    monkeypatch.setattr(varlen_forward, "run_forward", lambda *a: calls.append(1) or original(*a))
    options = {"cu_k": CU, **change}
    cu_k = options.pop("cu_k")
    sdpa_array.scaled_dot_product_attention_varlen(q, k, v, CU, cu_k, enable_gqa=True, **options)
    assert one_calls == [], why
    assert len(calls) == len(CU) - 1


def test_dask_one_call_stays_lazy_and_right(dask_backend, one_calls):
    q, k, v, _ = _arrays(dask_backend, "float64", CU[-1])
    options = {"is_causal": True, "enable_gqa": True}
    result = sdpa_array.scaled_dot_product_attention_varlen(q, k, v, CU, CU, **options)
    assert type(result).__module__.startswith("dask")
    assert_varlen_close_to_oracle(result, q, k, v, CU, CU, **options)
    assert one_calls == ["forward"]


def test_torch_autograd_through_the_one_call(torch_cpu_backend, one_calls):
    """torch's autograd through the one call gives the VJP's gradients (float64)."""
    import torch

    q, k, v, g = (x.requires_grad_(True) for x in _arrays(torch_cpu_backend, "float64", CU[-1]))
    options = {"is_causal": True, "enable_gqa": True, "softcap": 3.0}
    out = sdpa_array.scaled_dot_product_attention_varlen(q, k, v, CU, CU, **options)
    got = torch.autograd.grad(out, (q, k, v), g.detach())
    want = sdpa_array.scaled_dot_product_attention_varlen_vjp(
        q.detach(), k.detach(), v.detach(), g.detach(), CU, CU, **options
    )
    for a, b in zip(got, want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert one_calls == ["forward", "vjp"]


def test_jax_jit_grad_through_the_one_call(jax_backend, one_calls):
    """``jax.jit(jax.grad)`` through the one call gives the VJP's gradients (float64: the
    same products in the same order, so they agree to rounding)."""
    import jax
    import jax.numpy as jnp

    q, k, v, g = _arrays(jax_backend, "float64", CU[-1])
    options = {"is_causal": True, "enable_gqa": True}

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = sdpa_array.scaled_dot_product_attention_varlen(q, k, v, CU, CU, **options)
        return jnp.sum(out * g)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert one_calls == ["forward"]  # traced once
    want = sdpa_array.scaled_dot_product_attention_varlen_vjp(q, k, v, g, CU, CU, **options)
    for a, b in zip(got, want[:3], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def test_torch_func_grad_through_the_one_call(torch_cpu_backend, one_calls):
    """``torch.func.grad`` through the one call gives the VJP's gradients (float64)."""
    import torch

    q, k, v, g = _arrays(torch_cpu_backend, "float64", CU[-1])
    options = {"is_causal": True, "enable_gqa": True}

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = sdpa_array.scaled_dot_product_attention_varlen(q, k, v, CU, CU, **options)
        return (out * g).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = sdpa_array.scaled_dot_product_attention_varlen_vjp(q, k, v, g, CU, CU, **options)
    for a, b in zip(got, want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert one_calls[0] == "forward"
