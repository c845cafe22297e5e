"""The fixed softmax reference of the blocked forward kernel (``_kernels/score_bound.py``).

* when it is taken: bounded scores and values on a library whose values can be read, and
  not where a score may exceed ``T`` (large logits, a large sink, a soft-cap above ``T``),
  where the values would lose digits (huge or tiny entries), where the terms are unknown (a
  bias or a caller's function), where nothing can be read (NaN, a JAX tracer, a lazy Dask
  array), nor with the maximum scores;
* both paths of the forward kernel, the fixed reference and the online softmax, and both
  softmaxes of the backward kernel's tiles that hold whole rows, against the oracle on every
  backend and dtype with the options that change the softmax (causal, a mask with empty
  rows, sinks, dropout, GQA, lengths).
"""

from __future__ import annotations

import math
import time
import types

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_array
from sdpa_array._arrays import inplace
from sdpa_array._kernels import blocked, score_bound, vjp_blocked
from sdpa_array._kernels.operands import prepare
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import Inputs, validate
from tests.helpers import check_against_oracle, check_vjp_against_oracle

pytestmark = pytest.mark.slow_on("jax", "dask")


def _decision(q, k, v, **options) -> bool:
    p = validate(q, k, v, Options(**options))
    x = Inputs(q, k, v, bias=options.get("bias"), sinks=options.get("sinks"))
    return score_bound.fixed_reference(p, prepare(p, x))


def _unit(shape=(1, 2, 16, 8), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]


def test_limit_follows_the_dtype():
    q, k, v = _unit()
    p = validate(q, k, v, Options())
    assert score_bound.exponent_limit(p) == pytest.approx(math.log(np.finfo(np.float32).max) / 4)
    p64 = validate(*(a.astype(np.float64) for a in (q, k, v)), Options())
    assert score_bound.exponent_limit(p64) == pytest.approx(709.78 / 4, rel=1e-4)


def test_taken_for_bounded_scores():
    q, k, v = _unit()
    assert _decision(q, k, v)
    assert _decision(q, k, v, is_causal=True, sinks=np.ones(2, np.float32))
    # a soft-cap bounds every score whatever the products
    assert _decision(q * 100, k * 100, v, softcap=20.0)


def _with(v: np.ndarray, *values: float) -> np.ndarray:
    """``v`` with its first entries set to ``values``."""
    v = v.copy()
    v.reshape(-1)[: len(values)] = values
    return v


def test_zeros_among_the_values_keep_it():
    """Zeros keep their digits under any weight: values with zeros (padding, ReLU outputs)
    are bounded like the same values without them; only a non-zero tiny one refuses."""
    q, k, v = _unit()
    assert _decision(q, k, _with(v, 0.0, 0.0))
    assert _decision(q, k, np.zeros_like(v))
    assert _decision(q, k, _with(v, 0.0, 1e-20))  # above the float32 limit, about 4.4e-22
    assert not _decision(q, k, _with(v, 0.0, -1e-23))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda q, k, v, o: (q * 31.6, k * 31.6, v, o), id="large-logits"),
        pytest.param(lambda q, k, v, o: (q * 100, k * 100, v, {"softcap": 30.0}), id="softcap>T"),
        pytest.param(
            lambda q, k, v, o: (q, k, v, {"sinks": np.array([1.0, 30.0], np.float32)}),
            id="large-sink",
        ),
        pytest.param(lambda q, k, v, o: (q, k, v * 1e32, o), id="huge-values"),
        pytest.param(lambda q, k, v, o: (q, k, v * 1e-30, o), id="tiny-values"),
        pytest.param(lambda q, k, v, o: (q, k, _with(v, 0.0, 1e-30), o), id="zero+tiny-value"),
        pytest.param(
            lambda q, k, v, o: (np.where(q > 2, np.nan, q).astype(np.float32), k, v, o), id="nan"
        ),
        pytest.param(
            lambda q, k, v, o: (q, k, v, {"bias": np.zeros((16, 16), np.float32)}), id="bias"
        ),
        pytest.param(
            lambda q, k, v, o: (q, k, v, {"bias_mod": sdpa_array.mods.alibi(np.ones(2))}),
            id="bias_mod",
        ),
        pytest.param(
            lambda q, k, v, o: (q, k, v, {"score_mod": sdpa_array.mods.tanh_softcap(5.0)}),
            id="score_mod",
        ),
    ],
)
def test_refused(change):
    q, k, v, options = change(*_unit(), {})
    assert not _decision(q, k, v, **options)


