"""Merging partial attention results: :func:`sdpa_array.merge_attention_states`.

The keys of one attention call are split into ``n`` disjoint parts: contiguous ranges (some
of them empty, ``S_i = 0``) or interleaved sets chosen by masks, with rows that have no key
in some part or in every part. Each part's ``(out, lse)`` comes from the library's own
``scaled_dot_product_attention(..., return_lse=True)`` on the backend under test, and their
merge is compared with the float64 oracle over all the keys. The merge alone, its gradients
(torch autograd, ``jax.grad``), ``jax.jit``/``jax.vmap``, Dask's laziness and every misuse
are tested too.

Error bound of the merge
------------------------
Merging is attention over ``n`` "keys" whose scores are the parts' log-sum-exps and whose
values are the parts' outputs: one query per row, ``Q Kᵀ = 0``, the ``lse_i`` entering as a
bias (:func:`merge_view` builds exactly that call for the oracle). So the bounds of
:mod:`sdpa_array.testing.bounds` apply with ``S = n`` and

* the score error ``ds_merge = e_lse + 2 u_c max|lse_i|``: the bias term of
  :func:`~sdpa_array.testing.bounds.score_error` covers the rounding of ``lse_i - m``, and
  the parts' own log-sum-exp error ``e_lse`` perturbs the scores like a score error does
  (the log-sum-exp is 1-Lipschitz; the softmax turns it into relative weight errors of at
  most ``2 e_lse``);
* the parts' own output error ``e_out``, carried unchanged through the convex combination.

Hence, first order, with ``out*`` and ``lse*`` the oracle over all keys:

* ``|out - out*| <= e_out + output_bound(dtype, S=n, ds=ds_merge, v_max=max|out_i|,
  out_max=max|out*|)``;
* ``|lse - lse*| <= lse_bound(dtype, S=n, ds=ds_merge, lse_max=max|lse*|)``;

where ``e_out`` and ``e_lse`` are the largest of the parts' own bounds (``output_bound`` and
``lse_bound`` with ``S = S_i``, which the attention tests hold the library to). When the
parts are given exactly (the merge alone: the oracle receives the rounded parts),
``e_out = e_lse = 0``.

The gradients are those of the same attention call, so
:func:`~sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds` gives the oracle and an element-wise
bound for the outputs' cotangent; the log-sum-exp's cotangent ``g_lse`` adds ``g_lse * P_i``
to the gradient of ``lse_i``, with ``P_i = w_i / sum_j w_j`` (the weights, off by at most
``output_bound(dtype, S=n, ds, v_max=1, out_max=1)``) and one rounding ``u_c`` of the sum.
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sdpa_array
from sdpa_array import merge_attention_states, reference
from sdpa_array._arrays.compat import array_namespace
from sdpa_array.testing import Backend, get_backend
from tests.helpers import (
    UNIT_ROUNDOFF,
    assert_array_like,
    assert_close,
    assert_within,
    compute_dtype,
    lse_bound,
    output_bound,
    rounded,
    score_error,
    vjp_oracle_and_bounds,
)

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

E, EV = 4, 3
BATCH = (2, 3)

#: A part: which keys (a slice of the key axis) and which of those it may attend (a boolean
#: selection of the sliced keys, or None for all of them).
Part = tuple[slice, "np.ndarray | None"]


def contiguous(S: int, points: Sequence[int]) -> list[Part]:
    """Contiguous ranges cut at ``points`` (repeated points and 0 or S give empty parts)."""
    bounds = [0, *sorted(points), S]
    return [(slice(a, b), None) for a, b in itertools.pairwise(bounds)]


def interleaved(owner: np.ndarray, n: int) -> list[Part]:
    """Part ``i`` is every key with ``owner == i``, chosen by a mask over all the keys."""
    return [(slice(None), owner == i) for i in range(n)]


def finite_max(a: np.ndarray) -> float:
    finite = np.abs(a[np.isfinite(a)])
    return float(np.max(finite)) if finite.size else 0.0


def merge_score_error(dtype: str, lses: np.ndarray) -> float:
    """Score error of the merge seen as attention whose scores are the lses (a bias, with
    ``Q Kᵀ = 0``): the bias term of ``score_error``, ``2 u_c max|lse_i|``."""
    zeros = np.zeros((1, 1))
    return score_error(dtype, zeros, zeros, 1.0, bias=lses)


def merge_view(outs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, ...]:
    """The merge as one attention call (host float64): per row one query, ``n`` keys with
    ``Q Kᵀ = 0``, the lses as the bias and the outputs as the values.

    Returns ``(q, k, v, bias)`` of shapes ``(..., L, 1, 1)``, ``(..., L, n, 1)``,
    ``(..., L, n, Ev)`` and ``(..., L, 1, n)``.
    """
    n, rows = outs.shape[0], outs.shape[1:-1]
    q, k = np.zeros((*rows, 1, 1)), np.zeros((*rows, n, 1))
    return q, k, np.moveaxis(outs, 0, -2), np.moveaxis(lses, 0, -1)[..., None, :]


def merge_oracle(outs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, ...]:
    """The oracle's merge ``(out, lse, weights)``; weights of shape ``(n, ..., L)``."""
    q, k, v, bias = merge_view(outs, lses)
    out, w, lse = reference.scaled_dot_product_attention(
        q, k, v, bias=bias, return_weights=True, return_lse=True
    )
    return out[..., 0, :], lse[..., 0], np.moveaxis(w[..., 0, :], -1, 0)


