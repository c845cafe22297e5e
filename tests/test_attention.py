"""Shapes and combined features against the float64 oracle on every path, and the edge cases
of any call.

Each feature alone has a file of its own (``test_mask_bias``, ``test_causal_window``,
``test_softcap``, ``test_scale``, ``test_gqa``, ``test_sinks``, ``test_sequences``,
``test_dropout``, ``test_mask_mods``, ``test_layout``), each running its cases on every path
of :mod:`tests.paths`. This file runs the same way the shapes (no heads axis, ``L != S``,
``Ev != E``, broadcast batch axes) and features combined, and checks on every backend and
dtype what any call must do: rows fully masked or excluded whole, empty lengths, large
logits, the packing of the return values, the Theory page's worked example, arrays on
a non-default device.
"""

from __future__ import annotations

import math

import array_api_compat
import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from tests.helpers import (
    KV,
    KV_EV,
    Q_GQA,
    Q,
    assert_array_like,
    check_against_oracle,
)
from tests.paths import FeatureCase, check_on_path, random_mask, random_normal

#: The implementations the edge cases below run on every backend; ``"native"`` runs them
#: where it delegates.
IMPLEMENTATIONS = ["auto", "materialized", "blocked"]

#: The reasons native kernels give for refusing a case (``FeatureCase.native``).
NEEDS_EV_EQ_E = "Ev == E"
SOFTCAP = "softcap"


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


# Shapes other than the shared ``Q``, ``KV`` only where the shapes are the point (no heads
# axis, broadcast batch axes); features combined as models combine them.
PATH_CASES = [
    FeatureCase("plain", Q, KV, KV, native=True),
    FeatureCase("no-heads-2d", (6, 4), (9, 4), (9, 3), native=NEEDS_EV_EQ_E),
    FeatureCase("L!=S,Ev!=E", Q, KV, KV_EV, native=NEEDS_EV_EQ_E),
    FeatureCase("broadcast-batch", (3, 1, 5, 4), (1, 2, 6, 4), (2, 6, 7), native=NEEDS_EV_EQ_E),
    FeatureCase(
        "gqa+mask+bias+causal+softcap",
        Q_GQA,
        KV,
        KV,
        {
            "enable_gqa": True,
            "is_causal": True,
            "alignment": "bottom_right",
            "softcap": 5.0,
            "mask": random_mask(4, 6, 7, seed=1),
            "bias": random_normal(1, 4, 1, 7, seed=1),
        },
        native=SOFTCAP,
    ),
    FeatureCase(
        "everything",
        Q_GQA,
        (2, 1, 7, 4),
        (2, 1, 7, 3),
        {
            "enable_gqa": True,
            "window": (4, 2),
            "is_causal": True,
            "softcap": 3.0,
            "scale": 0.5,
            "alignment": "bottom_right",
            "mask": random_mask(2, 1, 6, 7, seed=2),
            "bias": random_normal(4, 6, 7, seed=2),
        },
        native=SOFTCAP,
    ),
]


# on JAX and Dask in `nox -s tests-slow`
@pytest.mark.slow_on("jax", "dask")
def test_on_every_path(path_case):
    check_on_path(path_case)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_masked_rows_are_zero_not_nan(backend_dtype, implementation):
    backend, dtype = backend_dtype
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, 2, 5, 4), randn(rng, 2, 6, 4), randn(rng, 2, 6, 3)
    mask = rng.random((2, 5, 6)) > 0.5
    mask[0, 1] = False  # excluded by the mask
    bias = randn(rng, 2, 5, 6)
    bias[1, 3] = -np.inf  # excluded by the bias
    out, weights, lse = check_against_oracle(
        backend, dtype, q, k, v, mask=mask, bias=bias, implementation=implementation
    )
    for row in ((0, 1), (1, 3)):
        assert np.all(reference.to_numpy(out)[row] == 0)
        assert np.all(reference.to_numpy(weights)[row] == 0)
        assert reference.to_numpy(lse)[row] == -np.inf


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_window_and_causal_exclude_whole_rows(backend_dtype, implementation):
    # bottom_right with L > S: the first L - S queries have their diagonal before key 0.
    backend, dtype = backend_dtype
    rng = np.random.default_rng(2)
    out, _, lse = check_against_oracle(
        backend,
        dtype,
        randn(rng, 1, 7, 4),
        randn(rng, 1, 3, 4),
        randn(rng, 1, 3, 2),
        is_causal=True,
        alignment="bottom_right",
        implementation=implementation,
    )
    assert np.all(reference.to_numpy(out)[0, :4] == 0)
    assert np.all(reference.to_numpy(lse)[0, :4] == -np.inf)