def test_tiny_rows_do_not_hide_large_scores():
    """``‖q‖²`` of entries 1e-23 underflows to 0 in float32; the bound must not (scores here
    reach about 2e6 through a scale of 1e10)."""
    rng = np.random.default_rng(0)
    q = np.full((1, 1, 8, 4), 1e-23, np.float32)
    k = (np.sign(rng.standard_normal((1, 1, 8, 4))) * 5e18).astype(np.float32)
    v = rng.standard_normal((1, 1, 8, 3)).astype(np.float32)
    assert not _decision(q, k, v, scale=1e10)
    assert not _decision(k, q, v, scale=1e10)
    out = sdpa_array.scaled_dot_product_attention(q, k, v, scale=1e10, implementation="blocked")
    assert np.isfinite(out).all()


@settings(max_examples=60, deadline=None)
@given(
    exponent=st.integers(-45, 36),  # float32 holds 1e36 times a normal draw
    features=st.integers(1, 300),
    dtype=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**16),
)
def test_norm_bound_holds(exponent, features, dtype, seed):
    """``_largest_norm`` (``vecdot`` in the array's dtype) is never below the largest row
    norm computed in extended precision, for entries from subnormal to near overflow
    (divided by the largest first, without a warning), and is tight: within its own
    growth ``(1 + 2 E eps)`` and ``sqrt(E · smallest normal)``."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 5, features)) * 10.0**exponent).astype(dtype)
    p = validate(x, x, x, Options())
    got = score_bound._largest_norm(p, x)
    wide = x.astype(np.longdouble)
    true = float(np.sqrt(np.max(np.sum(wide * wide, axis=-1))))
    finfo = np.finfo(dtype)
    assert got >= true
    slack = math.sqrt(features * float(finfo.smallest_normal))
    assert got <= true * math.sqrt(1 + 4 * features * float(finfo.eps)) + slack


@pytest.mark.parametrize(
    "options",
    [{}, {"scale": 0.3}, {"softcap": 2.5}, {"scale": 0.3, "softcap": 2.5}],
    ids=["scale-in-query", "scale-on-tiles", "softcap", "scale-and-softcap"],
)
def test_scores_in_base2(options):
    """The operands whose scores come out times ``log2(e)`` (what the fixed reference's
    forward takes ``exp2`` of): the query carries the factor where it carries the scale,
    the terms otherwise; the scores are the natural ones times ``log2(e)`` within a few
    roundings, and their ``exp2`` is the natural ``exp``. A bias cannot carry it."""
    from sdpa_array._kernels.operands import tile_scores
    from sdpa_array._kernels.score_terms import LOG2E

    q, k, v = _unit((1, 2, 16, 16))
    p = validate(q, k, v, Options(**options))
    ops = prepare(p, Inputs(q, k, v))
    base2 = ops.in_base2()
    rows, cols = slice(0, 16), slice(0, 16)
    natural, _ = tile_scores(p, ops, ops.q, rows, cols)
    scores, _ = tile_scores(p, base2, base2.q, rows, cols)
    u = float(np.finfo(np.float32).eps) / 2
    # the product's own error is the same on both sides; the factor adds at most 3 roundings
    # of the query or the score, relative to |q| |k| |scale| log2(e)
    bound = (16 + 6) * u * LOG2E * np.abs(ops.q) @ np.swapaxes(np.abs(ops.k), -1, -2)
    bound *= abs(options.get("scale", 1.0)) if "scale" in options else 1.0
    np.testing.assert_array_less(np.abs(scores - natural * LOG2E), bound + 1e-30)
    weights = base2.terms.exp(p.xp, scores.copy())
    np.testing.assert_allclose(weights, np.exp(natural), rtol=64 * u)
    with_bias = prepare(p, Inputs(q, k, v, bias=np.zeros((16, 16), np.float32)))
    with pytest.raises(ValueError, match="only the scale and the soft-cap"):
        with_bias.in_base2()


@pytest.mark.parametrize(
    "shapes",
    [((1, 1, 64, 4), (1, 1, 64, 4), (1, 1, 64, 0)), ((0, 2, 64, 4),) * 3],
    ids=["no-value-features", "empty-batch"],
)
def test_empty_operands(shapes):
    """Nothing to bound: refused, and the calls give their empty results."""
    q, k, v = (np.ones(s, np.float32) for s in shapes)
    assert not _decision(q, k, v)
    out = sdpa_array.scaled_dot_product_attention(q, k, v, implementation="blocked")
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, v, np.ones_like(out), implementation="blocked"
    )
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]


def test_refused_where_values_cannot_be_read():
    jax = pytest.importorskip("jax")
    q, k, v = (jax.numpy.asarray(a) for a in _unit())
    assert _decision(q, k, v)  # eager arrays are read
    seen = []

    def traced(q, k, v):
        seen.append(_decision(q, k, v))
        return q

    jax.jit(traced)(q, k, v)
    assert seen == [False]


def test_refused_for_lazy_dask_arrays():
    da = pytest.importorskip("dask.array")
    q, k, v = (da.from_array(a, chunks=8) for a in _unit())
    assert not _decision(q, k, v)


def test_taken_with_max_scores_too(monkeypatch):
    """Asking for the maximum scores keeps the fixed reference (the scores' maxima are
    read beside it), with the same output as the call without them."""
    calls = []
    real = blocked.fixed_reference
    monkeypatch.setattr(
        blocked,
        "fixed_reference",
        lambda p, ops, bound=None: calls.append(1) or real(p, ops, bound),
    )
    q, k, v = _unit()
    out, _ = sdpa_array.scaled_dot_product_attention(
        q, k, v, implementation="blocked", return_max_scores=True
    )
    assert calls == [1]
    plain = sdpa_array.scaled_dot_product_attention(q, k, v, implementation="blocked")
    np.testing.assert_array_equal(out, plain)


def _mask(L, S):
    mask = np.random.default_rng(3).random((L, S)) > 0.4
    mask[1] = False  # a row without keys: zero output, -inf log-sum-exp
    return mask


CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"is_causal": True}, id="causal"),
    pytest.param({"mask": "rows"}, id="empty-rows"),
    pytest.param({"sinks": np.array([0.5, -1.0, 2.0, 0.0])}, id="sinks"),
    pytest.param({"mask": "rows", "sinks": np.array([0.5, -1.0, 2.0, 0.0])}, id="rows+sinks"),
    pytest.param({"dropout_p": 0.3, "dropout_seed": 5}, id="dropout"),
    pytest.param({"softcap": 3.0, "is_causal": True}, id="softcap"),
    pytest.param({"query_lengths": [9, 4], "key_lengths": [11, 0]}, id="lengths"),
]


def _forced(monkeypatch, module, fixed: bool) -> list[bool]:
    """Make ``module``'s kernel take (``fixed``) or not take the fixed reference; the list
    records what :func:`score_bound.fixed_reference` decided for each call."""
    decided: list[bool] = []

    def forced(p, ops, bound=None):
        decided.append(score_bound.fixed_reference(p, ops, bound))
        return fixed

    monkeypatch.setattr(module, "fixed_reference", forced)
    return decided


def _run_options(backend, dtype, options, L, S) -> dict:
    """The case's options as arrays of ``backend`` (the mask with an empty row)."""
    run = dict(options)
    if run.get("mask") == "rows":
        run["mask"] = _mask(L, S)
    if "sinks" in run:
        run["sinks"] = backend.asarray(run["sinks"], dtype)
    for name in ("query_lengths", "key_lengths"):
        if name in run:
            run[name] = backend.asarray(np.asarray(run[name], np.int32))
    return run