def lse_dtype_of(like: Any, dtype: str) -> Any:
    """The compute dtype, in the library of ``like``."""
    return getattr(array_namespace({"like": like}), compute_dtype(dtype))


def host(x: Any) -> np.ndarray:
    return reference.to_numpy(x).astype(np.float64)


# --------------------------------------------------------------------------------------
# Parts from the library's attention, merged, against the oracle over all the keys
# --------------------------------------------------------------------------------------


def check_merge_of_parts(
    backend: Backend,
    dtype: str,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    parts: list[Part],
) -> None:
    """Attend to each part on ``backend``, merge (as a list and stacked), and check the merge
    against the oracle over all keys within the bound of the module docstring."""
    (xq, q64), (_, k64), (_, v64) = (rounded(backend, a, dtype) for a in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / np.sqrt(E)
    ds = score_error(dtype, q64, k64, scale)  # all keys: bounds every part's score error
    v_max = float(np.max(np.abs(v64))) if v64.size else 0.0
    outs, lses, e_out, e_lse = [], [], 0.0, 0.0
    for keys, select in parts:
        k_i, v_i = k64[..., keys, :], v64[..., keys, :]
        m_i = None
        if mask is not None or select is not None:
            m_i = (np.ones((L, S), bool) if mask is None else mask)[:, keys]
            m_i = m_i & (True if select is None else select)
        x_mask = None if m_i is None else backend.asarray(m_i)
        o, lse = sdpa_array.scaled_dot_product_attention(
            xq,
            backend.asarray(k_i, dtype),
            backend.asarray(v_i, dtype),
            mask=x_mask,
            return_lse=True,
        )
        outs.append(o)
        lses.append(lse)
        ref_o, ref_l = reference.scaled_dot_product_attention(
            q64, k_i, v_i, mask=m_i, return_lse=True
        )
        S_i = k_i.shape[-2]
        out_max_i = float(np.max(np.abs(ref_o))) if ref_o.size else 0.0
        e_out = max(e_out, output_bound(dtype, S=S_i, ds=ds, v_max=v_max, out_max=out_max_i))
        e_lse = max(e_lse, lse_bound(dtype, S=S_i, ds=ds, lse_max=finite_max(ref_l)))

    out, lse = merge_attention_states(outs, lses)
    xp = array_namespace({"out": out})
    stacked = merge_attention_states(xp.stack(outs), xp.stack(lses))
    for a, b in zip((out, lse), stacked, strict=True):
        np.testing.assert_array_equal(host(a), host(b), err_msg="list and stacked differ")

    ref_out, ref_lse = reference.scaled_dot_product_attention(
        q64, k64, v64, mask=mask, return_lse=True
    )
    outs64, lses64 = np.stack([host(o) for o in outs]), np.stack([host(s) for s in lses])
    n = len(parts)
    ds_merge = e_lse + merge_score_error(dtype, lses64)
    out_max = float(np.max(np.abs(ref_out))) if ref_out.size else 0.0
    parts_max = float(np.max(np.abs(outs64))) if outs64.size else 0.0
    out_bound = e_out + output_bound(dtype, S=n, ds=ds_merge, v_max=parts_max, out_max=out_max)
    assert_array_like(out, xq, shape=ref_out.shape, dtype=xq.dtype)
    assert_array_like(lse, xq, shape=ref_lse.shape, dtype=lse_dtype_of(xq, dtype))
    assert_close(out, ref_out, out_bound, "out")
    lse_max = finite_max(ref_lse)
    assert_close(lse, ref_lse, lse_bound(dtype, S=n, ds=ds_merge, lse_max=lse_max), "lse")
    dead = ref_lse == -np.inf  # rows with no key in any part: exact zeros, lse -inf
    assert np.all(host(out)[dead] == 0)


def draw_inputs(seed_text: str, L: int, S: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()))
    q = rng.standard_normal((*BATCH, L, E)) * 2.0
    k, v = rng.standard_normal((*BATCH, S, E)), rng.standard_normal((*BATCH, S, EV))
    return q, k, v, rng


