"""The oracle's ``mask_mod`` and ``bias_mod`` against dense ``mask`` / ``bias`` built in NumPy.

Each mod is written with the index arrays it receives (of the inputs' library, on every
backend) and compared with the oracle given the same restriction or scores as a dense NumPy
array built with explicit index grids or loops here. Rows a mod empties, the index arrays
themselves and the errors are checked on their own.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np
import pytest

from sdpa_array.reference import (
    intermediates,
    scaled_dot_product_attention,
    scaled_dot_product_attention_vjp,
    to_numpy,
)
from sdpa_array.testing import Backend

from .helpers import KV, Q_GQA, Q

# (batch, heads, L, E) of Q and (batch, heads, S, E) of KV: L = 6, S = 7.
L, S = Q[-2], KV[-2]
#: A batch shape of two axes, for the row-major flattening of ``batch``.
BATCH2 = (2, 3)
Q_BATCH2 = (*BATCH2, 2, 3, 2)
KV_BATCH2 = (*BATCH2, 2, 4, 2)
SEGMENTS = np.array([0, 0, 1, 1, 1, 2, 2])  # document of each position (first L for queries)


def _inputs(
    seed: int, q_shape: tuple[int, ...] = Q, kv_shape: tuple[int, ...] = KV
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(q_shape) * 1.5
    k = rng.standard_normal(kv_shape) * 1.5
    v = rng.standard_normal(kv_shape)
    # The output's leading shape; with GQA (more query heads than key heads) the query's.
    lead = q_shape[:-2] if q_shape == Q_GQA else np.broadcast_shapes(q_shape[:-2], kv_shape[:-2])
    d_out = rng.standard_normal((*lead, q_shape[-2], kv_shape[-1]))
    return q, k, v, d_out


def _on(backend: Backend, *arrays: np.ndarray) -> tuple[Any, ...]:
    return tuple(backend.asarray(a, "float64") for a in arrays)


def _xp(x: Any) -> Any:
    return array_api_compat.array_namespace(x)


def _grid(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """NumPy ``(batch, head, i, j)`` grids of ``(*batch, H, L, S)``, batch flattened."""
    *batch, heads, n_q, n_k = shape
    b = np.arange(int(np.prod(batch))).reshape(*batch, 1, 1, 1)
    return b, np.arange(heads)[:, None, None], np.arange(n_q)[:, None], np.arange(n_k)


def _dense(fn: Any, shape: tuple[int, ...]) -> np.ndarray:
    return np.broadcast_to(fn(*_grid(shape)), shape)


# Each mask written twice: as a mod on the backend's arrays, and densely with NumPy loops.
def _causal_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    return i >= j


def _document_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    # SEGMENTS changes at positions 2 and 5: same document iff on the same side of both.
    return ((i >= 2) == (j >= 2)) & ((i >= 5) == (j >= 5))


def _head_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    return j <= i + h  # head h looks h keys ahead of the causal diagonal


def _batch_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    return (j >= b % 4) & (i + b != 6)  # batch element b loses query 6 - b


def _loops(rule: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A dense mask from a rule on Python ints, one ``(b, h, i, j)`` at a time."""
    *batch, heads, n_q, n_k = shape
    out = np.zeros(shape, dtype=bool)
    for flat, index in enumerate(np.ndindex(*batch)):
        for h in range(heads):
            for i in range(n_q):
                for j in range(n_k):
                    position = (*index, h, i, j)
                    out[position] = rule(flat, h, i, j)
    return out


MASK_CASES = {
    "causal": (_causal_mod, lambda b, h, i, j: i >= j),
    "document": (_document_mod, lambda b, h, i, j: SEGMENTS[i] == SEGMENTS[j]),
    "head": (_head_mod, lambda b, h, i, j: j <= i + h),
}