def _check_decisions(backend, decided: list[bool]) -> None:
    """On eager CPU arrays the fixed reference is taken by itself, on a lazy Dask graph
    never, and a GPU plan never reads a value on the host (so never decides)."""
    if backend.device != "cpu":
        assert decided == []
        return
    assert decided, "the blocked kernel did not decide its softmax reference"
    library = backend.id.split(":")[0]
    if library in ("numpy", "torch", "strict"):
        assert all(decided)
    if library == "dask":
        assert not any(decided)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "online"])
@pytest.mark.parametrize("options", CASES)
def test_both_paths_against_the_oracle(backend_dtype, options, fixed, monkeypatch):
    """Each forward path, forced, within the oracle's bounds, with small blocks."""
    backend, dtype = backend_dtype
    decided = _forced(monkeypatch, blocked, fixed)
    _check_small_blocks(backend, dtype, options, monkeypatch)
    _check_decisions(backend, decided)


@pytest.mark.parametrize("base2", [True, False], ids=["exp2", "exp"])
@pytest.mark.parametrize("options", CASES)
def test_fixed_path_with_either_exponential(backend_dtype, options, base2, monkeypatch):
    """The fixed reference's softmax with ``exp2`` of the scores times ``log2(e)`` and with
    ``exp`` of the scores (whichever :func:`inplace.exp2_is_faster` finds faster), forced
    on a library that has ``exp2``, within the oracle's bounds."""
    backend, dtype = backend_dtype
    decided = _forced(monkeypatch, blocked, True)
    asked: list[bool] = []

    def chosen(xp, dtype):
        asked.append(inplace.has_exp2(xp))
        return base2 and inplace.has_exp2(xp)

    monkeypatch.setattr(inplace, "exp2_is_faster", chosen)
    _check_small_blocks(backend, dtype, options, monkeypatch)
    _check_decisions(backend, decided)
    if decided and "dropout_p" not in options:  # the kernel asked on every eager call
        assert asked


