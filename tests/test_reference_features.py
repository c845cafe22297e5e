"""The oracle's newer features: ``scale`` as a 0-d array, variable lengths, packed documents.

Each feature is checked only against things independent of the code that implements it:

* a brute-force implementation with Python floats and explicit loops over every batch
  element, head, query and key, that decides admissibility one ``(b, i, j)`` at a time
  (:func:`_brute_force`);
* the oracle *without* the feature, called once per batch element on inputs sliced to that
  element's lengths, or once per document of a packed sequence;
* the oracle with an explicit boolean ``mask`` built by the same loops (for the VJP, whose
  mask path ``tests/test_reference.py`` checks against finite differences);
* central finite differences in float64 (``grad_scale`` and one case with everything).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpa_array.reference import (
    intermediates,
    scaled_dot_product_attention,
    scaled_dot_product_attention_vjp,
)

# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------

TIGHT = {"rtol": 1e-12, "atol": 1e-13}


def _inputs(seed: int, batch: tuple[int, ...], hq: int, hkv: int, L: int, S: int, E: int, Ev: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*batch, hq, L, E)) * 1.5
    k = rng.standard_normal((*batch, hkv, S, E)) * 1.5
    v = rng.standard_normal((*batch, hkv, S, Ev))
    return rng, q, k, v


def _bias(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    bias = rng.standard_normal(shape)
    bias[rng.random(shape) < 0.15] = -np.inf
    return bias


def _full(x: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Lengths or segment ids written out for every batch element (test-side broadcasting)."""
    return np.broadcast_to(np.asarray(x), shape)


def _admissible(
    b: tuple[int, ...],
    h: int,
    i: int,
    j: int,
    *,
    L: int,
    S: int,
    mask: np.ndarray | None,
    is_causal: bool,
    window: Any,
    alignment: str,
    query_lengths: np.ndarray | None,
    key_lengths: np.ndarray | None,
    segments: tuple[np.ndarray, np.ndarray] | None,
) -> bool:
    """May query ``i`` of head ``h`` in batch element ``b`` attend key ``j``? One pair at a time."""
    q_len = L if query_lengths is None else int(query_lengths[b])
    k_len = S if key_lengths is None else int(key_lengths[b])
    if i >= q_len or j >= k_len:
        return False
    if segments is not None and int(segments[0][(*b, i)]) != int(segments[1][(*b, j)]):
        return False
    diag = i if alignment == "top_left" else i + k_len - q_len
    if is_causal and j > diag:
        return False
    if window is not None:
        left, right = window
        if left is not None and j < diag - left:
            return False
        if right is not None and j > diag + right:
            return False
    return mask is None or bool(mask[(*b, h, i, j)])


def _brute_mask(q_shape, S, **restrictions) -> np.ndarray:
    """The admissibility of :func:`_admissible` for every ``(b, h, i, j)``, from loops."""
    *batch, hq, L, _ = q_shape
    out = np.zeros((*batch, hq, L, S), dtype=bool)
    for b in np.ndindex(*batch):
        for h in range(hq):
            for i in range(L):
                for j in range(S):
                    out[(*b, h, i, j)] = _admissible(b, h, i, j, L=L, S=S, **restrictions)
    return out