def _dead_rows_mask(rng: np.random.Generator, L: int, S: int) -> np.ndarray:
    mask = rng.random((L, S)) > 0.4
    mask[1] = False  # no key at all
    mask[3] = False
    mask[3, -1] = True  # a key in the last part only
    return mask


def _owner(rng: np.random.Generator, S: int, n: int) -> np.ndarray:
    owner = rng.integers(0, n - 1, size=S)  # part n - 1 owns no key
    owner[0] = 0
    return owner


#: (id, L, S, how the keys are split, whether rows lose keys to a mask)
CASES = [
    ("two-contiguous", 5, 9, lambda rng, S: contiguous(S, [4]), False),
    ("one-part", 5, 9, lambda rng, S: contiguous(S, []), False),
    ("empty-middle-part", 5, 9, lambda rng, S: contiguous(S, [3, 3]), False),
    ("empty-first-and-last", 5, 9, lambda rng, S: contiguous(S, [0, 9]), False),
    ("no-keys-at-all", 5, 0, lambda rng, S: contiguous(S, [0]), False),
    ("contiguous-dead-rows", 5, 9, lambda rng, S: contiguous(S, [4, 6]), True),
    ("interleaved", 5, 9, lambda rng, S: interleaved(_owner(rng, S, 4), 4), False),
    ("interleaved-dead-rows", 5, 9, lambda rng, S: interleaved(_owner(rng, S, 3), 3), True),
    ("single-query", 1, 7, lambda rng, S: contiguous(S, [2, 5]), False),
]


@pytest.mark.parametrize(
    ("case_id", "L", "S", "split", "dead_rows"), CASES, ids=[c[0] for c in CASES]
)
def test_merge_of_parts_matches_oracle(backend_dtype, case_id, L, S, split, dead_rows):
    backend, dtype = backend_dtype
    q, k, v, rng = draw_inputs(case_id, L, S)
    mask = _dead_rows_mask(rng, L, S) if dead_rows else None
    check_merge_of_parts(backend, dtype, q, k, v, mask, split(rng, S))


