"""Property-based tests: random shapes, masks, windows, GQA, alignments and dtypes vs the oracle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from sdpa_array import CannotDelegateError, reference
from tests.helpers import UNIT_ROUNDOFF, check_against_oracle, compute_dtype
from tests.libraries import NATIVE_LIBRARIES, SHAPE_COMPILING_LIBRARIES
from tests.test_attention import IMPLEMENTATIONS

side = st.one_of(st.none(), st.integers(0, 6))


@dataclass(frozen=True)
class Sizes:
    """Where the random calls draw each size from."""

    outer: st.SearchStrategy[tuple[int, ...]]
    heads_kv: st.SearchStrategy[int]
    groups: st.SearchStrategy[int]
    lengths: st.SearchStrategy[tuple[int, int]]
    features: st.SearchStrategy[tuple[int, int]]


#: Any small size: the default.
ANY_SIZES = Sizes(
    outer=st.lists(st.integers(1, 2), max_size=2).map(tuple),
    heads_kv=st.integers(1, 3),
    groups=st.integers(1, 3),
    lengths=st.tuples(st.integers(0, 9), st.integers(0, 9)),
    features=st.tuples(st.integers(1, 8), st.integers(1, 5)),
)

#: A few sizes of each kind, for libraries that compile every operation anew for each new
#: shape (``SHAPE_COMPILING_LIBRARIES``): the calls share shapes, and so compilations, with
#: each other and with the fixed cases of the other test files (``Q``, ``KV`` of
#: ``tests/helpers.py``). Every kind of call still occurs: no heads axis, broadcast batch
#: axes, GQA, ``L < S``, ``L > S``, ``L == S``, empty lengths, ``Ev != E``.
FEW_SIZES = Sizes(
    outer=st.sampled_from([(), (2,)]),
    heads_kv=st.sampled_from([1, 2]),
    groups=st.just(2),
    lengths=st.sampled_from([(6, 7), (7, 6), (7, 7), (0, 7), (6, 0)]),
    features=st.sampled_from([(4, 4), (4, 3)]),
)


@st.composite
def attention_calls(
    draw: st.DrawFn,
    dtypes: tuple[str, ...],
    implementations: tuple[str, ...],
    sizes: Sizes = ANY_SIZES,
) -> dict:
    gqa = draw(st.booleans())
    outer = draw(sizes.outer)
    heads_kv = draw(sizes.heads_kv)
    groups = draw(sizes.groups) if gqa else 1
    with_heads = gqa or draw(st.booleans())
    L, S = draw(sizes.lengths)
    E, Ev = draw(sizes.features)
    heads_q = heads_kv * groups
    q_batch = (*outer, heads_q) if with_heads else outer
    kv_batch = (*outer, heads_kv) if with_heads else outer
    if draw(st.booleans()) and kv_batch:
        kv_batch = (1,) * (len(kv_batch) - 1) + kv_batch[-1:]  # broadcast the key's batch
    score_shape = (*q_batch, L, S)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    call = {
        "dtype": draw(st.sampled_from(dtypes)),
        "implementation": draw(st.sampled_from(implementations)),
        "q": rng.standard_normal((*q_batch, L, E)) * draw(st.sampled_from([0.5, 1.0, 4.0])),
        "k": rng.standard_normal((*kv_batch, S, E)),
        "v": rng.standard_normal((*kv_batch, S, Ev)),
        "enable_gqa": gqa,
        "is_causal": draw(st.booleans()),
        "alignment": draw(st.sampled_from(["top_left", "bottom_right"])),
    }
    if draw(st.booleans()):
        call["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        call["softcap"] = draw(st.floats(0.5, 20.0))
    if draw(st.booleans()):
        call["scale"] = draw(st.floats(0.05, 2.0))
    mask_kind = draw(st.sampled_from(["none", "full", "keys-only", "sparse"]))
    if mask_kind == "full":
        call["mask"] = rng.random(score_shape) > 0.3
    elif mask_kind == "keys-only":  # a padding mask: (S,) broadcast over queries and heads
        call["mask"] = rng.random((S,)) > 0.3
    elif mask_kind == "sparse":  # mostly excluded: many fully-masked rows
        call["mask"] = rng.random((L, S)) > 0.85
    if draw(st.booleans()):
        bias = rng.standard_normal((L, S) if draw(st.booleans()) else score_shape)
        bias[rng.random(bias.shape) > 0.8] = -np.inf
        call["bias"] = bias
    return call


def _check_random_call(backend, data, sizes: Sizes) -> None:
    # "native" where the library has a native kernel (elsewhere it always refuses:
    # tests/test_native.py checks that)
    native = ("native",) if backend.library in NATIVE_LIBRARIES else ()
    call = data.draw(attention_calls(backend.dtypes, (*IMPLEMENTATIONS, *native), sizes))
    dtype = call.pop("dtype")
    q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
    try:
        out, weights, lse = check_against_oracle(backend, dtype, q, k, v, **call)
    except CannotDelegateError:
        # "native" refuses calls no native kernel computes exactly (softcap, Ev != E with
        # the log-sum-exp, ...) with its documented error, before any work; "auto" must
        # then still answer.
        assert call["implementation"] == "native"
        event("native refused; checked auto instead")
        call["implementation"] = "auto"
        out, weights, lse = check_against_oracle(backend, dtype, q, k, v, **call)
    # Rows with no admissible key are exact zeros with lse -inf; all others sum to one.
    w = reference.to_numpy(weights).astype(np.float64)
    empty = reference.to_numpy(lse) == -np.inf
    assert np.all(w[empty] == 0)
    assert np.all(reference.to_numpy(out)[empty] == 0)
    # Each weight is rounded to the output dtype (u_o each) after a softmax accurate to
    # (2 S + 6) u_c: their sum is within S u_o + (2 S + 6) u_c of one.
    S = w.shape[-1]
    tol = S * UNIT_ROUNDOFF[dtype] + (2 * S + 6) * UNIT_ROUNDOFF[compute_dtype(dtype)]
    np.testing.assert_allclose(w[~empty].sum(axis=-1), 1.0, atol=tol)


@pytest.mark.slow_on("jax", "dask")  # random shapes: a compilation or a graph per example
@given(data=st.data())
def test_random_calls_match_oracle(backend, data):
    """Random calls; on libraries that compile per shape, with sizes from a few."""
    few = backend.library in SHAPE_COMPILING_LIBRARIES
    _check_random_call(backend, data, FEW_SIZES if few else ANY_SIZES)


@pytest.mark.slow
@given(data=st.data())
def test_random_sizes_match_oracle(shape_compiling_backend, data):
    """Random calls of any small size on the libraries that compile every new shape."""
    _check_random_call(shape_compiling_backend, data, ANY_SIZES)