def _brute_force(q, k, v, *, bias=None, scale=None, softcap=None, **restrictions):
    """Attention with Python floats and explicit loops; returns ``(out, weights, lse)``.

    ``q``, ``k`` and ``v`` have shapes ``(*batch, Hq, L, E)``, ``(*batch, Hkv, S, E)`` and
    ``(*batch, Hkv, S, Ev)`` (``Hq`` a multiple of ``Hkv``); ``bias`` and ``mask`` are
    ``None`` or full ``(*batch, Hq, L, S)``; lengths and segment ids are full per batch
    element.
    """
    *batch, hq, L, E = q.shape
    hkv, S, Ev = v.shape[-3], v.shape[-2], v.shape[-1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    out = np.zeros((*batch, hq, L, Ev))
    weights = np.zeros((*batch, hq, L, S))
    lse = np.full((*batch, hq, L), -math.inf)
    for b in np.ndindex(*batch):
        for h in range(hq):
            qb, kb, vb = q[(*b, h)], k[(*b, h // group)], v[(*b, h // group)]
            for i in range(L):
                scores = {}
                for j in range(S):
                    if not _admissible(b, h, i, j, L=L, S=S, **restrictions):
                        continue
                    s = sum(float(qb[i, e]) * float(kb[j, e]) for e in range(E)) * scale
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if bias is not None:
                        s += float(bias[(*b, h, i, j)])
                    if s != -math.inf:
                        scores[j] = s
                if not scores:
                    continue
                m = max(scores.values())
                exps = {j: math.exp(s - m) for j, s in scores.items()}
                total = sum(exps.values())
                for j, e in exps.items():
                    weights[(*b, h, i, j)] = e / total
                for c in range(Ev):
                    out[(*b, h, i, c)] = sum(exps[j] / total * float(vb[j, c]) for j in exps)
                lse[(*b, h, i)] = m + math.log(total)
    return out, weights, lse


def _forward(q, k, v, **kw):
    """The oracle's ``(out, weights, lse)``, with every floating-point warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(divide="raise", invalid="raise", over="raise"):
            return scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True, **kw)


def _restrictions(kw: dict[str, Any], batch: tuple[int, ...], L: int, S: int) -> dict:
    """The brute force's keyword arguments for the oracle's ``kw`` (lengths written out)."""
    ql, kl, seg = kw.get("query_lengths"), kw.get("key_lengths"), kw.get("segment_ids")
    return {
        "mask": kw.get("mask"),
        "is_causal": kw.get("is_causal", False),
        "window": kw.get("window"),
        "alignment": kw.get("alignment", "top_left"),
        "query_lengths": None if ql is None else _full(ql, batch),
        "key_lengths": None if kl is None else _full(kl, batch),
        "segments": None
        if seg is None
        else (_full(seg[0], (*batch, L)), _full(seg[1], (*batch, S))),
    }


def _segment_layout(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "one":
        return np.zeros(n, dtype=np.int64)
    if kind == "per_token":
        return np.arange(n, dtype=np.int64)
    if kind == "contiguous":  # packed documents: non-decreasing ids
        return np.sort(rng.integers(0, 3, n)).astype(np.int64)
    return rng.integers(0, 3, n).astype(np.int64)  # "random": interleaved documents


SEGMENT_KINDS = ["one", "per_token", "contiguous", "random"]


def _some_lengths(n: int):
    """A length in ``[0, n]``, drawn with the extremes 0 and ``n`` boosted."""
    return st.sampled_from([0, n]) | st.integers(0, n)


# --------------------------------------------------------------------------------------
# 1. everything together against the brute-force loops
# --------------------------------------------------------------------------------------


@settings(deadline=None, derandomize=True)
@given(
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
    B=st.integers(1, 3),
    L=st.integers(0, 5),
    S=st.integers(0, 5),
    hkv=st.integers(1, 2),
    group=st.integers(1, 2),
    is_causal=st.booleans(),
    window=st.none() | st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(0, 3)),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    softcap=st.none() | st.floats(0.5, 3.0),
    with_bias=st.booleans(),
    with_mask=st.booleans(),
    with_lengths=st.sampled_from(["none", "query", "key", "both", "scalar"]),
    segments=st.none() | st.tuples(st.sampled_from(SEGMENT_KINDS), st.sampled_from(SEGMENT_KINDS)),
    scale=st.none() | st.floats(0.2, 2.0),
)
def test_everything_matches_brute_force(
    data,
    seed,
    B,
    L,
    S,
    hkv,
    group,
    is_causal,
    window,
    alignment,
    softcap,
    with_bias,
    with_mask,
    with_lengths,
    segments,
    scale,
):
    hq = hkv * group
    rng, q, k, v = _inputs(seed, (B,), hq, hkv, L, S, 2, 2)
    kw: dict[str, Any] = {
        "is_causal": is_causal,
        "window": window,
        "alignment": alignment,
        "softcap": softcap,
        "enable_gqa": group > 1,
    }
    if scale is not None:
        kw["scale"] = np.array(scale)
    if with_mask:
        kw["mask"] = rng.random((B, hq, L, S)) < 0.8
    if with_bias:
        kw["bias"] = _bias(rng, (B, hq, L, S))
    lengths = st.lists(_some_lengths(L), min_size=B, max_size=B)
    key_lengths = st.lists(_some_lengths(S), min_size=B, max_size=B)
    if with_lengths in ("query", "both"):
        kw["query_lengths"] = np.array(data.draw(lengths), dtype=np.int32)
    if with_lengths in ("key", "both"):
        kw["key_lengths"] = np.array(data.draw(key_lengths), dtype=np.int64)
    if with_lengths == "scalar":  # a Python int for every batch element, shape (1,) too
        kw["query_lengths"] = data.draw(_some_lengths(L))
        kw["key_lengths"] = np.array([data.draw(_some_lengths(S))])
    if segments is not None:
        kw["segment_ids"] = (
            np.stack([_segment_layout(segments[0], L, rng) for _ in range(B)]),
            _segment_layout(segments[1], S, rng),  # one layout for every batch element
        )

    got = _forward(q, k, v, **kw)
    expected = _brute_force(
        q,
        k,
        v,
        bias=kw.get("bias"),
        scale=scale,
        softcap=softcap,
        **_restrictions(kw, (B,), L, S),
    )
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == np.float64
        assert g.shape == e.shape
        assert not np.isnan(g).any()
        np.testing.assert_allclose(g, e, **TIGHT)
    out, weights, lse = got
    dead = lse == -np.inf
    assert np.all(out[dead] == 0.0)
    assert np.all(weights[dead] == 0.0)
    if "query_lengths" in kw:
        padded = np.arange(L) >= _full(kw["query_lengths"], (B,))[:, None]  # (B, L)
        assert np.all(dead[padded[:, None, :].repeat(hq, 1)])

    # The same restrictions as one explicit mask: same forward, same gradients.
    full_mask = _brute_mask(q.shape, S, **_restrictions(kw, (B,), L, S))
    plain = {key: kw[key] for key in ("bias", "softcap", "enable_gqa", "scale") if key in kw}
    via_mask = _forward(q, k, v, mask=full_mask, **plain)
    for g, e in zip(got, via_mask, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-14, atol=1e-15)
    d_out = rng.standard_normal(out.shape)  # padded rows get a cotangent too
    grads = scaled_dot_product_attention_vjp(q, k, v, d_out, **kw)
    grads_via_mask = scaled_dot_product_attention_vjp(q, k, v, d_out, mask=full_mask, **plain)
    assert len(grads) == 3 + ("bias" in kw) + ("scale" in kw)
    for g, e in zip(grads, grads_via_mask, strict=True):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-13)
    allowed = intermediates(q, k, v, **kw)["allowed"]
    bias_ok = True if "bias" not in kw else kw["bias"] != -np.inf
    np.testing.assert_array_equal(allowed, full_mask & bias_ok)


# --------------------------------------------------------------------------------------
# 2. variable lengths against one call per batch element on the sliced inputs
# --------------------------------------------------------------------------------------


@settings(deadline=None, derandomize=True)
@given(
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
    B=st.integers(1, 3),
    L=st.integers(0, 5),
    S=st.integers(0, 5),
    group=st.integers(1, 2),
    is_causal=st.booleans(),
    window=st.none() | st.tuples(st.none() | st.integers(0, 2), st.none() | st.integers(0, 2)),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    softcap=st.none() | st.just(1.5),
    with_bias=st.booleans(),
    with_mask=st.booleans(),
)
def test_lengths_match_sliced_calls(
    data, seed, B, L, S, group, is_causal, window, alignment, softcap, with_bias, with_mask
):
    hkv = 2
    hq = hkv * group
    rng, q, k, v = _inputs(seed, (B,), hq, hkv, L, S, 3, 2)
    # Padding full of large garbage: it must not leak into anything.
    ql = np.array(data.draw(st.lists(_some_lengths(L), min_size=B, max_size=B)), dtype=np.int64)
    kl = np.array(data.draw(st.lists(_some_lengths(S), min_size=B, max_size=B)), dtype=np.int64)
    for b in range(B):
        q[b, :, ql[b] :] = 1e3
        k[b, :, kl[b] :] = -1e3
        v[b, :, kl[b] :] = 1e6
    common: dict[str, Any] = {
        "is_causal": is_causal,
        "window": window,
        "alignment": alignment,
        "softcap": softcap,
        "enable_gqa": group > 1,
    }
    mask = rng.random((B, hq, L, S)) < 0.8 if with_mask else None
    bias = _bias(rng, (B, hq, L, S)) if with_bias else None
    out, weights, lse = _forward(
        q, k, v, mask=mask, bias=bias, query_lengths=ql, key_lengths=kl, **common
    )
    d_out = rng.standard_normal(out.shape)
    grads = scaled_dot_product_attention_vjp(
        q, k, v, d_out, mask=mask, bias=bias, query_lengths=ql, key_lengths=kl, **common
    )
    assert len(grads) == 3 + with_bias
    dq, dk, dv = grads[:3]

    for b in range(B):
        n, m = ql[b], kl[b]
        kw = dict(common)
        if mask is not None:
            kw["mask"] = mask[b, :, :n, :m]
        if bias is not None:
            kw["bias"] = bias[b, :, :n, :m]
        qb, kb, vb = q[b, :, :n], k[b, :, :m], v[b, :, :m]
        e_out, e_w, e_lse = _forward(qb, kb, vb, **kw)
        np.testing.assert_allclose(out[b, :, :n], e_out, **TIGHT)
        np.testing.assert_allclose(weights[b, :, :n, :m], e_w, **TIGHT)
        np.testing.assert_allclose(lse[b, :, :n], e_lse, **TIGHT)
        # padded queries: exact zeros and -inf; padded keys: zero weight
        assert np.all(out[b, :, n:] == 0.0)
        assert np.all(weights[b, :, n:] == 0.0)
        assert np.all(lse[b, :, n:] == -np.inf)
        assert np.all(weights[b, :, :, m:] == 0.0)

        e_grads = scaled_dot_product_attention_vjp(qb, kb, vb, d_out[b, :, :n], **kw)
        np.testing.assert_allclose(dq[b, :, :n], e_grads[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dk[b, :, :m], e_grads[1], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dv[b, :, :m], e_grads[2], rtol=1e-12, atol=1e-12)
        assert np.all(dq[b, :, n:] == 0.0)
        assert np.all(dk[b, :, m:] == 0.0)
        assert np.all(dv[b, :, m:] == 0.0)
        if bias is not None:
            np.testing.assert_allclose(grads[3][b, :, :n, :m], e_grads[3], rtol=1e-12, atol=1e-12)
            assert np.all(grads[3][b, :, n:] == 0.0)
            assert np.all(grads[3][b, :, :, m:] == 0.0)


def test_full_lengths_change_nothing():
    _, q, k, v = _inputs(1, (2,), 2, 2, 4, 6, 3, 2)
    kw = {"is_causal": True, "window": (2, 1), "alignment": "bottom_right", "softcap": 2.0}
    plain = _forward(q, k, v, **kw)
    full = _forward(q, k, v, query_lengths=4, key_lengths=np.array([6, 6]), **kw)
    for a, b in zip(plain, full, strict=True):
        np.testing.assert_array_equal(a, b)


def test_bottom_right_diagonal_is_per_batch_element():
    """A KV cache: element 0 has 2 new queries after 3 cached keys, element 1 has 1 after 5."""
    _, q, k, v = _inputs(2, (2,), 1, 1, 3, 6, 2, 2)
    kw = {"is_causal": True, "alignment": "bottom_right"}
    _, weights, _ = _forward(q, k, v, query_lengths=[2, 1], key_lengths=[5, 6], **kw)
    seen = weights[:, 0] > 0
    np.testing.assert_array_equal(
        seen[0], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        seen[1], [[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    )
    # top-left: the diagonal stays at key i whatever the lengths
    _, weights, _ = _forward(q, k, v, query_lengths=[2, 1], key_lengths=[5, 6], is_causal=True)
    np.testing.assert_array_equal(weights[0, 0, :2] > 0, [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "query_lengths", "key_lengths"),
    [
        pytest.param((3, 2), (4, 2), 2, 3, id="2d_ints"),
        pytest.param((3, 2), (4, 2), np.int8(1), np.array(0), id="2d_numpy_0d"),
        pytest.param((2, 3, 2), (2, 4, 2), 3, 1, id="heads_no_batch"),
        pytest.param((2, 3, 2, 3, 2), (2, 3, 2, 4, 2), [[1], [3]], [0, 2, 4], id="2_batch_axes"),
        pytest.param((2, 1, 3, 2), (1, 2, 4, 2), [2, 0], None, id="broadcast_batch"),
    ],
)
def test_lengths_broadcast_to_the_batch_shape(q_shape, kv_shape, query_lengths, key_lengths):
    rng = np.random.default_rng(3)
    q, k, v = (
        rng.standard_normal(q_shape),
        rng.standard_normal(kv_shape),
        rng.standard_normal(kv_shape),
    )
    got = _forward(q, k, v, query_lengths=query_lengths, key_lengths=key_lengths)
    lead = np.broadcast_shapes(q_shape[:-2], kv_shape[:-2])
    batch = lead[:-1]
    qf, kf, vf = (np.broadcast_to(x, (*lead, *x.shape[-2:])) for x in (q, k, v))
    hq, L, S = (lead[-1] if lead else 1), q_shape[-2], kv_shape[-2]
    four_d = [x.reshape(*batch, hq, *x.shape[-2:]) for x in (qf, kf, vf)]
    kw = {
        "query_lengths": None if query_lengths is None else np.asarray(query_lengths),
        "key_lengths": None if key_lengths is None else np.asarray(key_lengths),
    }
    expected = _brute_force(*four_d, **_restrictions(kw, batch, L, S))
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e.reshape(g.shape), **TIGHT)


# --------------------------------------------------------------------------------------
# 3. packed documents against one call per document
# --------------------------------------------------------------------------------------


@settings(deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["one", "per_token", "contiguous"]),
    n=st.integers(0, 7),
    is_causal=st.booleans(),
    window=st.none() | st.tuples(st.none() | st.integers(0, 2), st.none() | st.integers(0, 2)),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    with_bias=st.booleans(),
)
def test_packed_documents_match_separate_calls(
    seed, kind, n, is_causal, window, alignment, with_bias
):
    rng, q, k, v = _inputs(seed, (2,), 4, 2, n, n, 3, 2)
    seg = np.stack([_segment_layout(kind, n, rng), _segment_layout(kind, n, rng)])
    bias = _bias(rng, (2, 4, n, n)) if with_bias else None
    common = {"is_causal": is_causal, "window": window, "alignment": alignment, "enable_gqa": True}
    out, weights, lse = _forward(q, k, v, bias=bias, segment_ids=(seg, seg), **common)
    d_out = rng.standard_normal(out.shape)
    grads = scaled_dot_product_attention_vjp(
        q, k, v, d_out, bias=bias, segment_ids=(seg, seg), **common
    )
    for b in range(2):
        for doc in np.unique(seg[b]):
            (idx,) = np.nonzero(seg[b] == doc)
            start, stop = idx[0], idx[-1] + 1  # contiguous: one slice per document
            part = slice(start, stop)
            kw = dict(common)
            if bias is not None:
                kw["bias"] = bias[b, :, part, part]
            e_out, e_w, e_lse = _forward(q[b, :, part], k[b, :, part], v[b, :, part], **kw)
            np.testing.assert_allclose(out[b, :, part], e_out, **TIGHT)
            np.testing.assert_allclose(weights[b, :, part, part], e_w, **TIGHT)
            np.testing.assert_allclose(lse[b, :, part], e_lse, **TIGHT)
            others = np.ones(n, dtype=bool)
            others[part] = False
            assert np.all(weights[b, :, part][..., others] == 0.0)
            e_grads = scaled_dot_product_attention_vjp(
                q[b, :, part], k[b, :, part], v[b, :, part], d_out[b, :, part], **kw
            )
            for g, e in zip(grads[:3], e_grads[:3], strict=True):
                np.testing.assert_allclose(g[b, :, part], e, rtol=1e-12, atol=1e-12)
            if bias is not None:
                np.testing.assert_allclose(
                    grads[3][b, :, part, part], e_grads[3], rtol=1e-12, atol=1e-12
                )
                assert np.all(grads[3][b, :, part][..., others] == 0.0)


@settings(deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    q_kind=st.sampled_from(SEGMENT_KINDS),
    k_kind=st.sampled_from(SEGMENT_KINDS),
    L=st.integers(0, 6),
    S=st.integers(0, 6),
)
def test_interleaved_segments_match_gathered_calls(seed, q_kind, k_kind, L, S):
    """Cross-attention with any layout: each id is a call on the tokens that carry it."""
    rng, q, k, v = _inputs(seed, (), 2, 2, L, S, 3, 2)
    q_seg, k_seg = _segment_layout(q_kind, L, rng), _segment_layout(k_kind, S, rng)
    out, weights, lse = _forward(q, k, v, segment_ids=(q_seg, k_seg), softcap=2.0)
    d_out = rng.standard_normal(out.shape)
    dq, dk, dv = scaled_dot_product_attention_vjp(
        q, k, v, d_out, segment_ids=[q_seg, k_seg], softcap=2.0
    )
    expected_dk, expected_dv = np.zeros_like(dk), np.zeros_like(dv)
    for doc in np.unique(q_seg):
        (qi,) = np.nonzero(q_seg == doc)
        (kj,) = np.nonzero(k_seg == doc)
        e_out, e_w, e_lse = _forward(q[:, qi], k[:, kj], v[:, kj], softcap=2.0)
        np.testing.assert_allclose(out[:, qi], e_out, **TIGHT)
        np.testing.assert_allclose(weights[:, qi][:, :, kj], e_w, **TIGHT)
        np.testing.assert_allclose(lse[:, qi], e_lse, **TIGHT)
        e_dq, e_dk, e_dv = scaled_dot_product_attention_vjp(
            q[:, qi], k[:, kj], v[:, kj], d_out[:, qi], softcap=2.0
        )
        np.testing.assert_allclose(dq[:, qi], e_dq, rtol=1e-12, atol=1e-12)
        expected_dk[:, kj] += e_dk
        expected_dv[:, kj] += e_dv
    np.testing.assert_allclose(dk, expected_dk, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, expected_dv, rtol=1e-12, atol=1e-12)
    unused = ~np.isin(k_seg, q_seg)  # keys of a document without queries
    assert np.all(dk[:, unused] == 0.0)
    assert np.all(dv[:, unused] == 0.0)


# --------------------------------------------------------------------------------------
# 4. scale as a 0-d array, and its gradient
# --------------------------------------------------------------------------------------


def _scale_in(library: str) -> Callable[[float], Any]:
    """A maker of 0-d arrays of ``library`` (skipping the test where it is not installed)."""
    if library == "numpy":
        return np.asarray
    if library == "numpy_int":
        return lambda x: np.asarray(int(x))
    if library == "torch":
        torch = pytest.importorskip("torch")
        return lambda x: torch.tensor(x, dtype=torch.float64, requires_grad=True)
    if library == "torch_float32":
        torch = pytest.importorskip("torch")
        return lambda x: torch.tensor(x, dtype=torch.float32)
    if library == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray
    if library == "dask":
        da = pytest.importorskip("dask.array")
        return lambda x: da.from_array(np.asarray(x)) * 1.0
    xp = pytest.importorskip("array_api_strict")
    return lambda x: xp.asarray(x, device=xp.Device("device1"))


SCALE_LIBRARIES = [
    "numpy",
    "numpy_int",
    "torch",
    "torch_float32",
    "jax",
    "dask",
    "array_api_strict",
]


@pytest.mark.parametrize("library", SCALE_LIBRARIES)
def test_scale_as_a_0d_array_of_any_library(library):
    make = _scale_in(library)
    value = 2.0 if library == "numpy_int" else 0.625  # exact in float32 too
    rng, q, k, v = _inputs(4, (2,), 2, 1, 3, 4, 2, 3)
    bias = rng.standard_normal((2, 3, 4))
    kw = {"bias": bias, "enable_gqa": True, "softcap": 1.5}
    as_float = _forward(q, k, v, scale=value, **kw)
    as_array = _forward(q, k, v, scale=make(value), **kw)
    for a, b in zip(as_float, as_array, strict=True):
        np.testing.assert_array_equal(a, b)
    assert intermediates(q, k, v, scale=make(value), **kw)["scale"] == value
    d_out = rng.standard_normal(as_float[0].shape)
    without = scaled_dot_product_attention_vjp(q, k, v, d_out, scale=value, **kw)
    with_ = scaled_dot_product_attention_vjp(q, k, v, d_out, scale=make(value), **kw)
    assert len(without) == 4
    assert len(with_) == 5  # (dq, dk, dv, dbias, dscale)
    for a, b in zip(without, with_[:4], strict=True):
        np.testing.assert_array_equal(a, b)
    d_scale = with_[4]
    assert type(d_scale) is np.ndarray
    assert d_scale.shape == ()
    assert d_scale.dtype == np.float64


@pytest.mark.parametrize("scale", [0.5, 2, np.float32(0.5), np.float64(0.5), np.int64(2)])
def test_numbers_and_numpy_scalars_have_no_scale_gradient(scale):
    _, q, k, v = _inputs(5, (), 1, 1, 3, 4, 2, 3)
    grads = scaled_dot_product_attention_vjp(q, k, v, np.ones((1, 3, 3)), scale=scale)
    assert len(grads) == 3
    with_array = scaled_dot_product_attention_vjp(
        q, k, v, np.ones((1, 3, 3)), scale=np.asarray(scale)
    )
    assert len(with_array) == 4


FD_STEP = 1e-6

#: (id, batch, hq, hkv, L, S, options)
SCALE_GRAD_CASES = [
    ("plain_2d", (), 0, 0, 3, 4, {}),
    ("heads", (2,), 2, 2, 3, 4, {}),
    ("softcap", (2,), 2, 2, 3, 4, {"softcap": 1.2}),
    ("bias_mask", (2,), 2, 2, 3, 4, {"bias": True, "mask": True}),
    ("gqa", (2,), 4, 2, 3, 4, {"enable_gqa": True}),
    (
        "causal_br_lengths",
        (3,),
        2,
        1,
        4,
        5,
        {
            "is_causal": True,
            "alignment": "bottom_right",
            "query_lengths": [4, 2, 0],
            "key_lengths": [5, 3, 2],
            "enable_gqa": True,
        },
    ),
    ("window_segments", (2,), 2, 2, 5, 5, {"window": (1, 1), "segment_ids": True}),
    (
        "everything",
        (2,),
        4,
        2,
        4,
        5,
        {
            "is_causal": True,
            "window": (2, None),
            "alignment": "bottom_right",
            "softcap": 1.5,
            "bias": True,
            "mask": True,
            "enable_gqa": True,
            "query_lengths": [3, 4],
            "key_lengths": [5, 2],
            "segment_ids": True,
        },
    ),
]


def _case(seed, batch, hq, hkv, L, S, options):
    """Inputs and the oracle's keyword arguments for a :data:`SCALE_GRAD_CASES` row."""
    if hq == 0:  # 2-D inputs, no heads axis
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((n, 2)) for n in (L, S, S))
        hq_shape: tuple[int, ...] = ()
    else:
        rng, q, k, v = _inputs(seed, batch, hq, hkv, L, S, 2, 2)
        hq_shape = (*batch, hq)
    kw = dict(options)
    if kw.get("bias"):
        kw["bias"] = rng.standard_normal((*hq_shape, L, S))
    if kw.get("mask"):
        mask = rng.random((*hq_shape, L, S)) < 0.8
        mask[..., 0] = True
        kw["mask"] = mask
    if kw.get("segment_ids"):
        seg = np.sort(rng.integers(0, 2, (*batch, L)), axis=-1)
        k_seg = seg if L == S else np.sort(rng.integers(0, 2, (*batch, S)), axis=-1)
        kw["segment_ids"] = (seg, k_seg)
    return rng, q, k, v, kw


@pytest.mark.parametrize(
    ("batch", "hq", "hkv", "L", "S", "options"),
    [pytest.param(*case[1:], id=case[0]) for case in SCALE_GRAD_CASES],
)
def test_grad_scale_matches_finite_differences(batch, hq, hkv, L, S, options):
    rng, q, k, v, kw = _case(11, batch, hq, hkv, L, S, options)
    scale = 0.8
    out = scaled_dot_product_attention(q, k, v, scale=scale, **kw)
    d_out = rng.standard_normal(out.shape)

    def loss(s: float) -> float:
        return float(np.sum(scaled_dot_product_attention(q, k, v, scale=s, **kw) * d_out))

    expected = (loss(scale + FD_STEP) - loss(scale - FD_STEP)) / (2 * FD_STEP)
    grads = scaled_dot_product_attention_vjp(q, k, v, d_out, scale=np.array(scale), **kw)
    d_scale = grads[-1]
    assert d_scale.shape == ()
    assert float(d_scale) == pytest.approx(expected, rel=1e-6, abs=1e-8)
    # Homogeneity: raw = scale * Q Kᵀ, so scale * dscale = sum(dQ * Q) (a second witness).
    assert float(d_scale) * scale == pytest.approx(
        float(np.sum(grads[0] * q)), rel=1e-10, abs=1e-12
    )


def _finite_difference(q, k, v, d_out, kw):
    """Central differences of ``sum(out * d_out)`` w.r.t. every entry of q, k, v and bias."""
    names = ["q", "k", "v"] + (["bias"] if "bias" in kw else [])
    base = {"q": q, "k": k, "v": v, **({"bias": kw["bias"]} if "bias" in kw else {})}

    def loss(arrays):
        rest = {key: val for key, val in kw.items() if key != "bias"}
        if "bias" in arrays:
            rest["bias"] = arrays["bias"]
        out = scaled_dot_product_attention(arrays["q"], arrays["k"], arrays["v"], **rest)
        return float(np.sum(out * d_out))

    grads = []
    for name in names:
        g = np.zeros_like(base[name])
        for idx in np.ndindex(*g.shape):
            plus = {key: val.copy() for key, val in base.items()}
            minus = {key: val.copy() for key, val in base.items()}
            plus[name][idx] += FD_STEP
            minus[name][idx] -= FD_STEP
            g[idx] = (loss(plus) - loss(minus)) / (2 * FD_STEP)
        grads.append(g)
    return grads


def test_vjp_with_everything_matches_finite_differences():
    rng, q, k, v, kw = _case(12, *SCALE_GRAD_CASES[-1][1:])
    out = scaled_dot_product_attention(q, k, v, **kw)
    d_out = rng.standard_normal(out.shape)
    got = scaled_dot_product_attention_vjp(q, k, v, d_out, **kw)
    expected = _finite_difference(q, k, v, d_out, kw)
    assert len(got) == 4
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-7 * max(1.0, float(np.abs(e).max())))
    # padded queries: no gradient; their cotangent reaches nothing
    assert np.all(got[0][0, :, 3:] == 0.0)
    assert np.all(got[1][1, :, 2:] == 0.0)
    assert np.all(got[2][1, :, 2:] == 0.0)
    assert np.all(got[3][0, :, 3:] == 0.0)
    assert np.all(got[3][1, :, :, 2:] == 0.0)


# --------------------------------------------------------------------------------------
# 5. lengths and segment ids of other libraries
# --------------------------------------------------------------------------------------


def _ints_in(library: str) -> Callable[[Any], Any]:
    if library == "numpy":
        return lambda x: np.asarray(x, dtype=np.uint8)
    if library == "torch":
        torch = pytest.importorskip("torch")
        return lambda x: torch.tensor(x)
    if library == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return lambda x: jnp.asarray(x, dtype=jnp.int32)
    if library == "dask":
        da = pytest.importorskip("dask.array")
        return lambda x: da.from_array(np.asarray(x)) + 0
    xp = pytest.importorskip("array_api_strict")
    return xp.asarray


@pytest.mark.parametrize("library", ["numpy", "torch", "jax", "dask", "array_api_strict"])
def test_lengths_and_segments_of_any_library(library):
    make = _ints_in(library)
    _, q, k, v = _inputs(6, (2,), 2, 2, 4, 4, 2, 2)
    ql, kl, seg = [3, 1], [4, 2], [[0, 0, 1, 1], [0, 1, 1, 2]]
    kw = {"is_causal": True, "alignment": "bottom_right"}
    expected = _forward(q, k, v, query_lengths=ql, key_lengths=kl, segment_ids=(seg, seg), **kw)
    got = _forward(
        q,
        k,
        v,
        query_lengths=make(ql),
        key_lengths=make(kl),
        segment_ids=(make(seg), make(seg)),
        **kw,
    )
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------
# 6. every error, from each of the three functions
# --------------------------------------------------------------------------------------


def _call_forward(q, k, v, **kw):
    return scaled_dot_product_attention(q, k, v, **kw)


def _call_intermediates(q, k, v, **kw):
    return intermediates(q, k, v, **kw)


def _call_vjp(q, k, v, **kw):
    return scaled_dot_product_attention_vjp(q, k, v, np.ones((*q.shape[:-1], v.shape[-1])), **kw)


FUNCTIONS = [
    pytest.param(_call_forward, id="forward"),
    pytest.param(_call_intermediates, id="intermediates"),
    pytest.param(_call_vjp, id="vjp"),
]

_Q = np.ones((2, 3, 4, 2))  # batch (2,), 3 heads, L = 4
_KV = np.ones((2, 3, 5, 2))  # S = 5
_SEG_Q, _SEG_K = np.zeros((2, 4), dtype=np.int64), np.zeros((2, 5), dtype=np.int64)

#: (id, keyword arguments, error, message pattern)
ERRORS = [
    ("scale_zero", {"scale": 0.0}, ValueError, r"scale must be a positive finite"),
    ("scale_negative", {"scale": -1.0}, ValueError, r"scale must be a positive finite"),
    ("scale_inf", {"scale": math.inf}, ValueError, r"scale must be a positive finite"),
    ("scale_nan", {"scale": math.nan}, ValueError, r"scale must be a positive finite"),
    ("scale_0d_negative", {"scale": np.array(-0.5)}, ValueError, r"scale .*positive finite"),
    ("scale_0d_inf", {"scale": np.array(np.inf)}, ValueError, r"scale .*positive finite"),
    ("scale_1d", {"scale": np.array([0.5])}, ValueError, r"scale .*shape \(1,\)"),
    ("scale_2d", {"scale": np.ones((1, 1))}, ValueError, r"scale .*shape \(1, 1\)"),
    ("scale_list", {"scale": [0.5]}, ValueError, r"scale .*shape \(1,\)"),
    ("scale_str", {"scale": "0.5"}, TypeError, r"scale"),
    ("scale_complex", {"scale": 0.5j}, TypeError, r"scale"),
    ("scale_bool", {"scale": True}, TypeError, r"scale"),
    ("scale_bool_0d", {"scale": np.array(True)}, TypeError, r"scale .*bool"),
    ("scale_object", {"scale": object()}, TypeError, r"scale"),
    ("q_lengths_negative", {"query_lengths": [-1, 2]}, ValueError, r"query_lengths .*\[0, 4\]"),
    ("q_lengths_too_long", {"query_lengths": 5}, ValueError, r"query_lengths .*\[0, 4\]"),
    ("k_lengths_too_long", {"key_lengths": [6, 1]}, ValueError, r"key_lengths .*\[0, 5\]"),
    ("k_lengths_negative", {"key_lengths": -1}, ValueError, r"key_lengths .*\[0, 5\]"),
    (
        "q_lengths_float",
        {"query_lengths": np.array([1.0, 2.0])},
        TypeError,
        r"query_lengths .*float64",
    ),
    ("k_lengths_python_float", {"key_lengths": 2.0}, TypeError, r"key_lengths .*integer"),
    ("k_lengths_bool", {"key_lengths": True}, TypeError, r"key_lengths .*integer"),
    ("q_lengths_object", {"query_lengths": object()}, TypeError, r"query_lengths"),
    ("q_lengths_shape", {"query_lengths": [1, 2, 3]}, ValueError, r"query_lengths .*\(2,\)"),
    (
        "k_lengths_heads",
        {"key_lengths": np.ones((2, 3), dtype=int)},
        ValueError,
        r"key_lengths .*batch",
    ),
    ("segments_not_pair", {"segment_ids": _SEG_Q}, TypeError, r"segment_ids .*pair"),
    (
        "segments_triple",
        {"segment_ids": (_SEG_Q, _SEG_K, _SEG_K)},
        TypeError,
        r"segment_ids .*pair",
    ),
    (
        "segments_float",
        {"segment_ids": (_SEG_Q * 1.0, _SEG_K)},
        TypeError,
        r"segment_ids .*float64",
    ),
    ("segments_bool", {"segment_ids": (_SEG_Q, _SEG_K == 0)}, TypeError, r"segment_ids .*bool"),
    (
        "segments_q_shape",
        {"segment_ids": (_SEG_K, _SEG_K)},
        ValueError,
        r"segment_ids.*query.*\(2, 4\)",
    ),
    (
        "segments_k_shape",
        {"segment_ids": (_SEG_Q, _SEG_Q)},
        ValueError,
        r"segment_ids.*key.*\(2, 5\)",
    ),
    (
        "segments_with_heads",
        {"segment_ids": (np.zeros((2, 3, 4), dtype=int), _SEG_K)},
        ValueError,
        r"segment_ids",
    ),
]


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"), [pytest.param(*case[1:], id=case[0]) for case in ERRORS]
)
def test_errors(function, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        function(_Q, _KV, _KV, **kwargs)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_2d_inputs_take_only_0d_lengths(function):
    q, kv = np.ones((4, 2)), np.ones((5, 2))
    function(q, kv, kv, query_lengths=np.array(2), key_lengths=3)
    with pytest.raises(ValueError, match=r"query_lengths of shape \(1,\) .*batch shape \(\)"):
        function(q, kv, kv, query_lengths=[2])
    with pytest.raises(ValueError, match=r"key_lengths .*batch shape \(\)"):
        function(np.ones((2, 4, 2)), kv, kv, key_lengths=[2, 3])  # (2,) is heads, not batch
    with pytest.raises(ValueError, match=r"segment_ids"):
        function(q, kv, kv, segment_ids=(np.zeros((1, 4), dtype=int), np.zeros(5, dtype=int)))
