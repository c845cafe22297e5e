"""The VJP given the forward's output and log-sum-exp (``out=``, ``lse=``).

A training step holds both from its forward call; given them, the backward takes
``P = exp(Z - lse)`` and ``D = rowsum(dO * out)`` from them instead of running the forward
pass again. The gradients must be the oracle's (within the same bounds as without them),
the forward kernel must not run, and arrays that cannot be the forward's are refused
before any work.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array._api.layout import swap_heads_and_length
from sdpa_array._kernels import vjp_blocked
from sdpa_array.testing import assert_vjp_close_to_oracle
from tests.helpers import KV, KV_EV, Q_GQA, Q, ran_fused

#: (implementation, block sizes): the blocked path with 3 x 4 blocks holds no whole row in
#: one tile, so without ``out`` and ``lse`` it runs its forward pass first.
VARIANTS = [
    pytest.param("materialized", {}, id="materialized"),
    pytest.param("blocked", {}, id="blocked"),
    pytest.param("blocked", {"block_q": 3, "block_k": 4}, id="blocked-3x4"),
    pytest.param("auto", {}, id="auto"),
]

#: (id, shapes of q, k, v, options): plain, causal with grouped heads and a window, sinks
#: with a soft-cap, and the (..., L, H, E) layout.
CASES = [
    pytest.param(Q, KV, KV, {}, id="plain"),
    pytest.param(
        Q_GQA, KV, KV_EV, {"enable_gqa": True, "is_causal": True, "window": (3, 1)}, id="gqa-causal"
    ),
    pytest.param(Q, KV, KV, {"sinks": "draw", "softcap": 2.0}, id="sinks-softcap"),
    pytest.param((2, 6, 2, 4), (2, 7, 2, 4), (2, 7, 2, 4), {"layout": "BLHE"}, id="BLHE"),
]


def _arrays(backend, dtype, q_shape, k_shape, v_shape, options, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (backend.asarray(rng.standard_normal(s), dtype) for s in (q_shape, k_shape, v_shape))
    options = dict(options)
    if options.get("sinks") == "draw":
        heads = q_shape[-3]
        options["sinks"] = backend.asarray(rng.standard_normal(heads), dtype)
    return q, k, v, options, rng


@pytest.mark.parametrize(("q_shape", "k_shape", "v_shape", "options"), CASES)
@pytest.mark.parametrize(("implementation", "blocks"), VARIANTS)
def test_vjp_given_out_and_lse_matches_oracle(
    backend_dtype, implementation, blocks, q_shape, k_shape, v_shape, options
):
    backend, dtype = backend_dtype
    q, k, v, options, rng = _arrays(backend, dtype, q_shape, k_shape, v_shape, options)
    out, lse = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
    g = backend.asarray(rng.standard_normal(tuple(out.shape)), dtype)
    run = {"implementation": implementation, **blocks, **options}
    given = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, out=out, lse=lse, **run)
    plain = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    fused = ran_fused(q, k, v, run, vjp=True)
    if options.pop("layout", "BHLE") == "BLHE":  # the oracle is heads first
        q, k, v, g, *given = swap_heads_and_length(q, k, v, g, *given)
        plain = swap_heads_and_length(*plain)
    assert_vjp_close_to_oracle(plain, q, k, v, g, fused=fused, **options)
    # D = rowsum(dO * out) reads the output rounded to the inputs' dtype
    assert_vjp_close_to_oracle(given, q, k, v, g, fused=fused, rounded_output=True, **options)


@pytest.mark.parametrize(("implementation", "blocks"), VARIANTS[:3])
def test_vjp_given_out_and_lse_does_not_run_the_forward(
    eager_backend, monkeypatch, implementation, blocks
):
    """The blocked backward with blocks smaller than a row runs its forward pass for the
    log-sum-exp (counted here); given ``out`` and ``lse`` it must not. The materialized
    backward runs no forward kernel either way (its probabilities come from its own
    softmax, or from ``lse``)."""
    calls = []
    forward = vjp_blocked.blocked_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(vjp_blocked, "blocked_attention", counted)
    monkeypatch.setenv("SDPA_ARRAY_JAX_EAGER_JIT", "0")  # count each call, not one trace
    q, k, v, _, rng = _arrays(eager_backend, "float32", Q, KV, KV, {})
    out, lse = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True)
    g = eager_backend.asarray(rng.standard_normal(tuple(out.shape)), "float32")
    run = {"implementation": implementation, **blocks}
    sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    expected_without = 1 if blocks else 0
    assert len(calls) == expected_without, calls
    sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, out=out, lse=lse, **run)
    assert len(calls) == expected_without, "the forward ran although out and lse were given"


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"lse": None}, ValueError, "out was given without lse"),
        ({"out": None}, ValueError, "lse was given without out"),
        ({"out_shape": (2, 3, 5)}, ValueError, r"out has shape \(2, 3, 5\).*\(2, 3, 6\)"),
        ({"lse_shape": (2, 4)}, ValueError, r"lse has shape \(2, 4\).*\(2, 3\)"),
        ({"out_dtype": "float64"}, TypeError, "out must have the output's dtype"),
        ({"lse_library": "list"}, TypeError, "lse must be an array of the inputs' library"),
    ],
)
def test_out_and_lse_are_validated(backend, change, error, match):
    rng = np.random.default_rng(1)
    shapes = ((2, 3, 4), (2, 5, 4), (2, 5, 6))
    q, k, v = (backend.asarray(rng.standard_normal(s), "float32") for s in shapes)
    g = backend.asarray(np.ones((2, 3, 6)), "float32")
    out_dtype = change.get("out_dtype", "float32")
    out = backend.asarray(np.ones(change.get("out_shape", (2, 3, 6))), out_dtype)
    lse = backend.asarray(np.zeros(change.get("lse_shape", (2, 3))), "float32")
    if change.get("lse_library") == "list":
        lse = np.zeros((2, 3)).tolist()
    given = {"out": out, "lse": lse}
    given.update({name: None for name in ("out", "lse") if name in change and change[name] is None})
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **given)
