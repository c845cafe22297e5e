"""The packed variable-length layout: ``scaled_dot_product_attention_varlen`` and its VJP.

* the oracle's packed functions against the oracle run sequence by sequence (its own
  check: the packed oracle pads, this loops);
* every option that applies (causal in both alignments, window, GQA, softcap, sinks, an
  array scale, dropout, mask and bias functions), with the log-sum-exp and the maximum
  scores, and the VJP, on every backend and the materialized, blocked and auto paths,
  against the oracle; sequence lengths drawn by Hypothesis, empty sequences included;
* sequence ``n`` is batch element ``n`` of the padded call: the same dropout bits and mod
  indices; each sequence is computed alone (no ``(total, total)`` work);
* torch autograd, ``jax.grad`` under ``jax.jit``, lazy Dask;
* bad input gets an error naming the argument, before any work.
"""

from __future__ import annotations

from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array._api.varlen import forward as varlen_forward
from sdpa_array._arrays.compat import array_namespace
from sdpa_array.testing import assert_varlen_close_to_oracle, assert_varlen_vjp_close_to_oracle

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

HQ, HKV, E = 4, 2, 8
#: Query and key offsets of four sequences: an empty one, one with no keys, one longer in
#: keys than queries, one longer in queries.
CU_Q = [0, 0, 3, 10, 16]
CU_K = [0, 4, 4, 9, 13]