@st.composite
def splits(draw: st.DrawFn, dtypes: tuple[str, ...]) -> dict:
    n = draw(st.integers(1, 5))
    L, S = draw(st.integers(0, 6)), draw(st.integers(0, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        parts = contiguous(S, draw(st.lists(st.integers(0, S), min_size=n - 1, max_size=n - 1)))
    else:
        parts = interleaved(rng.integers(0, n, size=S), n)
    mask = None
    if draw(st.booleans()):
        mask = rng.random((L, S)) > draw(st.sampled_from([0.3, 0.85]))  # 0.85: many dead rows
    q = rng.standard_normal((*BATCH, L, E)) * draw(st.sampled_from([0.5, 1.0, 4.0]))
    k, v = rng.standard_normal((*BATCH, S, E)), rng.standard_normal((*BATCH, S, EV))
    return {
        "dtype": draw(st.sampled_from(dtypes)),
        "q": q,
        "k": k,
        "v": v,
        "mask": mask,
        "parts": parts,
    }


@given(data=st.data())
def test_random_splits_match_oracle(backend, data):
    call = data.draw(splits(backend.dtypes))
    check_merge_of_parts(backend, call.pop("dtype"), **call)


# --------------------------------------------------------------------------------------
# The merge alone: parts given exactly, oracle = the merge as attention
# --------------------------------------------------------------------------------------


def random_parts(seed: int, n: int, rows: tuple[int, ...], Ev: int = EV) -> tuple[np.ndarray, ...]:
    """Parts as attention returns them: some empty for some rows (lse ``-inf``, output
    zeros), rows 0 of every batch entry empty in every part, lses spread over ``[-6, 6]``."""
    rng = np.random.default_rng(seed)
    lses = rng.uniform(-6.0, 6.0, (n, *rows))
    lses[rng.random(lses.shape) < 0.3] = -np.inf
    lses[..., 0] = -np.inf
    outs = rng.standard_normal((n, *rows, Ev))
    outs[lses == -np.inf] = 0.0
    return outs, lses, rng


def check_merge_alone(out: Any, lse: Any, like: Any, dtype: str, o64, l64) -> None:
    """``(out, lse)`` is the merge of the rounded parts ``o64``, ``l64``: check it."""
    ref_out, ref_lse, _ = merge_oracle(o64, l64)
    ds = merge_score_error(dtype, l64)
    out_max = float(np.max(np.abs(ref_out))) if ref_out.size else 0.0
    n = o64.shape[0]
    bound = output_bound(dtype, S=n, ds=ds, v_max=float(np.max(np.abs(o64))), out_max=out_max)
    assert_array_like(out, like, shape=ref_out.shape, dtype=like.dtype)
    assert_array_like(lse, like, shape=ref_lse.shape, dtype=lse_dtype_of(like, dtype))
    assert_close(out, ref_out, bound, "out")
    assert_close(lse, ref_lse, lse_bound(dtype, S=n, ds=ds, lse_max=finite_max(ref_lse)), "lse")
    assert np.all(host(out)[ref_lse == -np.inf] == 0)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_merge_alone_matches_oracle(backend_dtype, n):
    backend, dtype = backend_dtype
    outs, lses, _ = random_parts(n, n, (*BATCH, 4))
    (xo, o64), (xl, l64) = (
        rounded(backend, outs, dtype),
        rounded(backend, lses, compute_dtype(dtype)),
    )
    out, lse = merge_attention_states(xo, xl)
    check_merge_alone(out, lse, xo, dtype, o64, l64)


def test_empty_parts_are_exactly_neutral(backend_dtype):
    """One part is returned unchanged, with or without empty parts beside it; an all-empty
    row gives exact zeros and ``-inf``."""
    backend, dtype = backend_dtype
    rng = np.random.default_rng(1)
    (xo, o64), (xl, l64) = (
        rounded(backend, rng.standard_normal((*BATCH, 4, EV)), dtype),
        rounded(backend, rng.standard_normal((*BATCH, 4)), compute_dtype(dtype)),
    )
    zeros = backend.asarray(np.zeros((*BATCH, 4, EV)), dtype)
    empty = backend.asarray(np.full((*BATCH, 4), -np.inf), compute_dtype(dtype))
    for outs, lses in (([xo], [xl]), ([zeros, xo, zeros], [empty, xl, empty])):
        out, lse = merge_attention_states(outs, lses)
        np.testing.assert_array_equal(host(out), o64)
        np.testing.assert_array_equal(host(lse), l64)
    out, lse = merge_attention_states([zeros, zeros], [empty, empty])
    np.testing.assert_array_equal(host(out), np.zeros((*BATCH, 4, EV)))
    np.testing.assert_array_equal(host(lse), np.full((*BATCH, 4), -np.inf))


def test_outputs_of_empty_parts_are_ignored(backend_dtype):
    """Whatever an empty part's output holds (NaN, inf: some kernels give NaN for a row with
    no key), the merge is the same as with zeros there."""
    backend, dtype = backend_dtype
    outs, lses, _ = random_parts(3, 3, (*BATCH, 4))
    garbage = outs.copy()
    garbage[lses == -np.inf] = np.nan
    garbage[0, ..., 0, 0] = np.inf
    xl = backend.asarray(lses, compute_dtype(dtype))
    clean = merge_attention_states(backend.asarray(outs, dtype), xl)
    dirty = merge_attention_states(backend.asarray(garbage, dtype), xl)
    for a, b in zip(clean, dirty, strict=True):
        np.testing.assert_array_equal(host(a), host(b))


def test_wider_lses_are_rounded_to_the_compute_dtype(float64_backend):
    """float64 lses with float32 (or narrower) outputs: the lse comes back in the compute
    dtype, as if the lses had been rounded to it first."""
    backend = float64_backend
    outs, lses, _ = random_parts(4, 3, (*BATCH, 4))
    for dtype in (d for d in backend.dtypes if compute_dtype(d) == "float32"):
        xo = backend.asarray(outs, dtype)
        wide = merge_attention_states(xo, backend.asarray(lses, "float64"))
        narrow = merge_attention_states(xo, backend.asarray(lses, "float32"))
        assert wide[1].dtype == narrow[1].dtype == lse_dtype_of(xo, dtype)
        for a, b in zip(wide, narrow, strict=True):
            np.testing.assert_array_equal(host(a), host(b))


# --------------------------------------------------------------------------------------
# Transforms, laziness, gradients
# --------------------------------------------------------------------------------------


def test_jax_jit_and_vmap(jax_backend):
    import jax

    dtype = "float32"
    outs, lses, _ = random_parts(5, 3, (*BATCH, 4))
    (xo, o64), (xl, l64) = rounded(jax_backend, outs, dtype), rounded(jax_backend, lses, dtype)
    out, lse = jax.jit(merge_attention_states)(list(xo), list(xl))  # sequences under jit
    check_merge_alone(out, lse, xo, dtype, o64, l64)
    out, lse = jax.vmap(merge_attention_states, in_axes=(1, 1))(xo, xl)  # over BATCH[0]
    check_merge_alone(out, lse, xo, dtype, o64, l64)


def test_dask_stays_lazy():
    """Validating, stacking and merging Dask arrays computes nothing."""
    pytest.importorskip("dask.array")
    import dask

    backend = get_backend("dask")
    dtype = "float32"
    outs, lses, _ = random_parts(6, 3, (*BATCH, 4))
    (xo, o64), (xl, l64) = rounded(backend, outs, dtype), rounded(backend, lses, dtype)

    def forbid(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("merge_attention_states computed a Dask graph")

    with dask.config.set(scheduler=forbid):
        merged = merge_attention_states(xo, xl)
        from_lists = merge_attention_states(list(xo), list(xl))
    for out, lse in (merged, from_lists):
        check_merge_alone(out, lse, xo, dtype, o64, l64)


def gradient_oracle(dtype: str, o64, l64, g_out, g_lse) -> tuple[np.ndarray, ...]:
    """Expected gradients of ``sum(out * g_out) + sum(lse * g_lse)`` (finite lse only) with
    respect to the outs and lses, and their bounds (module docstring)."""
    q, k, v, bias = merge_view(o64, l64)
    (_, _, dv, dbias), (_, _, bv, bbias) = vjp_oracle_and_bounds(
        dtype, q, k, v, g_out[..., None, :], bias=bias
    )
    _, _, weights = merge_oracle(o64, l64)
    d_outs, b_outs = np.moveaxis(dv, -2, 0), np.moveaxis(bv, -2, 0)
    from_lse = g_lse * weights
    d_lses = np.moveaxis(dbias[..., 0, :], -1, 0) + from_lse
    weights_bound = output_bound(
        dtype, S=o64.shape[0], ds=merge_score_error(dtype, l64), v_max=1.0, out_max=1.0
    )
    b_lses = (
        np.moveaxis(bbias[..., 0, :], -1, 0)
        + np.abs(g_lse) * weights_bound * (weights > 0)
        + UNIT_ROUNDOFF[compute_dtype(dtype)] * np.abs(d_lses)
    )
    return d_outs, b_outs, d_lses, b_lses


def check_gradients(grads, xo, xl, dtype, o64, l64, g_out, g_lse) -> None:
    d_outs, b_outs, d_lses, b_lses = gradient_oracle(dtype, o64, l64, g_out, g_lse)
    for name, g, x, e, b in (
        ("d outs", grads[0], xo, d_outs, b_outs),
        ("d lses", grads[1], xl, d_lses, b_lses),
    ):
        assert_array_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(g, e, b, name)  # no NaN; exact zeros where a part is empty
    empty = l64 == -np.inf
    assert np.all(host(grads[0])[empty] == 0)
    assert np.all(host(grads[1])[empty] == 0)


def gradient_inputs(backend: Backend, dtype: str) -> tuple[Any, ...]:
    outs, lses, rng = random_parts(7, 3, (*BATCH, 4))
    (xo, o64), (xl, l64) = (
        rounded(backend, outs, dtype),
        rounded(backend, lses, compute_dtype(dtype)),
    )
    (xg, g_out), (xgl, g_lse) = (
        rounded(backend, rng.standard_normal((*BATCH, 4, EV)), dtype),
        rounded(backend, rng.standard_normal((*BATCH, 4)), compute_dtype(dtype)),
    )
    return xo, o64, xl, l64, xg, g_out, xgl, g_lse


@pytest.mark.parametrize("as_list", [False, True], ids=["stacked", "list"])
def test_torch_autograd(torch_backend_dtype, as_list):
    import torch

    backend, dtype = torch_backend_dtype
    xo, o64, xl, l64, xg, g_out, xgl, g_lse = gradient_inputs(backend, dtype)
    xo, xl = xo.requires_grad_(True), xl.requires_grad_(True)
    out, lse = merge_attention_states(*((list(xo), list(xl)) if as_list else (xo, xl)))
    loss = (out * xg).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * xgl).sum()
    grads = torch.autograd.grad(loss, (xo, xl))
    check_gradients(grads, xo, xl, dtype, o64, l64, g_out, g_lse)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_grad(jax_backend_dtype, jit):
    import jax
    import jax.numpy as jnp

    backend, dtype = jax_backend_dtype
    xo, o64, xl, l64, xg, g_out, xgl, g_lse = gradient_inputs(backend, dtype)

    def loss(outs, lses):
        out, lse = merge_attention_states(outs, lses)
        return (out * xg).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * xgl).sum()

    grad = jax.grad(loss, argnums=(0, 1))
    if jit:
        grad = jax.jit(grad)
    check_gradients(grad(xo, xl), xo, xl, dtype, o64, l64, g_out, g_lse)
    # through sequences: one gradient per part
    d_outs, d_lses = grad(list(xo), list(xl))
    stacked = (jnp.stack(d_outs), jnp.stack(d_lses))
    check_gradients(stacked, xo, xl, dtype, o64, l64, g_out, g_lse)


def test_torch_gradients_ignore_outputs_of_empty_parts(torch_backend):
    """NaN in an empty part's output reaches neither the result nor the gradients."""
    import torch

    outs, lses, _ = random_parts(8, 3, (*BATCH, 4))
    outs[lses == -np.inf] = np.nan
    xo = torch_backend.asarray(outs, "float32").requires_grad_(True)
    xl = torch_backend.asarray(lses, "float32").requires_grad_(True)
    out, lse = merge_attention_states(xo, xl)
    d_outs, d_lses = torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), (xo, xl))
    assert not torch.isnan(out).any()
    assert not torch.isnan(lse).any()
    assert torch.isfinite(d_outs).all()
    assert torch.isfinite(d_lses).all()
    empty = torch_backend.asarray(lses == -np.inf)
    assert (d_outs[empty] == 0).all()
    assert (d_lses[empty] == 0).all()