def _check_small_blocks(backend, dtype, options, monkeypatch) -> None:
    """The blocked forward with blocks of 4 x 3 on 13 x 11 against the oracle."""
    rng = np.random.default_rng(11)
    L, S = 13, 11
    q, k, v = (rng.standard_normal((2, n, L if i == 0 else S, 4)) for i, n in enumerate((4, 2, 2)))
    run = _run_options(backend, dtype, options, L, S)
    original = sdpa_array.scaled_dot_product_attention

    def small_blocks(*args, **kwargs):
        return original(*args, block_q=4, block_k=3, **kwargs)

    monkeypatch.setattr(sdpa_array, "scaled_dot_product_attention", small_blocks)
    check_against_oracle(
        backend,
        dtype,
        q,
        k,
        v,
        implementation="blocked",
        return_weights=False,
        enable_gqa=True,
        **run,
    )


def test_exp2_chosen_where_timed_faster():
    """NumPy's exponential is chosen by timing: a clearly slower candidate is refused, a
    clearly faster one taken; the choice for a dtype is made once; a library without
    ``exp2`` takes ``exp``, one with it (torch, JAX) ``exp2``."""

    def slow(x, out):
        time.sleep(1e-3)
        return np.exp(x, out=out)

    assert not inplace.clearly_faster(slow, np.exp, "float32")
    assert inplace.clearly_faster(np.exp, slow, "float32")
    inplace.numpy_exp2_is_faster.cache_clear()
    numpy = array_api_compat.array_namespace(np.zeros(1))
    first = inplace.exp2_is_faster(numpy, np.float32)
    assert inplace.numpy_exp2_is_faster.cache_info().misses == 1
    assert inplace.exp2_is_faster(numpy, np.dtype("float32")) is first
    assert inplace.numpy_exp2_is_faster.cache_info().misses == 1
    no_exp2 = types.SimpleNamespace(__name__="array_api_strict")
    assert not inplace.exp2_is_faster(no_exp2, np.float32)
    other = types.SimpleNamespace(__name__="array_api_compat.torch", exp2=np.exp2)
    assert inplace.exp2_is_faster(other, np.float32)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "row-maximum"])
@pytest.mark.parametrize("options", CASES)
def test_both_backward_softmaxes_against_the_oracle(backend_dtype, options, fixed, monkeypatch):
    """The blocked VJP's tiles hold whole rows here: each softmax, forced, within the
    oracle's bounds."""
    backend, dtype = backend_dtype
    decided = _forced(monkeypatch, vjp_blocked, fixed)
    rng = np.random.default_rng(12)
    L, S = 13, 11
    q, k, v = (rng.standard_normal((2, n, L if i == 0 else S, 4)) for i, n in enumerate((4, 2, 2)))
    grad = rng.standard_normal((2, 4, L, 4))
    run = _run_options(backend, dtype, options, L, S)
    check_vjp_against_oracle(
        backend, dtype, q, k, v, grad, implementation="blocked", enable_gqa=True, **run
    )
    _check_decisions(backend, decided)


def test_scores_in_base2_in_place_leave_the_callers_arrays():
    """``in_base2(in_place=True)`` (the blocked forward's) multiplies the prepared query,
    its own array, not the caller's: the same query as the copy, the caller's unchanged."""
    q, k, v = _unit((1, 2, 16, 16))
    kept = q.copy()
    p = validate(q, k, v, Options())
    copy = prepare(p, Inputs(q, k, v)).in_base2()
    ops = prepare(p, Inputs(q, k, v))
    assert ops.terms.scale_in_query
    own = ops.q
    in_place = ops.in_base2(in_place=True)
    np.testing.assert_array_equal(in_place.q, copy.q)
    assert np.shares_memory(in_place.q, own)
    np.testing.assert_array_equal(q, kept)