def _check_empty_lengths(backend, dtype, implementation, L, S, Ev=3):
    rng = np.random.default_rng(3)
    out, weights, lse = check_against_oracle(
        backend,
        dtype,
        randn(rng, 2, L, 4),
        randn(rng, 2, S, 4),
        randn(rng, 2, S, Ev),
        implementation=implementation,
    )
    assert tuple(out.shape) == (2, L, Ev)
    assert tuple(weights.shape) == (2, L, S)
    if S == 0:
        assert np.all(reference.to_numpy(out) == 0)
        assert np.all(reference.to_numpy(lse) == -np.inf)


@pytest.mark.parametrize(("L", "S"), [(0, 5), (4, 0), (0, 0)])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_lengths(backend_dtype, implementation, L, S):
    _check_empty_lengths(*backend_dtype, implementation, L, S)


@pytest.mark.parametrize(("L", "S"), [(0, 5), (4, 0), (0, 0)])
def test_empty_lengths_native(native_lse_backend_dtype, L, S):
    # Ev == E: torch's kernels that return the log-sum-exp need it (test_native.py)
    _check_empty_lengths(*native_lse_backend_dtype, "native", L, S, Ev=4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_large_logits_do_not_overflow(backend_dtype, implementation):
    # Scores in the thousands: float16 itself overflows at 65504 (and exp at ~11), so this
    # only works if scores, softmax and accumulation run in float32.
    backend, dtype = backend_dtype
    rng = np.random.default_rng(4)
    q = randn(rng, 2, 6, 16) * 40.0
    k = randn(rng, 2, 9, 16) * 40.0
    v = randn(rng, 2, 9, 4)
    out, _, lse = check_against_oracle(
        backend, dtype, q, k, v, scale=1.0, implementation=implementation
    )
    assert np.abs(reference.to_numpy(lse)).max() > 1000.0
    assert np.isfinite(reference.to_numpy(out)).all()


#: Calls in which some rows admit exactly one key: ``(id, (L, S), options, {row: key})``.
ONE_KEY_CASES = [
    ("L=S=1", (1, 1), {}, {0: 0}),
    ("S=1", (5, 1), {}, dict.fromkeys(range(5), 0)),
    ("causal-first-row", (9, 9), {"is_causal": True}, {0: 0}),
    ("window-0", (9, 9), {"window": (0, 0)}, {i: i for i in range(9)}),
    (
        "window-0-bottom-right",
        (6, 9),
        {"window": (0, 0), "alignment": "bottom_right"},
        {i: i + 3 for i in range(6)},
    ),
]

#: The one-key cases that every native kernel computes (no window, top-left).
NATIVE_ONE_KEY_CASES = [c for c in ONE_KEY_CASES if "window" not in c[2]]


def _check_one_key_rows(backend, dtype, implementation, case, magnitude, **call):
    """Each row admitting one key returns that key's value bit for bit."""
    _, (L, S), options, rows = case
    rng = np.random.default_rng(7)
    q, k = (
        backend.asarray(randn(rng, 2, 3, L, 8), dtype),
        backend.asarray(randn(rng, 2, 3, S, 8), dtype),
    )
    v = backend.asarray(randn(rng, 2, 3, S, 8) * magnitude, dtype)
    out = sdpa_array.scaled_dot_product_attention(
        q, k, v, implementation=implementation, **options, **call
    )
    out, v = reference.to_numpy(out), reference.to_numpy(v)
    for row, key in rows.items():
        np.testing.assert_array_equal(out[..., row, :], v[..., key, :], err_msg=f"row {row}")


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("case", ONE_KEY_CASES, ids=[c[0] for c in ONE_KEY_CASES])
@pytest.mark.parametrize(
    ("implementation", "call"),
    [(i, {}) for i in IMPLEMENTATIONS] + [("blocked", {"block_q": 3, "block_k": 4})],
    ids=[*IMPLEMENTATIONS, "blocked-3x4"],
)
def test_one_admissible_key_gives_its_value_exactly(
    backend_dtype, implementation, call, case, magnitude
):
    """A row whose softmax has one admissible key weighs it by exactly 1, on every path
    (the blocked kernel's fixed reference too: such rows take a running maximum)."""
    _check_one_key_rows(*backend_dtype, implementation, case, magnitude, **call)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("case", NATIVE_ONE_KEY_CASES, ids=[c[0] for c in NATIVE_ONE_KEY_CASES])
def test_one_admissible_key_gives_its_value_exactly_native(native_backend_dtype, case, magnitude):
    _check_one_key_rows(*native_backend_dtype, "native", case, magnitude)


def _nan_score_mod(s, b, h, i, j):
    """NaN for every score of query 1 (of the first head), the scores elsewhere."""
    xp = array_api_compat.array_namespace(s)
    nan = xp.asarray(math.nan, dtype=s.dtype, device=array_api_compat.device(s))
    return xp.where(xp.logical_and(i == 1, h == 0), nan, s)


#: Where a NaN enters the scores: ``(id, options)``, and which ``(batch, head, row)`` come
#: out NaN (every other row finite). The query and key change in ``_nan_call``.
NAN_SOURCES = {
    "query": ({}, [(0, 0, 1)]),
    "key": ({}, [(0, 0, r) for r in range(4)]),
    "causal-key-0": ({"is_causal": True}, [(0, 0, r) for r in range(4)]),
    "bias-column": (
        {"bias": "nan-column"},
        [(b, h, r) for b in (0, 1) for h in (0, 1) for r in range(4)],
    ),
    "score_mod": ({"score_mod": _nan_score_mod}, [(b, 0, 1) for b in (0, 1)]),
}


def _nan_call(backend, dtype, source, S, **call):
    """The call's output and log-sum-exp with a NaN from ``source`` (:data:`NAN_SOURCES`)."""
    options, _ = NAN_SOURCES[source]
    rng = np.random.default_rng(8)
    q, k, v = randn(rng, 2, 2, 4, 8), randn(rng, 2, 2, S, 8), randn(rng, 2, 2, S, 8)
    if source == "query":
        q[0, 0, 1, 3] = np.nan
    if source == "key":
        k[0, 0, 2, 3] = np.nan
    if source == "causal-key-0":
        k[0, 0, 0, 3] = np.nan
    options = dict(options)
    if options.get("bias") == "nan-column":
        bias = np.zeros((4, S))
        bias[:, 2] = np.nan
        options["bias"] = backend.asarray(bias, dtype)
    q, k, v = (backend.asarray(x, dtype) for x in (q, k, v))
    return sdpa_array.scaled_dot_product_attention(q, k, v, **options, **call)


def _check_nan_rows(source, out, lse=None):
    rows = np.zeros((2, 2, 4), dtype=bool)
    for index in NAN_SOURCES[source][1]:
        rows[index] = True
    out = reference.to_numpy(out)
    assert np.isnan(out[rows]).all(), "a row with a NaN score must come out NaN"
    assert np.isfinite(out[~rows]).all()
    if lse is not None:
        lse = reference.to_numpy(lse)
        assert np.isnan(lse[rows]).all(), "the log-sum-exp must be NaN where the output is"
        assert np.isfinite(lse[~rows]).all()


@pytest.mark.parametrize("source", list(NAN_SOURCES))
@pytest.mark.parametrize(
    ("implementation", "call"),
    [(i, {}) for i in IMPLEMENTATIONS] + [("blocked", {"block_q": 3, "block_k": 2})],
    ids=[*IMPLEMENTATIONS, "blocked-3x2"],
)
def test_nan_scores_give_nan_output_and_lse(backend_dtype, implementation, call, source):
    """A row with a NaN score (from the query, a key, a bias column or a score function)
    returns NaN in its output and its log-sum-exp, not the ``-inf`` of a row without an
    admissible key; with and without the log-sum-exp asked for."""
    backend, dtype = backend_dtype
    for S in (5, 16):
        out, lse = _nan_call(
            backend, dtype, source, S, return_lse=True, implementation=implementation, **call
        )
        _check_nan_rows(source, out, lse)
        _check_nan_rows(
            source, _nan_call(backend, dtype, source, S, implementation=implementation, **call)
        )


@pytest.mark.parametrize("source", [s for s in NAN_SOURCES if s != "score_mod"])
def test_nan_scores_give_nan_output_and_lse_native(native_lse_backend_dtype, source):
    """The native kernels too (torch's give zeros for a row whose scores are all NaN at
    some key lengths, 5 and 8, and NaN at others)."""
    backend, dtype = native_lse_backend_dtype
    for S in (5, 8, 16, 40):  # torch fixes its rows up to 31 float32 keys (_may_drop_nan)
        out, lse = _nan_call(backend, dtype, source, S, return_lse=True, implementation="native")
        _check_nan_rows(source, out, lse)
        # the output-only kernel (and its direct call)
        _check_nan_rows(source, _nan_call(backend, dtype, source, S, implementation="native"))


def test_return_value_packing(backend):
    rng = np.random.default_rng(5)
    q, k, v = (backend.asarray(randn(rng, 3, 4, 2), "float32") for _ in range(3))
    out = sdpa_array.scaled_dot_product_attention(q, k, v)
    assert_array_like(out, q, shape=(3, 4, 2), dtype=q.dtype)
    pair = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert isinstance(pair, tuple)
    assert len(pair) == 2
    assert tuple(pair[1].shape) == (3, 4)
    pair = sdpa_array.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert len(pair) == 2
    assert tuple(pair[1].shape) == (3, 4, 4)
    triple = sdpa_array.scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True)
    assert [tuple(t.shape) for t in triple] == [(3, 4, 2), (3, 4, 4), (3, 4)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_worked_example_of_the_theory_page(backend, dtype):
    """Q = [[1,2],[3,4]], K = [[5,6],[7,8],[9,10]], V = [[1,0,1],[0,1,0],[1,1,0]], d_k = 2.

    Hand-computed figures read ``[[0.984, 1.000, 0.0002], [0.9999, 0.9999, 0.0001]]``; the
    exact values below (softmax of ``Q Kᵀ / sqrt(2)`` written out in closed form) differ from
    that rounding in several places: e.g. row 0 col 0 is 0.98584 and row 1 col 2 is 2.5e-9,
    not 1e-4.
    """
    scores = [[17.0, 23.0, 29.0], [39.0, 53.0, 67.0]]
    expected = []
    for row in scores:
        e = [math.exp((s - max(row)) / math.sqrt(2.0)) for s in row]
        p = [x / sum(e) for x in e]
        expected.append([p[0] + p[2], p[1] + p[2], p[0]])
    q = backend.asarray(np.array([[1.0, 2.0], [3.0, 4.0]]), dtype)
    k = backend.asarray(np.array([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]), dtype)
    v = backend.asarray(np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]), dtype)
    out = reference.to_numpy(sdpa_array.scaled_dot_product_attention(q, k, v))
    np.testing.assert_allclose(out, np.array(expected), atol=1e-6, rtol=0)
    np.testing.assert_allclose(
        out,
        [[0.985837, 0.999796, 0.000204], [0.999950, 1.000000, 0.0000000025]],
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_results_stay_on_a_non_default_device(implementation):
    """array-api-strict refuses to mix devices, so any array created on the wrong one fails."""
    xp = pytest.importorskip("array_api_strict")
    dev = xp.Device("device1")
    rng = np.random.default_rng(6)

    def put(a, dtype=xp.float32):
        return xp.asarray(a, dtype=dtype, device=dev)

    q, k, v = put(randn(rng, 2, 5, 4)), put(randn(rng, 2, 7, 4)), put(randn(rng, 2, 7, 3))
    mask = put(rng.random((5, 7)) > 0.2, dtype=xp.bool)
    for options in ({}, {"is_causal": True, "window": (2, 1), "alignment": "bottom_right"}):
        out, weights, lse = sdpa_array.scaled_dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            bias=put(randn(rng, 5, 7)),
            softcap=4.0,
            return_weights=True,
            return_lse=True,
            implementation=implementation,
            **options,
        )
        assert out.device == weights.device == lse.device == dev
    empty = sdpa_array.scaled_dot_product_attention(
        q, k[:, :0, :], v[:, :0, :], return_lse=True, implementation=implementation
    )
    assert empty[0].device == empty[1].device == dev