def _check_same(got: Any, want: Any) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_mask_mod_equals_dense_mask(backend: Backend, case: str) -> None:
    mod, rule = MASK_CASES[case]
    q, k, v, d_out = _on(backend, *_inputs(1))
    dense = _loops(rule, (*Q[:-1], S))
    options: dict[str, Any] = {"return_weights": True, "return_lse": True}
    _check_same(
        scaled_dot_product_attention(q, k, v, mask_mod=mod, **options),
        scaled_dot_product_attention(q, k, v, mask=dense, **options),
    )
    _check_same(
        scaled_dot_product_attention_vjp(q, k, v, d_out, mask_mod=mod),
        scaled_dot_product_attention_vjp(q, k, v, d_out, mask=dense),
    )


def test_mask_mod_batch_axes_row_major(backend: Backend) -> None:
    q, k, v, d_out = _on(backend, *_inputs(2, Q_BATCH2, KV_BATCH2))
    shape = (*Q_BATCH2[:-1], KV_BATCH2[-2])
    dense = _loops(lambda b, h, i, j: j >= b % 4 and i + b != 6, shape)
    # Row-major: element 4 is [1, 1] and loses query 2, element 5 is [1, 2] and loses 1.
    assert not dense[1, 1, :, 2].any()
    assert not dense[1, 2, :, 1].any()
    assert dense[1, 1, :, 1].any()
    assert dense[1, 2, :, 2].any()
    options: dict[str, Any] = {"return_weights": True, "return_lse": True}
    _check_same(
        scaled_dot_product_attention(q, k, v, mask_mod=_batch_mod, **options),
        scaled_dot_product_attention(q, k, v, mask=dense, **options),
    )
    _check_same(
        scaled_dot_product_attention_vjp(q, k, v, d_out, mask_mod=_batch_mod),
        scaled_dot_product_attention_vjp(q, k, v, d_out, mask=dense),
    )


def _alibi_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    xp = _xp(h)
    slope = 2.0 ** (-(xp.astype(h, xp.float64) + 1.0))
    return -slope * xp.abs(xp.astype(i - j, xp.float64))


def _alibi_dense(shape: tuple[int, ...]) -> np.ndarray:
    _, h, i, j = _grid(shape)
    return np.broadcast_to(-(2.0 ** -(h + 1.0)) * np.abs(i - j), shape)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_bias_mod_equals_dense_bias(backend: Backend, softcap: float | None) -> None:
    q, k, v, d_out = _on(backend, *_inputs(3))
    bias = _alibi_dense((*Q[:-1], S))
    options: dict[str, Any] = {"softcap": softcap, "return_weights": True, "return_lse": True}
    got = scaled_dot_product_attention(q, k, v, bias_mod=_alibi_mod, **options)
    _check_same(got, scaled_dot_product_attention(q, k, v, bias=bias, **options))
    # Independently: the bias is added after the softcap, before the softmax.
    qn, kn, vn = (to_numpy(x) for x in (q, k, v))
    z = qn @ np.swapaxes(kn, -1, -2) / np.sqrt(Q[-1])
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    z = z + bias
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(got[1], p, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(got[0], p @ vn, rtol=1e-13, atol=1e-14)
    # The VJP: the same gradients as with the dense bias, less the bias's own.
    grads = scaled_dot_product_attention_vjp(q, k, v, d_out, bias_mod=_alibi_mod, softcap=softcap)
    want = scaled_dot_product_attention_vjp(q, k, v, d_out, bias=bias, softcap=softcap)
    _check_same(grads, want[:3])


def test_bias_and_bias_mod_both_added() -> None:
    q, k, v, d_out = _inputs(4)
    rng = np.random.default_rng(5)
    bias = rng.standard_normal((Q[1], L, S))  # broadcast over the batch
    both = bias + _alibi_dense((*Q[:-1], S))
    options: dict[str, Any] = {"softcap": 3.0, "return_weights": True, "return_lse": True}
    got = scaled_dot_product_attention(q, k, v, bias=bias, bias_mod=_alibi_mod, **options)
    want = scaled_dot_product_attention(q, k, v, bias=both, **options)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)
    grads = scaled_dot_product_attention_vjp(
        q, k, v, d_out, bias=bias, bias_mod=_alibi_mod, softcap=3.0
    )
    want_grads = scaled_dot_product_attention_vjp(q, k, v, d_out, bias=both, softcap=3.0)
    assert len(grads) == 4  # q, k, v and bias: nothing for the mod
    assert grads[3].shape == bias.shape
    np.testing.assert_allclose(grads[3], want_grads[3].sum(axis=0), rtol=1e-12, atol=1e-15)
    for g, w in zip(grads[:3], want_grads[:3], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15)


