"""Tests of the float64 NumPy oracle :mod:`sdpa_array.reference`.

The oracle is checked only against things that are independent of it:

* an ``mpmath`` evaluation of the formula at 50 significant digits (worked example);
* a brute-force implementation written with Python floats, ``math.exp`` and explicit loops
  over every batch index, head, query and key (:func:`_brute_force`);
* central finite differences of the forward oracle (for the VJP oracle);
* torch's own float64 attention and autograd, where torch supports the feature.
"""

from __future__ import annotations

import math
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpa_array.reference import (
    scaled_dot_product_attention,
    scaled_dot_product_attention_vjp,
    to_numpy,
)

# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _pick(shape: tuple[int, ...], full_index: tuple[int, ...]) -> tuple[int, ...]:
    """Index into an array of ``shape`` broadcast (NumPy rules) to ``len(full_index)`` axes.

    Axes are right-aligned; an axis of size 1 is always read at 0.
    """
    tail = full_index[len(full_index) - len(shape) :]
    return tuple(0 if n == 1 else i for n, i in zip(shape, tail, strict=True))


def _brute_force(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    is_causal=False,
    window=None,
    alignment="top_left",
    scale=None,
    softcap=None,
    enable_gqa=False,
):
    """Attention with Python floats and explicit loops; returns ``(out, weights, lse)``."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2:]
    q_lead, k_lead, v_lead = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    group = 1
    if enable_gqa:
        group = q_lead[-1] // k_lead[-1]
        # for working out the broadcast batch shape, key/value "have" Hq heads
        k_lead = (*k_lead[:-1], q_lead[-1])
        v_lead = (*v_lead[:-1], q_lead[-1])
    n = max(len(q_lead), len(k_lead), len(v_lead))
    batch = []
    for ax in range(n):
        sizes = [s[ax - n + len(s)] for s in (q_lead, k_lead, v_lead) if ax - n + len(s) >= 0]
        batch.append(max(sizes))
    if scale is None:
        scale = 1.0 / math.sqrt(E)

    out = np.zeros((*batch, L, Ev))
    weights = np.zeros((*batch, L, S))
    lse = np.full((*batch, L), -math.inf)
    for b in np.ndindex(*batch):
        qb = q[_pick(q.shape[:-2], b)]
        kv_b = b
        if enable_gqa:  # query head h reads key/value head h // group
            kv_b = (*b[:-1], b[-1] // group)
        kb = k[_pick(k.shape[:-2], kv_b)]
        vb = v[_pick(v.shape[:-2], kv_b)]
        for i in range(L):
            diag = i if alignment == "top_left" else i + S - L
            scores = {}
            for j in range(S):
                if is_causal and j > diag:
                    continue
                if window is not None:
                    left, right = window
                    if left is not None and j < diag - left:
                        continue
                    if right is not None and j > diag + right:
                        continue
                if mask is not None and not mask[_pick(mask.shape, (*b, i, j))]:
                    continue
                s = sum(float(qb[i, e]) * float(kb[j, e]) for e in range(E)) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                if bias is not None:
                    s += float(bias[_pick(bias.shape, (*b, i, j))])
                if s == -math.inf:
                    continue
                scores[j] = s
            if not scores:
                continue  # zeros and lse = -inf
            m = max(scores.values())
            exps = {j: math.exp(s - m) for j, s in scores.items()}
            total = sum(exps.values())
            for j, e in exps.items():
                weights[(*b, i, j)] = e / total
            for c in range(Ev):
                out[(*b, i, c)] = sum(exps[j] / total * float(vb[j, c]) for j in exps)
            lse[(*b, i)] = m + math.log(total)
    return out, weights, lse


def _check_against_brute_force(q, k, v, **kw):
    got_out, got_w, got_lse = scaled_dot_product_attention(
        q, k, v, return_weights=True, return_lse=True, **kw
    )
    exp_out, exp_w, exp_lse = _brute_force(q, k, v, **kw)
    for got in (got_out, got_w, got_lse):
        assert isinstance(got, np.ndarray)
        assert got.dtype == np.float64
        assert not np.isnan(got).any()
    assert got_out.shape == exp_out.shape
    assert got_w.shape == exp_w.shape
    assert got_lse.shape == exp_lse.shape
    np.testing.assert_allclose(got_out, exp_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got_w, exp_w, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got_lse, exp_lse, rtol=1e-12, atol=1e-12)


def _random_inputs(seed, q_shape, k_shape, v_shape, *, magnitude=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(q_shape) * magnitude
    k = rng.standard_normal(k_shape) * magnitude
    v = rng.standard_normal(v_shape)
    return rng, q, k, v


def _random_bias(rng, shape, p_neg_inf=0.0):
    bias = rng.standard_normal(shape)
    if p_neg_inf:
        bias[rng.random(shape) < p_neg_inf] = -np.inf
    return bias


# --------------------------------------------------------------------------------------
# 1. worked example, exact arithmetic
# --------------------------------------------------------------------------------------

WORKED_Q = [[1, 2], [3, 4]]
WORKED_K = [[5, 6], [7, 8], [9, 10]]
WORKED_V = [[1, 0, 1], [0, 1, 0], [1, 1, 0]]

#: The worked example's output as rounded by hand (the Theory page shows both).
HAND_ROUNDED = [["0.984", "1.000", "0.0002"], ["0.9999", "0.9999", "0.0001"]]


def _mpmath_worked_example():
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(50):
        d_k = 2
        scale = 1 / mpmath.sqrt(d_k)
        result = []
        for q in WORKED_Q:
            scores = [
                scale * sum(mpmath.mpf(a) * b for a, b in zip(q, k, strict=True)) for k in WORKED_K
            ]
            exps = [mpmath.exp(s) for s in scores]  # exact arithmetic: no max shift needed
            total = mpmath.fsum(exps)
            row = [
                mpmath.fsum(exps[j] / total * WORKED_V[j][c] for j in range(len(WORKED_K)))
                for c in range(len(WORKED_V[0]))
            ]
            result.append(row)
    return result


def test_worked_example_matches_mpmath():
    exact = _mpmath_worked_example()
    got = scaled_dot_product_attention(
        np.array(WORKED_Q, dtype=float), np.array(WORKED_K, dtype=float), np.array(WORKED_V)
    )
    expected = np.array([[float(x) for x in row] for row in exact])
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    # The tiny entry must also be right *relatively*, not just below 1e-12.
    assert got[1, 2] == pytest.approx(float(exact[1][2]), rel=1e-10)


def test_worked_example_hand_rounded_figures_are_partly_wrong():
    """Which of the hand-rounded figures are not the correctly rounded values.

    Exact values (50-digit mpmath, rounded here to 12 digits)::

        [[0.985836847178, 0.999796481215, 0.000203518785423],
         [0.99994980249,  0.99999999748,  2.51991649088e-9 ]]

    A hand-rounded figure with ``d`` decimals counts as accurate if it is within half a unit
    of its last place (``0.5 * 10**-d``) of the exact value. Off are:

    * ``[0, 0]``: hand-rounded 0.984, exact 0.98584 (should read 0.986);
    * ``[1, 1]``: hand-rounded 0.9999, exact 0.9999999975 (should read 1.0000);
    * ``[1, 2]``: hand-rounded 0.0001, exact 2.52e-9 (should read 0.0000); it is
      ``exp(-28/sqrt(2)) / (1 + exp(-14/sqrt(2)) + exp(-28/sqrt(2)))``, about 2.5e-9.

    ``[0, 1]`` (1.000), ``[0, 2]`` (0.0002) and ``[1, 0]`` (0.9999, exact 0.999949802)
    are correctly rounded.
    """
    mpmath = pytest.importorskip("mpmath")
    exact = _mpmath_worked_example()
    with mpmath.workdps(50):
        off = set()
        for r, row in enumerate(HAND_ROUNDED):
            for c, text in enumerate(row):
                decimals = len(text.split(".")[1])
                half_ulp = mpmath.mpf(5) / mpmath.mpf(10) ** (decimals + 1)
                if abs(mpmath.mpf(text) - exact[r][c]) > half_ulp:
                    off.add((r, c))
        assert off == {(0, 0), (1, 1), (1, 2)}
        closed_form = mpmath.exp(-28 / mpmath.sqrt(2)) / (
            1 + mpmath.exp(-14 / mpmath.sqrt(2)) + mpmath.exp(-28 / mpmath.sqrt(2))
        )
        assert abs(exact[1][2] - closed_form) < mpmath.mpf(10) ** -45
        assert mpmath.mpf("2.5e-9") < exact[1][2] < mpmath.mpf("2.53e-9")


# --------------------------------------------------------------------------------------
# 2. against brute-force loops
# --------------------------------------------------------------------------------------

#: (id, q shape, k shape, v shape, options); "mask"/"bias" entries name a shape to draw.
BRUTE_CASES = [
    ("plain_2d", (3, 4), (5, 4), (5, 2), {}),
    ("plain_2d_L_gt_S", (5, 3), (2, 3), (2, 3), {}),
    ("heads_batch", (2, 3, 4, 3), (2, 3, 5, 3), (2, 3, 5, 2), {}),
    ("custom_scale", (2, 4, 3), (2, 4, 3), (2, 4, 3), {"scale": 0.37}),
    ("mask_full", (2, 3, 4, 3), (2, 3, 5, 3), (2, 3, 5, 2), {"mask": (2, 3, 4, 5)}),
    ("mask_bcast_LS", (2, 3, 4, 3), (2, 3, 5, 3), (2, 3, 5, 2), {"mask": (4, 5)}),
    ("mask_bcast_H1", (2, 3, 4, 3), (2, 3, 5, 3), (2, 3, 5, 2), {"mask": (2, 1, 4, 5)}),
    ("bias_full", (2, 4, 3), (2, 5, 3), (2, 5, 4), {"bias": (2, 4, 5)}),
    ("bias_bcast_neg_inf", (2, 3, 4, 3), (2, 3, 5, 3), (2, 3, 5, 2), {"bias": (3, 1, 5)}),
    ("mask_and_bias", (2, 4, 3), (2, 5, 3), (2, 5, 2), {"mask": (2, 4, 5), "bias": (4, 5)}),
    ("causal_tl_square", (2, 4, 3), (2, 4, 3), (2, 4, 2), {"is_causal": True}),
    ("causal_tl_L_lt_S", (2, 3, 3), (2, 6, 3), (2, 6, 2), {"is_causal": True}),
    ("causal_tl_L_gt_S", (2, 6, 3), (2, 3, 3), (2, 3, 2), {"is_causal": True}),
    (
        "causal_br_L_lt_S",
        (2, 3, 3),
        (2, 6, 3),
        (2, 6, 2),
        {"is_causal": True, "alignment": "bottom_right"},
    ),
    (
        "causal_br_L_gt_S",
        (2, 6, 3),
        (2, 3, 3),
        (2, 3, 2),
        {"is_causal": True, "alignment": "bottom_right"},
    ),
    ("window_1_1_tl", (5, 2), (7, 2), (7, 3), {"window": (1, 1)}),
    ("window_1_1_br", (5, 2), (7, 2), (7, 3), {"window": (1, 1), "alignment": "bottom_right"}),
    ("window_2_0_br", (6, 2), (4, 2), (4, 3), {"window": (2, 0), "alignment": "bottom_right"}),
    ("window_none_1_tl", (5, 2), (7, 2), (7, 3), {"window": (None, 1)}),
    (
        "window_1_none_br",
        (5, 2),
        (7, 2),
        (7, 3),
        {"window": (1, None), "alignment": "bottom_right"},
    ),
    ("window_0_0", (4, 2), (4, 2), (4, 1), {"window": (0, 0)}),
    ("window_none_none", (4, 2), (5, 2), (5, 1), {"window": (None, None)}),
    ("window_causal_tl", (5, 2), (7, 2), (7, 3), {"window": (2, 3), "is_causal": True}),
    (
        "window_causal_br",
        (5, 2),
        (7, 2),
        (7, 3),
        {"window": (2, 3), "is_causal": True, "alignment": "bottom_right"},
    ),
    ("softcap", (2, 4, 3), (2, 5, 3), (2, 5, 2), {"softcap": 1.5, "magnitude": 3.0}),
    (
        "softcap_bias_mask",
        (2, 4, 3),
        (2, 5, 3),
        (2, 5, 2),
        {"softcap": 0.7, "bias": (4, 5), "mask": (2, 4, 5), "magnitude": 3.0},
    ),
    ("gqa_4_2", (4, 3, 2), (2, 5, 2), (2, 5, 3), {"enable_gqa": True}),
    ("gqa_6_1_batch", (2, 6, 3, 2), (2, 1, 4, 2), (2, 1, 4, 3), {"enable_gqa": True}),
    (
        "gqa_mask_bias",
        (6, 3, 2),
        (3, 4, 2),
        (3, 4, 3),
        {"enable_gqa": True, "mask": (6, 3, 4), "bias": (6, 1, 4)},
    ),
    ("bcast_batch", (2, 1, 2, 3, 4), (1, 3, 2, 5, 4), (3, 2, 5, 2), {}),
    ("bcast_batch_only_value", (3, 2), (4, 2), (2, 4, 3), {}),
    ("bcast_heads_kv_1", (3, 4, 2), (1, 5, 2), (1, 5, 2), {}),
    ("Ev_ne_E", (2, 3, 5), (2, 4, 5), (2, 4, 1), {}),
    (
        "everything",
        (2, 4, 5, 3),
        (1, 2, 6, 3),
        (2, 2, 6, 2),
        {
            "mask": (2, 1, 5, 6),
            "bias": (4, 5, 6),
            "is_causal": True,
            "window": (3, 1),
            "alignment": "bottom_right",
            "softcap": 2.0,
            "scale": 0.8,
            "enable_gqa": True,
            "magnitude": 2.0,
        },
    ),
]


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "options"),
    [pytest.param(*case[1:], id=case[0]) for case in BRUTE_CASES],
)
def test_matches_brute_force(q_shape, k_shape, v_shape, options):
    options = dict(options)
    magnitude = options.pop("magnitude", 1.0)
    seed = zlib.crc32(repr((q_shape, k_shape, v_shape, options)).encode())
    rng, q, k, v = _random_inputs(seed, q_shape, k_shape, v_shape, magnitude=magnitude)
    if "mask" in options:
        options["mask"] = rng.random(options["mask"]) < 0.7
    if "bias" in options:
        options["bias"] = _random_bias(rng, options["bias"], p_neg_inf=0.2)
    _check_against_brute_force(q, k, v, **options)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    L=st.integers(0, 4),
    S=st.integers(0, 4),
    E=st.integers(1, 3),
    Ev=st.integers(1, 3),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    with_batch=st.booleans(),
    is_causal=st.booleans(),
    window=st.none() | st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(0, 3)),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    softcap=st.none() | st.floats(0.3, 3.0),
    mask_kind=st.sampled_from([None, "full", "LS"]),
    bias_kind=st.sampled_from([None, "full", "H1S"]),
)
def test_matches_brute_force_random(
    seed,
    L,
    S,
    E,
    Ev,
    hkv,
    group,
    with_batch,
    is_causal,
    window,
    alignment,
    softcap,
    mask_kind,
    bias_kind,
):
    hq = hkv * group
    batch = (2,) if with_batch else ()
    rng, q, k, v = _random_inputs(
        seed, (*batch, hq, L, E), (*batch, hkv, S, E), (*batch, hkv, S, Ev), magnitude=1.5
    )
    mask = None
    if mask_kind == "full":
        mask = rng.random((*batch, hq, L, S)) < 0.6
    elif mask_kind == "LS":
        mask = rng.random((L, S)) < 0.6
    bias = None
    if bias_kind == "full":
        bias = _random_bias(rng, (*batch, hq, L, S), p_neg_inf=0.2)
    elif bias_kind == "H1S":
        bias = _random_bias(rng, (hq, 1, S), p_neg_inf=0.2)
    _check_against_brute_force(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        window=window,
        alignment=alignment,
        softcap=softcap,
        enable_gqa=group > 1,
    )


def test_return_structure():
    _, q, k, v = _random_inputs(0, (2, 3, 2), (2, 4, 2), (2, 4, 5))
    out = scaled_dot_product_attention(q, k, v)
    assert isinstance(out, np.ndarray)
    assert out.shape == (2, 3, 5)
    out_w = scaled_dot_product_attention(q, k, v, return_weights=True)
    assert isinstance(out_w, tuple)
    assert [a.shape for a in out_w] == [(2, 3, 5), (2, 3, 4)]
    out_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    assert [a.shape for a in out_lse] == [(2, 3, 5), (2, 3)]
    out_w_lse = scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True)
    assert [a.shape for a in out_w_lse] == [(2, 3, 5), (2, 3, 4), (2, 3)]
    for got in (*out_w, *out_lse, *out_w_lse):
        assert got.dtype == np.float64
    np.testing.assert_array_equal(out_w_lse[0], out)
    np.testing.assert_allclose(out_w_lse[1].sum(axis=-1), 1.0, rtol=1e-14)


def test_inputs_are_not_modified():
    _, q, k, v = _random_inputs(1, (3, 2), (4, 2), (4, 2))
    bias = np.zeros((3, 4))
    copies = [a.copy() for a in (q, k, v, bias)]
    scaled_dot_product_attention(q, k, v, bias=bias, softcap=1.0, is_causal=True)
    scaled_dot_product_attention_vjp(q, k, v, np.ones((3, 2)), bias=bias, softcap=1.0)
    for a, c in zip((q, k, v, bias), copies, strict=True):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        pytest.param(lambda q, k, v: ((q, np.ones((4, 3)), v), {}), ValueError, id="E_mismatch"),
        pytest.param(lambda q, k, v: ((q, k, np.ones((5, 2))), {}), ValueError, id="S_mismatch"),
        pytest.param(lambda q, k, v: ((q[0], k, v), {}), ValueError, id="query_1d"),
        pytest.param(
            lambda q, k, v: ((q, k, v), {"alignment": "center"}), ValueError, id="alignment"
        ),
        pytest.param(lambda q, k, v: ((q, k, v), {"softcap": 0.0}), ValueError, id="softcap_0"),
        pytest.param(lambda q, k, v: ((q, k, v), {"window": (1,)}), ValueError, id="window_len"),
        pytest.param(
            lambda q, k, v: ((q, k, v), {"enable_gqa": True}), ValueError, id="gqa_no_heads"
        ),
        pytest.param(
            lambda q, k, v: (
                (q[None].repeat(3, 0), k[None].repeat(2, 0), v[None].repeat(2, 0)),
                {"enable_gqa": True},
            ),
            ValueError,
            id="gqa_not_multiple",
        ),
        pytest.param(
            lambda q, k, v: ((q, k, v), {"mask": np.ones((3, 4))}), TypeError, id="float_mask"
        ),
        pytest.param(
            lambda q, k, v: ((q, k, v), {"mask": np.ones((2, 3, 4), dtype=bool)}),
            ValueError,
            id="mask_adds_axes",
        ),
        pytest.param(
            lambda q, k, v: ((q, k, v), {"bias": np.ones((3, 5))}), ValueError, id="bias_shape"
        ),
    ],
)
def test_validation(call, error):
    _, q, k, v = _random_inputs(2, (3, 2), (4, 2), (4, 2))
    args, kwargs = call(q, k, v)
    with pytest.raises(error):
        scaled_dot_product_attention(*args, **kwargs)


def test_vjp_validates_grad_output_shape():
    _, q, k, v = _random_inputs(3, (3, 2), (4, 2), (4, 2))
    with pytest.raises(ValueError, match="grad_output"):
        scaled_dot_product_attention_vjp(q, k, v, np.ones((3, 3)))


# --------------------------------------------------------------------------------------
# 3. rows without admissible keys, empty sequences
# --------------------------------------------------------------------------------------


def _assert_no_key_rows(out, weights, lse, rows):
    """``rows`` is a boolean array over ``out.shape[:-1]``: True where no key is admissible."""
    for a in (out, weights, lse):
        assert not np.isnan(a).any()
    assert np.all(out[rows] == 0.0)
    assert np.all(weights[rows] == 0.0)
    assert np.all(lse[rows] == -np.inf)
    assert np.all(np.isfinite(lse[~rows]))
    np.testing.assert_allclose(weights[~rows].sum(axis=-1), 1.0, rtol=1e-14)


def _forward_strict(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(divide="raise", invalid="raise", over="raise"):
            return scaled_dot_product_attention(
                *args, return_weights=True, return_lse=True, **kwargs
            )


@pytest.mark.parametrize(
    ("options", "no_key_rows"),
    [
        pytest.param({"mask": "row1_false"}, [1], id="mask_row"),
        pytest.param({"mask": "all_false"}, [0, 1, 2, 3], id="mask_all"),
        pytest.param({"bias": "row2_neg_inf"}, [2], id="bias_row_neg_inf"),
        pytest.param({"bias": "row2_neg_inf", "softcap": 1.0}, [2], id="bias_row_softcap"),
        # L = 4 > S = 3: query 0's bottom-right diagonal is key -1
        pytest.param({"is_causal": True, "alignment": "bottom_right"}, [0], id="causal_br"),
        pytest.param({"window": (0, 0), "alignment": "bottom_right"}, [0], id="window_br"),
        # query 3's top-left diagonal is key 3, beyond the last key (2)
        pytest.param({"window": (0, 0)}, [3], id="window_tl"),
        pytest.param({"window": (None, -4)}, [0, 1, 2, 3], id="window_empty"),
    ],
)
def test_rows_without_keys(options, no_key_rows):
    rng, q, k, v = _random_inputs(4, (2, 4, 3), (2, 3, 3), (2, 3, 2))
    options = dict(options)
    if options.get("mask") == "row1_false":
        mask = rng.random((2, 4, 3)) < 0.5
        mask[..., :, 0] = True
        mask[..., 1, :] = False
        options["mask"] = mask
    elif options.get("mask") == "all_false":
        options["mask"] = np.zeros((4, 3), dtype=bool)
    if options.get("bias") == "row2_neg_inf":
        bias = rng.standard_normal((4, 3))
        bias[2, :] = -np.inf
        options["bias"] = bias
    out, weights, lse = _forward_strict(q, k, v, **options)
    rows = np.zeros((2, 4), dtype=bool)
    rows[:, no_key_rows] = True
    _assert_no_key_rows(out, weights, lse, rows)
    _check_against_brute_force(q, k, v, **options)


@pytest.mark.parametrize("with_heads", [False, True])
def test_empty_key_sequence(with_heads):
    lead = (2, 3) if with_heads else ()
    q = np.ones((*lead, 4, 2))
    k = np.ones((*lead, 0, 2))
    v = np.ones((*lead, 0, 5))
    out, weights, lse = _forward_strict(q, k, v, is_causal=True, bias=np.zeros((4, 0)))
    assert out.shape == (*lead, 4, 5)
    assert weights.shape == (*lead, 4, 0)
    assert lse.shape == (*lead, 4)
    assert np.all(out == 0.0)
    assert np.all(lse == -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dq, dk, dv, db = scaled_dot_product_attention_vjp(
            q, k, v, np.ones(out.shape), bias=np.zeros((4, 0))
        )
    assert np.all(dq == 0.0)
    assert dq.shape == q.shape
    assert dk.shape == k.shape
    assert dv.shape == v.shape
    assert db.shape == (4, 0)


@pytest.mark.parametrize("with_heads", [False, True])
def test_empty_query_sequence(with_heads):
    lead = (2, 3) if with_heads else ()
    q = np.ones((*lead, 0, 2))
    k = np.ones((*lead, 4, 2))
    v = np.ones((*lead, 4, 5))
    out, weights, lse = _forward_strict(q, k, v, is_causal=True, alignment="bottom_right")
    assert out.shape == (*lead, 0, 5)
    assert weights.shape == (*lead, 0, 4)
    assert lse.shape == (*lead, 0)
    dq, dk, dv = scaled_dot_product_attention_vjp(q, k, v, np.ones(out.shape))
    assert dq.shape == q.shape
    assert np.all(dk == 0.0)
    assert np.all(dv == 0.0)


def test_large_scores_do_not_overflow():
    q = np.array([[1000.0, 0.0], [-1000.0, 0.0]])
    k = np.array([[1000.0, 0.0], [999.0, 0.0], [-1000.0, 0.0]])
    v = np.eye(3)
    out, weights, lse = _forward_strict(q, k, v, scale=1.0)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(weights[0], [1.0, 0.0, 0.0])  # exp(-1000) underflows to 0
    assert lse[0] == pytest.approx(1e6)


# --------------------------------------------------------------------------------------
# 4. VJP oracle against central finite differences of the forward oracle
# --------------------------------------------------------------------------------------

FD_STEP = 1e-6


def _finite_difference_grads(q, k, v, d_out, bias, options):
    """Central differences of ``sum(out * d_out)`` w.r.t. every element of each input."""
    arrays = [q, k, v] if bias is None else [q, k, v, bias]

    def loss(*xs):
        kw = dict(options)
        if bias is not None:
            kw["bias"] = xs[3]
        return float(np.sum(scaled_dot_product_attention(xs[0], xs[1], xs[2], **kw) * d_out))

    grads = []
    for which, x in enumerate(arrays):
        g = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            if not np.isfinite(x[idx]):  # -inf bias entries: the output does not move
                continue
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[which][idx] += FD_STEP
            minus[which][idx] -= FD_STEP
            g[idx] = (loss(*plus) - loss(*minus)) / (2 * FD_STEP)
        grads.append(g)
    return grads


def _assert_grads_close(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert isinstance(g, np.ndarray)
        assert g.dtype == np.float64
        assert g.shape == e.shape
        assert not np.isnan(g).any()
        scale = max(float(np.max(np.abs(e), initial=0.0)), 1e-3)
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-6 * scale)


#: (id, q shape, k shape, v shape, options); "mask"/"bias" entries name a shape to draw.
VJP_CASES = [
    ("plain_2d", (3, 2), (4, 2), (4, 2), {}),
    ("heads", (2, 3, 2), (2, 4, 2), (2, 4, 2), {}),
    ("L_ne_S_Ev_ne_E", (2, 5, 3), (2, 3, 3), (2, 3, 1), {}),
    ("scale", (3, 2), (4, 2), (4, 3), {"scale": 1.7}),
    ("mask", (2, 3, 2), (2, 4, 2), (2, 4, 2), {"mask": (2, 3, 4)}),
    ("bias_full", (2, 3, 2), (2, 4, 2), (2, 4, 2), {"bias": (2, 3, 4)}),
    ("bias_1LS", (2, 3, 2), (2, 4, 2), (2, 4, 2), {"bias": (1, 3, 4)}),
    ("bias_LS_batch", (2, 2, 3, 2), (2, 2, 4, 2), (2, 2, 4, 2), {"bias": (3, 4)}),
    ("bias_H1S_neg_inf", (2, 3, 2), (2, 4, 2), (2, 4, 2), {"bias": (2, 1, 4), "neg_inf": True}),
    ("mask_and_bias", (2, 3, 2), (2, 4, 2), (2, 4, 2), {"mask": (3, 4), "bias": (2, 1, 1)}),
    ("causal_tl", (2, 3, 2), (2, 5, 2), (2, 5, 2), {"is_causal": True}),
    (
        "causal_br",
        (2, 3, 2),
        (2, 5, 2),
        (2, 5, 2),
        {"is_causal": True, "alignment": "bottom_right"},
    ),
    ("window_tl", (4, 2), (5, 2), (5, 2), {"window": (1, 1)}),
    ("window_br", (4, 2), (5, 2), (5, 2), {"window": (1, 0), "alignment": "bottom_right"}),
    (
        "window_open_side",
        (4, 2),
        (5, 2),
        (5, 2),
        {"window": (None, 0), "alignment": "bottom_right"},
    ),
    ("softcap", (2, 3, 2), (2, 4, 2), (2, 4, 2), {"softcap": 1.2, "magnitude": 2.0}),
    ("softcap_bias", (3, 2), (4, 2), (4, 2), {"softcap": 0.8, "bias": (3, 4), "magnitude": 2.0}),
    ("gqa", (4, 2, 2), (2, 3, 2), (2, 3, 2), {"enable_gqa": True}),
    ("gqa_bias", (3, 2, 2), (1, 3, 2), (1, 3, 3), {"enable_gqa": True, "bias": (3, 1, 3)}),
    ("bcast_batch", (2, 1, 2, 2), (1, 2, 3, 2), (3, 2), {}),
    ("bcast_heads_kv_1", (3, 2, 2), (1, 3, 2), (1, 3, 2), {}),
    (
        "everything",
        (2, 4, 3, 2),
        (1, 2, 4, 2),
        (2, 2, 4, 3),
        {
            "mask": (1, 4, 3, 4),
            "bias": (4, 1, 4),
            "is_causal": True,
            "window": (2, None),
            "alignment": "bottom_right",
            "softcap": 1.5,
            "scale": 0.9,
            "enable_gqa": True,
            "magnitude": 1.5,
        },
    ),
]


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "options"),
    [pytest.param(*case[1:], id=case[0]) for case in VJP_CASES],
)
def test_vjp_matches_finite_differences(q_shape, k_shape, v_shape, options):
    options = dict(options)
    magnitude = options.pop("magnitude", 1.0)
    neg_inf = options.pop("neg_inf", False)
    seed = zlib.crc32(repr((q_shape, k_shape, v_shape, options)).encode())
    rng, q, k, v = _random_inputs(seed, q_shape, k_shape, v_shape, magnitude=magnitude)
    if "mask" in options:
        mask = rng.random(options["mask"]) < 0.7
        mask[..., 0] = True  # keep every row alive here; dead rows are tested separately
        options["mask"] = mask
    bias = None
    if "bias" in options:
        bias = rng.standard_normal(options.pop("bias"))
        if neg_inf:
            bias[..., 1] = -np.inf
    out = scaled_dot_product_attention(q, k, v, bias=bias, **options)
    d_out = rng.standard_normal(out.shape)
    got = scaled_dot_product_attention_vjp(q, k, v, d_out, bias=bias, **options)
    assert len(got) == (3 if bias is None else 4)
    expected = _finite_difference_grads(q, k, v, d_out, bias, options)
    _assert_grads_close(got, expected)
    if neg_inf:
        assert np.all(got[3][..., 1] == 0.0)


def test_vjp_dead_rows_and_unused_keys_have_exactly_zero_gradient():
    rng, q, k, v = _random_inputs(5, (2, 4, 3), (2, 5, 3), (2, 5, 2))
    mask = rng.random((2, 4, 5)) < 0.6
    mask[:, :, 0] = True
    mask[1, 2, :] = False  # head 1, query 2: no admissible key
    mask[:, :, 4] = False  # key 4: never attended by anyone
    bias = rng.standard_normal((4, 5))
    bias[0, :] = -np.inf  # query 0: no admissible key, in every head
    options = {"mask": mask, "softcap": 2.0}
    out = scaled_dot_product_attention(q, k, v, bias=bias, **options)
    assert np.all(out[1, 2] == 0.0)
    assert np.all(out[:, 0] == 0.0)
    d_out = rng.standard_normal(out.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = scaled_dot_product_attention_vjp(q, k, v, d_out, bias=bias, **options)
    dq, dk, dv, dbias = got
    assert np.all(dq[1, 2] == 0.0)
    assert np.all(dq[:, 0] == 0.0)
    assert np.all(dk[:, 4] == 0.0)
    assert np.all(dv[:, 4] == 0.0)
    assert np.all(dbias[0] == 0.0)
    assert np.all(dbias[:, 4] == 0.0)
    _assert_grads_close(got, _finite_difference_grads(q, k, v, d_out, bias, options))


def test_vjp_causal_bottom_right_with_dead_rows():
    # L = 5 > S = 3 with bottom-right causal: queries 0 and 1 see no key.
    rng, q, k, v = _random_inputs(6, (5, 2), (3, 2), (3, 2))
    options = {"is_causal": True, "alignment": "bottom_right"}
    out = scaled_dot_product_attention(q, k, v, **options)
    d_out = rng.standard_normal(out.shape)
    got = scaled_dot_product_attention_vjp(q, k, v, d_out, **options)
    assert np.all(got[0][:2] == 0.0)
    _assert_grads_close(got, _finite_difference_grads(q, k, v, d_out, None, options))


# --------------------------------------------------------------------------------------
# forward and VJP against torch's float64 attention (where torch has the feature)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain"),
        pytest.param({"scale": 0.6}, id="scale"),
        pytest.param({"mask": True}, id="mask"),
        pytest.param({"bias": True}, id="bias"),
        pytest.param({"is_causal": True}, id="causal_top_left"),
        pytest.param({"enable_gqa": True}, id="gqa"),
    ],
)
def test_against_torch_float64(options):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(7)
    options = dict(options)
    hkv = 1 if options.get("enable_gqa") else 3
    q = rng.standard_normal((2, 3, 4, 5))
    k = rng.standard_normal((2, hkv, 6, 5))
    v = rng.standard_normal((2, hkv, 6, 2))
    d_out = rng.standard_normal((2, 3, 4, 2))
    attn_mask = None
    if options.get("mask"):
        options["mask"] = rng.random((2, 3, 4, 6)) < 0.7
        options["mask"][..., 0] = True  # torch's handling of dead rows varies by version
        attn_mask = torch.from_numpy(options["mask"])
    if options.get("bias"):
        options["bias"] = rng.standard_normal((3, 4, 6))
        attn_mask = torch.from_numpy(options["bias"]).requires_grad_(True)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
    t_out = F.scaled_dot_product_attention(
        tq,
        tk,
        tv,
        attn_mask=attn_mask,
        is_causal=options.get("is_causal", False),
        scale=options.get("scale"),
        enable_gqa=options.get("enable_gqa", False),
    )
    t_out.backward(torch.from_numpy(d_out))
    out = scaled_dot_product_attention(q, k, v, **options)
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-12, atol=1e-13)
    grads = scaled_dot_product_attention_vjp(q, k, v, d_out, **options)
    expected = [tq.grad, tk.grad, tv.grad]
    if options.get("bias") is not None:
        expected.append(attn_mask.grad)
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------
# 5. to_numpy on each installed library
# --------------------------------------------------------------------------------------

DATA = np.array([[1.5, -2.0, 0.25], [3.0, 0.0, -0.5]])  # exactly representable in bfloat16


def _assert_converted(got, expected_dtype):
    assert type(got) is np.ndarray
    assert got.dtype == expected_dtype
    np.testing.assert_array_equal(got, DATA.astype(expected_dtype))


def test_to_numpy_numpy_is_a_copy():
    x = DATA.copy()
    got = to_numpy(x)
    _assert_converted(got, np.float64)
    got[0, 0] = 99.0
    assert x[0, 0] == 1.5


def test_to_numpy_python_objects():
    _assert_converted(to_numpy(DATA.tolist()), np.float64)
    assert to_numpy(2.5).shape == ()
    assert to_numpy(np.float32(2.5)).dtype == np.float32


@pytest.mark.parametrize(
    ("dtype_name", "expected"),
    [
        ("float64", np.float64),
        ("float32", np.float32),
        ("float16", np.float16),
        ("bfloat16", np.float32),
    ],
)
def test_to_numpy_torch(dtype_name, expected):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(DATA).to(getattr(torch, dtype_name))
    _assert_converted(to_numpy(t), expected)


def test_to_numpy_torch_requires_grad_and_views():
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(DATA.copy()).requires_grad_(True)
    got = to_numpy(t * 1.0)  # a non-leaf tensor with a grad_fn
    _assert_converted(got, np.float64)
    from_leaf = to_numpy(t)
    _assert_converted(from_leaf, np.float64)
    from_leaf[0, 0] = 99.0  # a copy: the tensor does not change
    assert t.detach()[0, 0].item() == 1.5
    np.testing.assert_array_equal(to_numpy(t.T), DATA.T)
    mask = to_numpy(torch.from_numpy(DATA) > 0)
    assert mask.dtype == np.bool_


def test_oracle_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    _, q, k, v = _random_inputs(8, (2, 3, 2), (2, 4, 2), (2, 4, 3))
    mask = np.ones((3, 4), dtype=bool)
    mask[0, 1:] = False
    expected = scaled_dot_product_attention(q, k, v, mask=mask)
    tq = torch.from_numpy(q).requires_grad_(True)
    tk = torch.from_numpy(k).to(torch.bfloat16)
    tv = torch.from_numpy(v).float()
    got = scaled_dot_product_attention(tq, tk, tv, mask=torch.from_numpy(mask))
    assert type(got) is np.ndarray
    assert got.dtype == np.float64
    k_bf16 = tk.float().double().numpy()
    v_f32 = tv.double().numpy()
    np.testing.assert_allclose(
        got, scaled_dot_product_attention(q, k_bf16, v_f32, mask=mask), rtol=1e-14
    )
    assert np.abs(got - expected).max() < 0.1  # only the bfloat16 rounding differs
    grads = scaled_dot_product_attention_vjp(tq, tk, tv, torch.ones(2, 3, 3))
    assert all(type(g) is np.ndarray and g.dtype == np.float64 for g in grads)


def test_to_numpy_torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = torch.from_numpy(DATA).to("cuda", torch.bfloat16)
    _assert_converted(to_numpy(t), np.float32)


def test_to_numpy_jax():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.asarray(DATA.astype(np.float32))
    _assert_converted(to_numpy(x), np.float32)
    _assert_converted(to_numpy(x.astype(jnp.bfloat16)), np.float32)


def test_to_numpy_dask():
    da = pytest.importorskip("dask.array")
    x = da.from_array(DATA, chunks=(1, 2)) * 1.0
    _assert_converted(to_numpy(x), np.float64)


def test_to_numpy_array_api_strict():
    xp = pytest.importorskip("array_api_strict")
    _assert_converted(to_numpy(xp.asarray(DATA)), np.float64)
    _assert_converted(to_numpy(xp.asarray(DATA, dtype=xp.float32)), np.float32)
    assert to_numpy(xp.asarray([True, False])).dtype == np.bool_
    other = xp.Device("device1")
    _assert_converted(to_numpy(xp.asarray(DATA, device=other)), np.float64)


def test_to_numpy_cupy():
    cp = pytest.importorskip("cupy")
    try:
        x = cp.asarray(DATA)
    except Exception as exc:  # CUDA driver missing or broken
        pytest.skip(f"cupy has no usable device: {exc}")
    _assert_converted(to_numpy(x), np.float64)