def _arrays(backend: Any, dtype: str, cu_q: list[int], cu_k: list[int], seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    shapes = ((cu_q[-1], HQ, E), (cu_k[-1], HKV, E), (cu_k[-1], HKV, E), (cu_q[-1], HQ, E))
    return tuple(backend.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _batch_mask(b, h, q_idx, kv_idx):
    """Uses every index: the batch (the sequence), the head and both positions."""
    return (kv_idx + b + h) % 3 != 0


def _batch_score(s, b, h, q_idx, kv_idx):
    """A score function of the score and every index (the batch is the sequence)."""
    xp = array_namespace({"s": s})
    gain = 1.0 + 0.25 * xp.astype(b, s.dtype) + 0.125 * xp.astype(h, s.dtype)
    return s * gain - 0.125 * xp.astype(xp.abs(q_idx - kv_idx), s.dtype)


def _batch_score_slope(s, b, h, q_idx, kv_idx):
    xp = array_namespace({"s": s})
    return 1.0 + 0.25 * xp.astype(b, s.dtype) + 0.125 * xp.astype(h, s.dtype)


#: The options of a packed call, one feature each (with GQA throughout).
CASES = {
    "plain": {},
    "causal-top-left": {"is_causal": True},
    "causal-bottom-right": {"is_causal": True, "alignment": "bottom_right"},
    "window": {"window": (2, 1), "alignment": "bottom_right"},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    "scale-array": {"scale": np.asarray(0.3)},
    "dropout": {"dropout_p": 0.4, "dropout_seed": 11},
    "mods": {"mask_mod": _batch_mask, "bias_mod": sdpa_array.mods.alibi(np.linspace(0.1, 1, 4))},
    "score-mod": {
        "score_mod": sdpa_array.mods.score_function(_batch_score, _batch_score_slope),
        "softcap": 3.0,
    },
}


def _on(backend: Any, dtype: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with their arrays on ``backend`` (``scale`` and ``sinks``)."""
    out = dict(options)
    if "sinks" in out:
        out["sinks"] = backend.asarray(out["sinks"], dtype)
    if "scale" in out:
        out["scale"] = backend.asarray(out["scale"], dtype)
    return out


def _fused(q, k, v, cu_q, cu_k, run: dict[str, Any], *, vjp: bool = False) -> bool:
    """Whether some sequence's call runs a fused kernel in the inputs' dtype (the oracle's
    bound then has its terms): as :func:`sdpa_array.explain` says for it."""
    for n in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        args = (x[s, ...] for x, s in ((q, rows), (k, keys), (v, keys)))
        explanation = sdpa_array.explain(*args, layout="BLHE", **run)
        if explanation.vjp_fused if vjp else explanation.forward_fused:
            return True
    return False


@pytest.mark.parametrize("implementation", ["auto", "materialized", "blocked"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_option_against_the_oracle(backend_dtype, case, implementation):
    backend, dtype = backend_dtype
    q, k, v, g = _arrays(backend, dtype, CU_Q, CU_K)
    options = {**_on(backend, dtype, CASES[case]), "enable_gqa": True}
    run = {**options, "implementation": implementation}
    result = sdpa_array.scaled_dot_product_attention_varlen(
        q, k, v, CU_Q, CU_K, return_lse=True, return_max_scores=True, **run
    )
    fused = _fused(q, k, v, CU_Q, CU_K, run)
    assert_varlen_close_to_oracle(
        result, q, k, v, CU_Q, CU_K, return_lse=True, return_max_scores=True, fused=fused,
        **options,
    )  # fmt: skip
    grads = sdpa_array.scaled_dot_product_attention_varlen_vjp(q, k, v, g, CU_Q, CU_K, **run)
    fused = _fused(q, k, v, CU_Q, CU_K, run, vjp=True)
    assert_varlen_vjp_close_to_oracle(grads, q, k, v, g, CU_Q, CU_K, fused=fused, **options)


@hypothesis.given(
    lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=0, max_size=5),
    causal=st.booleans(),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    window=st.none() | st.tuples(st.none() | st.integers(0, 4), st.none() | st.integers(0, 4)),
    implementation=st.sampled_from(["materialized", "blocked"]),
    seed=st.integers(0, 2**16),
)
def test_drawn_sequences_against_the_oracle(
    lengths, causal, alignment, window, implementation, seed
):
    """NumPy float32: any number of sequences of any lengths (empty ones included), with
    the restrictions that depend on them."""
    from sdpa_array.testing import get_backend

    numpy = get_backend("numpy")
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lengths], dtype=np.int64)])
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lengths], dtype=np.int64)])
    q, k, v, g = _arrays(numpy, "float32", list(cu_q), list(cu_k), seed)
    options = {"is_causal": causal, "alignment": alignment, "window": window, "enable_gqa": True}
    run = {**options, "implementation": implementation}
    if implementation == "blocked":
        run.update(block_q=2, block_k=3)
    result = sdpa_array.scaled_dot_product_attention_varlen(
        q, k, v, cu_q, cu_k, return_lse=True, return_max_scores=True, **run
    )
    assert_varlen_close_to_oracle(
        result, q, k, v, cu_q, cu_k, return_lse=True, return_max_scores=True, **options
    )
    grads = sdpa_array.scaled_dot_product_attention_varlen_vjp(q, k, v, g, cu_q, cu_k, **run)
    assert_varlen_vjp_close_to_oracle(grads, q, k, v, g, cu_q, cu_k, **options)


def _per_sequence(n: int, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for sequence ``n`` run alone: its mask function given the batch index
    ``n`` explicitly, without dropout (whose bits are the padded call's batch element)."""
    return {
        **options, "dropout_p": 0.0, "dropout_seed": None,
        "mask_mod": lambda b, h, i, j: _batch_mask(b + n, h, i, j),
    }  # fmt: skip


def test_the_packed_oracle_is_the_oracle_sequence_by_sequence():
    rng = np.random.default_rng(1)
    shapes = ((16, HQ, E), (13, HKV, E), (13, HKV, E), (16, HQ, E))
    q, k, v, g = (rng.standard_normal(s) for s in shapes)
    options = {
        "is_causal": True, "alignment": "bottom_right", "window": (3, None), "softcap": 3.0,
        "enable_gqa": True, "sinks": np.array([0.5, -1.0, 2.0, 0.0]), "mask_mod": _batch_mask,
    }  # fmt: skip
    dropout = {"dropout_p": 0.3, "dropout_seed": 4}
    out, lse, best = reference.scaled_dot_product_attention_varlen(
        q, k, v, CU_Q, CU_K, return_lse=True, return_max_scores=True, **options, **dropout
    )
    grads = reference.scaled_dot_product_attention_varlen_vjp(q, k, v, g, CU_Q, CU_K, **options)
    keep = sdpa_array.dropout_keep_mask(4, (4, HQ, 7, 5), 0.3)  # the padded call's bits
    d_sinks = np.zeros(HQ)
    for n in range(4):
        rows, keys = slice(CU_Q[n], CU_Q[n + 1]), slice(CU_K[n], CU_K[n + 1])
        L, S = rows.stop - rows.start, keys.stop - keys.start
        args = [np.swapaxes(x, 0, 1) for x in (q[rows], k[keys], v[keys], g[rows])]
        _, w, want_lse, want_best = reference.scaled_dot_product_attention(
            *args[:3], return_weights=True, return_lse=True, return_max_scores=True,
            **_per_sequence(n, options),
        )  # fmt: skip
        want = np.einsum("hqs,hse->hqe", w * keep[n, :, :L, :S] / 0.7, np.repeat(args[2], 2, 0))
        np.testing.assert_allclose(out[rows], np.swapaxes(want, 0, 1), atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], want_lse, atol=1e-12)
        np.testing.assert_allclose(best[n], want_best, atol=1e-12)
        dq, dk, dv, ds = reference.scaled_dot_product_attention_vjp(
            *args, **_per_sequence(n, options)
        )
        for got, want in ((grads[0][rows], dq), (grads[1][keys], dk), (grads[2][keys], dv)):
            np.testing.assert_allclose(got, np.swapaxes(want, 0, 1), atol=1e-12)
        d_sinks += ds
    assert best.shape == (4, HQ)
    np.testing.assert_allclose(grads[3], d_sinks, atol=1e-12)


def test_each_sequence_is_computed_alone(monkeypatch):
    """One call per sequence, on that sequence's rows and keys only: the work is the sum
    of the sequences' squared lengths, and no ``(total, total)`` array is formed."""
    calls = []
    original = varlen_forward.run_forward

    def spy(q, k, v, *args):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return original(q, k, v, *args)

    monkeypatch.setattr(varlen_forward, "run_forward", spy)
    q = np.ones((16, HQ, E))
    k = np.ones((13, HKV, E))
    sdpa_array.scaled_dot_product_attention_varlen(q, k, k, CU_Q, CU_K, enable_gqa=True)
    lengths = zip(np.diff(CU_Q), np.diff(CU_K), strict=True)
    assert calls == [((HQ, L, E), (HKV, S, E)) for L, S in lengths]


def test_no_sequence_gives_empty_results(backend):
    q, k, v, g = _arrays(backend, "float32", [0], [0])
    out, lse, best = sdpa_array.scaled_dot_product_attention_varlen(
        q, k, v, [0], return_lse=True, return_max_scores=True, enable_gqa=True
    )
    assert (tuple(out.shape), tuple(lse.shape), tuple(best.shape)) == ((0, HQ, E), (HQ, 0), (0, HQ))
    sinks = backend.asarray(np.ones(HQ), "float32")
    grads = sdpa_array.scaled_dot_product_attention_varlen_vjp(
        q, k, v, g, [0], enable_gqa=True, sinks=sinks
    )
    assert [tuple(x.shape) for x in grads] == [(0, HQ, E), (0, HKV, E), (0, HKV, E), (HQ,)]
    assert grads[3].dtype == sinks.dtype
    assert not np.any(reference.to_numpy(grads[3]))
    # the sinks' gradient keeps their dtype (it is summed in float32 where there are sequences)
    half = np.ones(HQ, dtype=np.float16)
    q32, k32, v32, g32 = _arrays(sdpa_array.testing.get_backend("numpy"), "float32", [0], [0])
    vjp = sdpa_array.scaled_dot_product_attention_varlen_vjp
    assert vjp(q32, k32, v32, g32, [0], enable_gqa=True, sinks=half)[3].dtype == np.float16


def test_torch_autograd_reaches_every_input(torch_backend):
    torch = pytest.importorskip("torch")
    q, k, v, g = _arrays(torch_backend, "float64", CU_Q, CU_K)
    sinks = torch_backend.asarray(np.array([0.5, -1.0, 2.0, 0.0]), "float64")
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
    options = {"is_causal": True, "alignment": "bottom_right", "enable_gqa": True}
    out = sdpa_array.scaled_dot_product_attention_varlen(
        *leaves[:3], CU_Q, CU_K, sinks=leaves[3], **options
    )
    grads = torch.autograd.grad(out, leaves, g)
    assert_varlen_vjp_close_to_oracle(grads, q, k, v, g, CU_Q, CU_K, sinks=sinks, **options)


def test_jax_grad_under_jit_with_host_offsets(jax_backend):
    jax = pytest.importorskip("jax")
    q, k, v, g = _arrays(jax_backend, "float32", CU_Q, CU_K)
    cu_q, cu_k = np.array(CU_Q), np.array(CU_K)
    options = {"is_causal": True, "enable_gqa": True, "softcap": 3.0}

    @jax.jit
    def loss(q, k, v):
        out = sdpa_array.scaled_dot_product_attention_varlen(q, k, v, cu_q, cu_k, **options)
        return (out * g).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_varlen_vjp_close_to_oracle(grads, q, k, v, g, CU_Q, CU_K, **options)

    def traced_offsets(q, cu):
        return sdpa_array.scaled_dot_product_attention_varlen(q, q, q, cu)

    with pytest.raises(TypeError, match="cu_seqlens_q must be known on the host"):
        jax.jit(traced_offsets)(q, jax_backend.asarray(cu_q))


def test_dask_stays_lazy(dask_backend):
    import dask.array as da

    q, k, v, _ = _arrays(dask_backend, "float32", CU_Q, CU_K)
    out, lse = sdpa_array.scaled_dot_product_attention_varlen(
        q, k, v, CU_Q, CU_K, is_causal=True, enable_gqa=True, return_lse=True
    )
    assert isinstance(out, da.Array)
    assert isinstance(lse, da.Array)
    assert_varlen_close_to_oracle(
        (out, lse), q, k, v, CU_Q, CU_K, is_causal=True, enable_gqa=True, return_lse=True
    )
    with pytest.raises(TypeError, match="cu_seqlens_q must be known on the host"):
        sdpa_array.scaled_dot_product_attention_varlen(q, q, q, da.from_array(np.array([0, 16])))


_BLOCK_MASK = sdpa_array.create_block_mask(lambda b, h, i, j: i >= j, None, None, 3, 5)


def _bad(**changes: Any) -> dict[str, Any]:
    base = {"cu_seqlens_q": [0, 3, 16], "cu_seqlens_k": [0, 5, 13], "enable_gqa": True}
    return {**base, **changes}


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (_bad(cu_seqlens_q=[1, 3, 16]), ValueError, "cu_seqlens_q must start at 0"),
        (_bad(cu_seqlens_q=[0, 9, 3, 16]), ValueError, "non-decreasing"),
        (_bad(cu_seqlens_k=[0, 5, 12]), ValueError, r"must end at the key total \(13\)"),
        (_bad(cu_seqlens_k=[0, 13]), ValueError, "count the same sequences, got 2 and 1"),
        (_bad(cu_seqlens_q=np.zeros((2, 2), int)), ValueError, "one-dimensional"),
        (_bad(cu_seqlens_q=np.array([0.0, 16.0])), TypeError, "integer dtype"),
        (_bad(cu_seqlens_q=[0, True, 16]), TypeError, "must hold integers"),
        (_bad(cu_seqlens_q="0,16"), TypeError, "one-dimensional integer array"),
        (_bad(cu_seqlens_k=None), ValueError, "cu_seqlens_k is needed"),
        (_bad(max_seqlen_q=12), ValueError, r"max_seqlen_q=12 is shorter .* \(13\)"),
        (_bad(max_seqlen_k=2.0), TypeError, "max_seqlen_k must be an int"),
        (_bad(mask_mod=_BLOCK_MASK), TypeError, "not a BlockMask"),
        (_bad(enable_gqa=False), ValueError, "heads"),
        (_bad(dropout_p=0.5), ValueError, "dropout_seed"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument_before_any_work(monkeypatch, call, error, match):
    monkeypatch.setattr(varlen_forward, "run_forward", None)  # any work would fail otherwise
    q, k, v, _ = _arrays(sdpa_array.testing.get_backend("numpy"), "float64", [0, 16], [0, 13])
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_varlen(q, k, v, **call)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((16, HQ * E), (13, HKV, E), (13, HKV, E)), r"query of shape \(total, heads, features\)"),
        (((16, HQ, E), (13, HKV, E), (12, HKV, E)), "same number of tokens"),
    ],
)
def test_bad_layouts_name_the_array(shapes, match):
    q, k, v = (np.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        sdpa_array.scaled_dot_product_attention_varlen(q, k, v, [0, 16], [0, 13])


def test_bad_cotangent_names_grad_output():
    q, k, v, g = _arrays(sdpa_array.testing.get_backend("numpy"), "float64", CU_Q, CU_K)
    vjp = sdpa_array.scaled_dot_product_attention_varlen_vjp
    with pytest.raises(ValueError, match=r"grad_output has shape \(15, 4, 8\).*\(16, 4, 8\)"):
        vjp(q, k, v, g[1:], CU_Q, CU_K, enable_gqa=True)
    with pytest.raises(TypeError, match="grad_output must have the output's dtype"):
        vjp(q, k, v, g.astype(np.float32), CU_Q, CU_K, enable_gqa=True)