def _empty_rows_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    return (i < 4) & (j != i)  # queries 4 and 5 attend nothing


def _empty_rows_bias_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    xp = _xp(i)
    minus_inf = xp.asarray(-xp.inf, dtype=xp.float64, device=array_api_compat.device(i))
    zero = xp.asarray(0.0, dtype=xp.float64, device=array_api_compat.device(i))
    return xp.where((i < 4) & (j != i), zero, minus_inf)


@pytest.mark.parametrize("kind", ["mask_mod", "bias_mod"])
def test_rows_emptied_by_a_mod(backend: Backend, kind: str) -> None:
    q, k, v, d_out = _on(backend, *_inputs(6))
    mods: dict[str, Any] = {
        kind: {"mask_mod": _empty_rows_mod, "bias_mod": _empty_rows_bias_mod}[kind]
    }
    out, weights, lse = scaled_dot_product_attention(
        q, k, v, return_weights=True, return_lse=True, **mods
    )
    assert np.all(out[..., 4:, :] == 0)
    assert np.all(weights[..., 4:, :] == 0)
    assert np.all(lse[..., 4:] == -np.inf)
    assert np.all(np.isfinite(lse[..., :4]))
    assert np.all(weights[..., :4, :].sum(axis=-1) > 0.999)
    d_q, d_k, d_v = scaled_dot_product_attention_vjp(q, k, v, d_out, **mods)
    assert np.all(d_q[..., 4:, :] == 0)
    # Keys are attended only by queries 0..3: gradients equal those of the cut problem.
    cut = [to_numpy(x) for x in (q, k, v, d_out)]
    cut[0], cut[3] = cut[0][..., :4, :], cut[3][..., :4, :]
    dense = _dense(lambda b, h, i, j: j != i, (*Q[:-2], 4, S))
    want = scaled_dot_product_attention_vjp(*cut, mask=dense)
    np.testing.assert_allclose(d_q[..., :4, :], want[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(d_k, want[1], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(d_v, want[2], rtol=1e-13, atol=1e-15)


def _recorder(calls: list[tuple[Any, ...]], kind: str = "mask_mod") -> Any:
    def mod(b: Any, h: Any, i: Any, j: Any) -> Any:
        calls.append((b, h, i, j))
        out = (i >= 0) & (j >= 0)
        if kind == "bias_mod":
            xp = _xp(i)
            return xp.astype(out, xp.float64) * 0.0
        return out

    return mod


def _check_grids(
    calls: list[tuple[Any, ...]], x: Any, batch: tuple[int, ...], heads: int | None
) -> None:
    assert len(calls) == 1  # evaluated once, on the full grid
    b, h, i, j = calls[0]
    device = array_api_compat.device(x)
    for a in (b, h, i, j):
        assert type(a) is type(x)
        assert array_api_compat.device(a) == device
        assert to_numpy(a).dtype.kind == "i"
    if heads is None:
        assert tuple(b.shape) == ()
        assert tuple(h.shape) == ()
        assert to_numpy(b) == 0
        assert to_numpy(h) == 0
    else:
        assert tuple(b.shape) == (*batch, 1, 1, 1)
        np.testing.assert_array_equal(
            to_numpy(b)[..., 0, 0, 0], np.arange(int(np.prod(batch))).reshape(batch)
        )
        assert tuple(h.shape) == (heads, 1, 1)
        np.testing.assert_array_equal(to_numpy(h)[:, 0, 0], np.arange(heads))
    np.testing.assert_array_equal(to_numpy(i), np.arange(L)[:, None])
    np.testing.assert_array_equal(to_numpy(j), np.arange(S))


@pytest.mark.parametrize("kind", ["mask_mod", "bias_mod"])
def test_index_arrays_of_the_inputs_library(backend: Backend, kind: str) -> None:
    q, k, v, d_out = _on(backend, *_inputs(7))
    calls: list[tuple[Any, ...]] = []
    mods: dict[str, Any] = {kind: _recorder(calls, kind)}
    scaled_dot_product_attention(q, k, v, **mods)
    _check_grids(calls, q, (Q[0],), Q[1])
    calls.clear()
    grads = scaled_dot_product_attention_vjp(q, k, v, d_out, **mods)
    _check_grids(calls, q, (Q[0],), Q[1])
    assert len(grads) == 3


def test_index_arrays_without_heads_axis(backend: Backend) -> None:
    q, k, v, _ = _on(backend, *_inputs(8))
    calls: list[tuple[Any, ...]] = []
    q2, k2, v2 = (x[0, 0, ...] for x in (q, k, v))
    out: Any = scaled_dot_product_attention(q2, k2, v2, mask_mod=_recorder(calls))
    assert out.shape == (L, KV[-1])
    _check_grids(calls, q, (), None)


def test_index_arrays_gqa_and_broadcast_batch() -> None:
    # GQA: the heads are the query heads.
    q, k, v, _ = _inputs(9, Q_GQA, KV)
    calls: list[tuple[Any, ...]] = []
    scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod=_recorder(calls))
    _check_grids(calls, q, (Q_GQA[0],), Q_GQA[1])
    # The batch shape broadcasts the leading axes of all three inputs, less the heads.
    calls.clear()
    q, k, v, _ = _inputs(9, (3, 1, L, 4), (2, 1, 2, S, 4))
    out: Any = scaled_dot_product_attention(q, k, v, mask_mod=_recorder(calls))
    assert out.shape == (2, 3, 2, L, 4)
    _check_grids(calls, q, (2, 3), 2)
    # Only the value has batch axes.
    calls.clear()
    q, k, _, _ = _inputs(9, (1, L, 4), (1, S, 4))
    v = np.ones((5, 1, S, 4))
    scaled_dot_product_attention(q, k, v, bias_mod=_recorder(calls, "bias_mod"))
    _check_grids(calls, q, (5,), 1)


def test_mask_mod_with_other_restrictions() -> None:
    q, k, v, d_out = _inputs(10)
    options: dict[str, Any] = {
        "is_causal": True,
        "window": (3, None),
        "alignment": "bottom_right",
        "key_lengths": np.array([7, 5]),
        "query_lengths": np.array([6, 4]),
        "segment_ids": (SEGMENTS[:L], SEGMENTS),
    }
    mask = np.ones((2, 1, L, S), dtype=bool)
    mask[..., 1] = False
    dense = _loops(lambda b, h, i, j: (i + j + h) % 5 != 0, (*Q[:-1], S))
    mod = lambda b, h, i, j: (i + j + h) % 5 != 0  # noqa: E731
    got = scaled_dot_product_attention(
        q, k, v, mask=mask, mask_mod=mod, return_weights=True, return_lse=True, **options
    )
    want = scaled_dot_product_attention(
        q, k, v, mask=mask & dense, return_weights=True, return_lse=True, **options
    )
    _check_same(got, want)
    _check_same(
        scaled_dot_product_attention_vjp(q, k, v, d_out, mask=mask, mask_mod=mod, **options),
        scaled_dot_product_attention_vjp(q, k, v, d_out, mask=mask & dense, **options),
    )
    inter = intermediates(q, k, v, mask=mask, mask_mod=mod, bias_mod=_alibi_mod, **options)
    want_inter = intermediates(
        q, k, v, mask=mask & dense, bias=_alibi_dense(dense.shape), **options
    )
    np.testing.assert_array_equal(inter["allowed"], want_inter["allowed"])
    np.testing.assert_array_equal(inter["z"], want_inter["z"])


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------

FUNCTIONS = {
    "forward": lambda q, k, v, g, **kw: scaled_dot_product_attention(q, k, v, **kw),
    "intermediates": lambda q, k, v, g, **kw: intermediates(q, k, v, **kw),
    "vjp": lambda q, k, v, g, **kw: scaled_dot_product_attention_vjp(q, k, v, g, **kw),
}


@pytest.fixture(params=sorted(FUNCTIONS))
def call(request: pytest.FixtureRequest) -> Any:
    fn = FUNCTIONS[request.param]
    q, k, v, d_out = _inputs(11)
    return lambda **kw: fn(q, k, v, d_out, **kw)


@pytest.mark.parametrize("kind", ["mask_mod", "bias_mod"])
def test_mod_not_callable(call: Any, kind: str) -> None:
    with pytest.raises(TypeError, match=kind):
        call(**{kind: np.ones((L, S), dtype=bool)})
    # Before any other work: even before the other arguments are checked.
    with pytest.raises(TypeError, match=kind):
        call(**{kind: "causal"}, alignment="nowhere")


@pytest.mark.parametrize("kind", ["mask_mod", "bias_mod"])
def test_mod_raises(call: Any, kind: str) -> None:
    def broken(b: Any, h: Any, i: Any, j: Any) -> Any:
        raise KeyError("no such index")

    with pytest.raises(ValueError, match=f"{kind} raised KeyError") as info:
        call(**{kind: broken})
    assert isinstance(info.value.__cause__, KeyError)

    def wrong_arity(b: Any, h: Any) -> Any:
        return b

    with pytest.raises(ValueError, match=kind) as info:
        call(**{kind: wrong_arity})
    assert isinstance(info.value.__cause__, TypeError)


@pytest.mark.parametrize(
    ("kind", "result", "dtype"),
    [
        ("mask_mod", lambda i, j: (i >= j).astype(np.int64), "int64"),
        ("mask_mod", lambda i, j: (i >= j) * 1.0, "float64"),
        ("bias_mod", lambda i, j: i - j, "int64"),
        ("bias_mod", lambda i, j: i >= j, "bool"),
        ("bias_mod", lambda i, j: (i - j) * 1j, "complex128"),
    ],
)
def test_mod_wrong_dtype(call: Any, kind: str, result: Any, dtype: str) -> None:
    with pytest.raises(TypeError, match=f"{kind}.*{dtype}"):
        call(**{kind: lambda b, h, i, j: result(i, j)})


@pytest.mark.parametrize("kind", ["mask_mod", "bias_mod"])
@pytest.mark.parametrize("shape", [(S + 1,), (L, 1, 1), (1, *Q[:-1], S), (3, 1, 1, 1)])
def test_mod_wrong_shape(call: Any, kind: str, shape: tuple[int, ...]) -> None:
    value = np.zeros(shape, dtype=bool if kind == "mask_mod" else np.float64)
    with pytest.raises(ValueError, match=kind) as info:
        call(**{kind: lambda b, h, i, j: value})
    message = str(info.value)
    assert str(shape) in message
    assert str((*Q[:-1], S)) in message


def test_mod_scalar_results() -> None:
    q, k, v, _ = _inputs(12)
    plain = scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(
        scaled_dot_product_attention(q, k, v, mask_mod=lambda b, h, i, j: True), plain
    )
    np.testing.assert_array_equal(
        scaled_dot_product_attention(q, k, v, bias_mod=lambda b, h, i, j: 0.0), plain
    )
    out = scaled_dot_product_attention(q, k, v, mask_mod=lambda b, h, i, j: False)
    assert np.all(out == 0)