# --------------------------------------------------------------------------------------
# Misuse: every argument, before any work
# --------------------------------------------------------------------------------------

F = np.float32
OUTS = np.zeros((3, 2, 4, 5), F)
LSES = np.zeros((3, 2, 4), F)

BAD = [
    ("outs not an array", "abc", LSES, TypeError, r"outs must be an array .*builtins\.str"),
    ("outs None", None, LSES, TypeError, r"outs must be an array, got None"),
    ("lses not an array", OUTS, 1.5, TypeError, r"lses must be an array .*builtins\.float"),
    ("part not an array", [OUTS[0], 1.0, OUTS[2]], LSES, TypeError, r"outs\[1\] must be an array "),
    ("lses part None", OUTS, [LSES[0], None, LSES[2]], TypeError, r"lses\[1\] must be an array"),
    (
        "no outs",
        [],
        LSES,
        ValueError,
        r"outs must hold at least one part \(n >= 1\), got an "
        "empty list",
    ),
    (
        "no lses",
        OUTS,
        (),
        ValueError,
        r"lses must hold at least one part \(n >= 1\), got an "
        "empty tuple",
    ),
    (
        "n = 0",
        OUTS[:0],
        LSES[:0],
        ValueError,
        r"outs must hold at least one part \(n >= 1\), got "
        r"outs of shape \(0, 2, 4, 5\)",
    ),
    (
        "outs 2-d",
        OUTS[0, 0],
        LSES[0, 0],
        ValueError,
        r"outs must have shape \(n, \.\.\., L, Ev\) "
        r".*at least 3 dimensions; got outs of shape \(4, 5\)",
    ),
    (
        "parts 1-d",
        [OUTS[0, 0, 0]],
        [LSES[0, 0]],
        ValueError,
        r"at least 3 dimensions; got outs \(a "
        r"sequence of 1 parts of shape \(5,\), so shape \(1, 5\)\)",
    ),
    (
        "lses L",
        OUTS,
        LSES[..., :3],
        ValueError,
        r"lses must have the shape \(n, \.\.\., L\) = "
        r"\(3, 2, 4\) of outs without its last axis; got lses of shape \(3, 2, 3\) for outs of "
        r"shape \(3, 2, 4, 5\)",
    ),
    (
        "lses as outs",
        OUTS,
        OUTS,
        ValueError,
        r"lses must have the shape .*got lses of shape "
        r"\(3, 2, 4, 5\)",
    ),
    (
        "n differs",
        list(OUTS),
        list(LSES[:2]),
        ValueError,
        r"got lses \(a sequence of 2 parts of "
        r"shape \(2, 4\), so shape \(2, 2, 4\)\) for outs \(a sequence of 3 parts",
    ),
    (
        "part shapes",
        [OUTS[0], OUTS[1, :, :3]],
        LSES[:2],
        ValueError,
        r"the parts of outs must share "
        r"one shape, got outs\[0\] \(2, 4, 5\) and outs\[1\] \(2, 3, 5\)",
    ),
    (
        "part dtypes",
        OUTS,
        [LSES[0], LSES[1], LSES[2].astype(np.float64)],
        TypeError,
        r"the parts of "
        "lses must share one dtype, got lses\\[0\\] float32 and lses\\[2\\] float64",
    ),
    (
        "integer outs",
        OUTS.astype(np.int32),
        LSES,
        TypeError,
        r"outs must have a real floating "
        r"dtype \(float16, bfloat16, float32, float64\), got int32",
    ),
    (
        "complex outs",
        OUTS.astype(np.complex64),
        LSES,
        TypeError,
        r"outs must have a real floating "
        r"dtype .*got complex64",
    ),
    ("boolean lses", OUTS, LSES > 0, TypeError, r"lses must have a real floating dtype .*got bool"),
    (
        "float16 lses",
        OUTS.astype(np.float16),
        LSES.astype(np.float16),
        TypeError,
        r"lses must be at "
        r"least as wide as the compute dtype float32 of outs float16 .*got float16",
    ),
    (
        "float32 lses, float64 outs",
        OUTS.astype(np.float64),
        LSES,
        TypeError,
        r"lses must be at least "
        r"as wide as the compute dtype float64 of outs float64 .*got float32",
    ),
]


@pytest.mark.parametrize(
    ("case_id", "outs", "lses", "error", "message"), BAD, ids=[c[0] for c in BAD]
)
def test_misuse_is_refused(case_id, outs, lses, error, message):
    with pytest.raises(error, match=message):
        merge_attention_states(outs, lses)


def test_arrays_of_two_libraries_are_refused(non_numpy_backend):
    other = non_numpy_backend.asarray(LSES, "float32")
    kind = re.escape(f"{type(other).__module__}.{type(other).__qualname__}")
    with pytest.raises(
        TypeError, match=rf"one array library; got outs: numpy\.ndarray; lses: {kind}"
    ):
        merge_attention_states(OUTS, other)
    parts = [OUTS[0], non_numpy_backend.asarray(OUTS[1], "float32"), OUTS[2]]
    with pytest.raises(
        TypeError,
        match=rf"got outs\[0\], outs\[2\], lses: numpy\.ndarray; "
        rf"outs\[1\]: {kind}",
    ):
        merge_attention_states(parts, LSES)


def test_arrays_on_two_devices_are_refused(torch_backend):
    import torch

    outs = torch_backend.asarray(OUTS, "float32")
    on_meta = torch.zeros(LSES.shape, dtype=torch.float32, device="meta")
    with pytest.raises(
        ValueError,
        match=r"outs and lses must be on one device, got outs on "
        rf"{outs.device} and lses on meta",
    ):
        merge_attention_states(outs, on_meta)
    lses = torch_backend.asarray(LSES[:2], "float32")
    with pytest.raises(ValueError, match=r"got outs\[0\] on .* and outs\[1\] on meta"):
        merge_attention_states([outs[0], on_meta[0, ..., None].expand(2, 4, 5)], lses)


@pytest.mark.parametrize("implementation", ["auto", "materialized", "blocked"])
def test_parts_with_a_nan_query_merge_to_nan(backend_dtype, implementation):
    """Attention over two halves of the keys with a NaN in one query row: each part's row
    is NaN in its output and its log-sum-exp, so the merge keeps it NaN (a log-sum-exp of
    ``-inf`` would have dropped both parts and given zeros); the other rows match the
    whole call."""
    backend, dtype = backend_dtype
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 3, n, 4)) for n in (5, 6, 6))
    q[1, 2, 3, 0] = np.nan
    xq, xk, xv = (backend.asarray(x, dtype) for x in (q, k, v))
    parts = [
        sdpa_array.scaled_dot_product_attention(
            xq, xk[..., keys, :], xv[..., keys, :], return_lse=True, implementation=implementation
        )
        for keys in (slice(0, 3), slice(3, 6))
    ]
    out, lse = merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    out, lse = host(out), host(lse)
    assert np.isnan(out[1, 2, 3]).all()
    assert np.isnan(lse[1, 2, 3])
    rows = np.ones((2, 3, 5), dtype=bool)
    rows[1, 2, 3] = False
    assert np.isfinite(out[rows]).all()
    assert np.isfinite(lse[rows]).all()
