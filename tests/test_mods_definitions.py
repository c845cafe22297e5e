"""The ready-made mods of :mod:`sdpa_array.mods` against their textbook definitions.

Each mod is called with index arrays of every backend, in the 4-axis arrangement of the
scores and in a 5-axis one (grouped-query attention splits the heads into two axes), and its
result is compared with the definition written out here with NumPy loops and Python
scalars: exactly for masks, to the data's rounding for biases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdpa_array import mods
from sdpa_array._arrays.compat import array_namespace, namespace_name
from sdpa_array.reference import to_numpy
from sdpa_array.testing import Backend
from sdpa_array.testing.backends import get_backend

#: Batch count, query heads (two groups of two), query and key lengths shared by the fixed
#: cases, so that JAX compiles each operation once.
B, H, GROUPS, L, S = 2, 4, 2, 5, 7

RNG = np.random.default_rng(20261122)
TABLE = RNG.standard_normal((H, 8))
SEGMENTS_Q = np.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]])
SEGMENTS_K = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 3]])


def indices(
    xp_asarray: Callable[[np.ndarray], Any], b: int, h: int, rows: int, cols: int, layout: str
) -> tuple[Any, Any, Any, Any]:
    """``(batch, head, q_idx, kv_idx)`` in the 4-axis or the 5-axis (GQA) arrangement."""
    if layout == "4d":
        shapes = [(b, 1, 1, 1), (1, h, 1, 1), (1, 1, rows, 1), (1, 1, 1, cols)]
        values = [np.arange(n) for n in (b, h, rows, cols)]
    else:  # heads split into (kv heads, group): head = kv_head * GROUPS + group
        shapes = [(b, 1, 1, 1, 1), (1, h // GROUPS, GROUPS, 1, 1), (1, 1, 1, rows, 1)]
        shapes.append((1, 1, 1, 1, cols))
        values = [np.arange(n) for n in (b, h, rows, cols)]
    return tuple(xp_asarray(np.reshape(v, s)) for v, s in zip(values, shapes, strict=True))  # type: ignore[return-value]


def evaluate(
    mod: Callable[..., Any], backend: Backend | None, shape: tuple[int, int, int, int], layout: str
) -> np.ndarray:
    """Call ``mod`` on index arrays of ``backend`` (NumPy for None); the result as NumPy,
    broadcast to ``(batch, heads, L, S)``."""
    b, h, rows, cols = shape
    convert = np.asarray if backend is None else (lambda a: backend.asarray(a, "int64"))
    args = indices(convert, b, h, rows, cols, layout)
    result = mod(*args)
    library = namespace_name(array_namespace({"q_idx": args[2]}))
    assert namespace_name(array_namespace({"result": result})) == library
    out = to_numpy(result)
    if layout == "gqa":
        out = np.broadcast_to(out, (b, h // GROUPS, GROUPS, rows, cols)).reshape(shape)
    return np.broadcast_to(out, shape)


def grid(shape: tuple[int, int, int, int]) -> tuple[np.ndarray, ...]:
    """Broadcastable NumPy ``(b, h, i, j)`` for the expected values."""
    return np.ix_(*(np.arange(n) for n in shape))


def t5_bucket(relative: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's ``_relative_position_bucket`` for one relative position, in Python scalars."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative > 0:
            bucket += num_buckets
        distance = abs(relative)
    else:
        distance = max(-relative, 0)
    max_exact = num_buckets // 2
    if distance < max_exact:
        return bucket + distance
    large = max_exact + int(
        math.log(distance / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    return bucket + min(large, num_buckets - 1)


def expected_mask(name: str, shape: tuple[int, int, int, int]) -> np.ndarray:
    """The textbook mask of the fixed case ``name``, with loops."""
    out = np.zeros(shape, dtype=bool)
    for b, h, i, j in np.ndindex(*shape):
        out[b, h, i, j] = {
            "causal": j <= i,
            "causal+2": j <= i + 2,
            "causal-1": j <= i - 1,
            "window(1,0)": i - 1 <= j <= i,
            "window(None,1)": j <= i + 1,
            "window(2,None)": i - 2 <= j,
            "window(None,None)": True,
            "window(1,2,offset=2)": i + 1 <= j <= i + 4,
            "prefix(2)": j < 2 or j <= i,
            "prefix([1,3])": j < [1, 3][b] or j <= i,
            "document(1-D)": SEGMENTS_Q[0, i] == SEGMENTS_K[1, j],
            "document(2-D)": SEGMENTS_Q[b, i] == SEGMENTS_K[b, j],
            "document(mixed)": SEGMENTS_Q[b, i] == SEGMENTS_K[1, j],
            "and": j <= i and i - 2 <= j,
            "or": j < 1 or j <= i or SEGMENTS_Q[b, i] == SEGMENTS_K[b, j],
        }[name]
    return out


def mask_cases(data: Callable[[np.ndarray], Any]) -> dict[str, Any]:
    """The fixed mask cases; ``data`` puts captured arrays on some library."""
    return {
        "causal": mods.causal(),
        "causal+2": mods.causal(2),
        "causal-1": mods.causal(offset=-1),
        "window(1,0)": mods.sliding_window(1, 0),
        "window(None,1)": mods.sliding_window(None, 1),
        "window(2,None)": mods.sliding_window(2, None),
        "window(None,None)": mods.sliding_window(None, None),
        "window(1,2,offset=2)": mods.sliding_window(1, 2, offset=2),
        "prefix(2)": mods.prefix_lm(2),
        "prefix([1,3])": mods.prefix_lm(data(np.array([1, 3]))),
        "document(1-D)": mods.document(data(SEGMENTS_Q[0]), data(SEGMENTS_K[1])),
        "document(2-D)": mods.document(data(SEGMENTS_Q), data(SEGMENTS_K)),
        "document(mixed)": mods.document(data(SEGMENTS_Q), data(SEGMENTS_K[1])),
        "and": mods.and_masks(mods.causal(), mods.sliding_window(2, None)),
        "or": mods.or_masks(mods.prefix_lm(1), mods.document(data(SEGMENTS_Q), SEGMENTS_K)),
    }


MASK_NAMES = list(mask_cases(np.asarray))


@pytest.mark.parametrize("layout", ["4d", "gqa"])
@pytest.mark.parametrize("data_on", ["backend", "numpy"])
def test_masks(backend, data_on, layout):
    data = np.asarray if data_on == "numpy" else backend.asarray
    for name, mod in mask_cases(data).items():
        got = evaluate(mod, backend, (B, H, L, S), layout)
        assert got.dtype == np.bool_, name
        np.testing.assert_array_equal(got, expected_mask(name, (B, H, L, S)), err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["4d", "gqa"])
@pytest.mark.parametrize("data_on", ["backend", "numpy", "numpy:readonly"])
def test_biases(backend, data_on, layout, dtype):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.id} has no {dtype}")
    data = {
        "backend": lambda a: backend.asarray(a, dtype),
        "numpy": lambda a: a.astype(dtype),
        "numpy:readonly": lambda a: get_backend("numpy:readonly").asarray(a, dtype),
    }[data_on]
    shape = (B, H, L, S)
    _, h, i, j = grid(shape)
    slopes = mods.alibi_slopes(H).astype(dtype)
    table = TABLE.astype(dtype)
    cases = {
        "alibi": (mods.alibi(data(slopes)), -slopes.astype(np.float64)[h] * np.abs(i - j)),
        "t5": (
            mods.relative_position_bias(data(table), num_buckets=8, max_distance=5),
            np.array(
                [
                    [
                        [table[hh, t5_bucket(jj - ii, True, 8, 5)] for jj in range(S)]
                        for ii in range(L)
                    ]
                    for hh in range(H)
                ]
            )[None],
        ),
        "t5-causal": (
            mods.relative_position_bias(
                data(table), num_buckets=8, max_distance=6, bidirectional=False
            ),
            np.array(
                [
                    [
                        [table[hh, t5_bucket(jj - ii, False, 8, 6)] for jj in range(S)]
                        for ii in range(L)
                    ]
                    for hh in range(H)
                ]
            )[None],
        ),
    }
    eps = np.finfo(dtype).eps
    for name, (mod, want) in cases.items():
        got = evaluate(mod, backend, shape, layout)
        assert got.dtype == np.dtype(dtype), name
        np.testing.assert_allclose(
            got, np.broadcast_to(want, shape), rtol=eps, atol=0, err_msg=name
        )


# --- random cases on NumPy indices ------------------------------------------------------

sizes = st.integers(1, 12)
bounds = st.one_of(st.none(), st.integers(0, 6))


@given(rows=sizes, cols=sizes, left=bounds, right=bounds, offset=st.integers(-5, 5))
def test_sliding_window_and_causal_random(rows, cols, left, right, offset):
    shape = (1, 1, rows, cols)
    got = evaluate(mods.sliding_window(left, right, offset=offset), None, shape, "4d")
    _, _, i, j = grid(shape)
    want = np.ones(shape, dtype=bool)
    if left is not None:
        want &= j >= i + offset - left
    if right is not None:
        want &= j <= i + offset + right
    np.testing.assert_array_equal(got, want)
    got = evaluate(mods.causal(offset), None, shape, "4d")
    np.testing.assert_array_equal(got, np.broadcast_to(j <= i + offset, shape))


@given(
    rows=sizes,
    cols=sizes,
    batch=st.integers(1, 3),
    data=st.data(),
)
def test_document_and_prefix_random(rows, cols, batch, data):
    q_seg = np.sort(
        data.draw(st.lists(st.integers(0, 3), min_size=batch * rows, max_size=batch * rows))
    )
    k_seg = np.sort(
        data.draw(st.lists(st.integers(0, 3), min_size=batch * cols, max_size=batch * cols))
    )
    q_seg, k_seg = q_seg.reshape(batch, rows), k_seg.reshape(batch, cols)
    prefix = data.draw(st.lists(st.integers(0, cols + 1), min_size=batch, max_size=batch))
    shape = (batch, 2, rows, cols)
    got = evaluate(mods.document(q_seg, k_seg), None, shape, "4d")
    prefix_got = evaluate(mods.prefix_lm(prefix), None, shape, "4d")
    for b, h, i, j in np.ndindex(*shape):
        assert got[b, h, i, j] == (q_seg[b, i] == k_seg[b, j])
        assert prefix_got[b, h, i, j] == (j < prefix[b] or j <= i)


@given(
    bidirectional=st.booleans(),
    half=st.integers(2, 24),
    extra=st.integers(1, 200),
)
def test_t5_buckets_random(bidirectional, half, extra):
    """Every relative position in [-300, 300] lands in T5's bucket."""
    num_buckets = 2 * half if bidirectional else half
    max_distance = half // 2 + extra
    table = np.arange(2 * num_buckets, dtype=np.float64).reshape(2, num_buckets)
    mod = mods.relative_position_bias(
        table, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
    )
    head = np.arange(2).reshape(2, 1, 1)
    got = mod(
        np.zeros((1, 1, 1), dtype=int), head, np.full((1, 1, 1), 300), np.arange(601)[None, None]
    )
    for r in range(-300, 301):
        bucket = t5_bucket(r, bidirectional, num_buckets, max_distance)
        assert got[0, 0, r + 300] == bucket, r
        assert got[1, 0, r + 300] == num_buckets + bucket, r


def test_t5_default_buckets_spot_values():
    """T5's defaults (32 buckets, max_distance 128): a few buckets worked out by hand."""
    mod = mods.relative_position_bias(np.arange(32.0)[None], num_buckets=32, max_distance=128)
    rel = np.array([0, -1, -7, -8, -11, -12, -16, -127, -128, -1000, 1, 8, 16, 1000])
    got = mod(
        np.zeros(1, dtype=int), np.zeros(1, dtype=int), np.zeros(1, dtype=int) + 1000, 1000 + rel
    )
    # exact below 8; then 8 + int(log(d / 8) / log(16) * 8) = 8 + int(2 * log2(d / 8)),
    # at most 15; positive ones 16 higher
    want = [0, 1, 7, 8, 8, 9, 10, 15, 15, 15, 17, 24, 26, 31]
    np.testing.assert_array_equal(got, want)


# --- ALiBi slopes ------------------------------------------------------------------------


def test_alibi_slopes_literal():
    np.testing.assert_array_equal(
        mods.alibi_slopes(8), [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    )
    assert mods.alibi_slopes(8).dtype == np.float64
    np.testing.assert_array_equal(mods.alibi_slopes(1), [2.0**-8])


@pytest.mark.parametrize("heads", [2, 8, 12, 16, 20])
def test_alibi_slopes_closed_form(heads):
    m = 2 ** math.floor(math.log2(heads))
    closed = [2 ** (-8 * (i + 1) / m) for i in range(m)]
    closed += [2 ** (-8 * (2 * k + 1) / (2 * m)) for k in range(heads - m)]
    np.testing.assert_allclose(mods.alibi_slopes(heads), closed, rtol=4 * np.finfo(float).eps)


# --- data of another library than the indices --------------------------------------------


@pytest.mark.parametrize("indices_on", ["numpy", "strict"])
@pytest.mark.parametrize("make", ["alibi", "document", "prefix", "t5"])
def test_data_of_another_library(non_numpy_backend, make, indices_on):
    """NumPy indices (host classification) read other libraries' data through a host copy,
    and array-api-strict indices get a copy of it in their library; lazy Dask data cannot
    be read on the host."""
    b = non_numpy_backend
    on = None
    if indices_on == "strict":
        on = get_backend("strict")
        if not on.is_available():
            pytest.skip("array-api-strict is not installed")
    mod = {
        "alibi": lambda: mods.alibi(b.asarray(mods.alibi_slopes(H), "float32")),
        "document": lambda: mods.document(b.asarray(SEGMENTS_Q), b.asarray(SEGMENTS_K)),
        "prefix": lambda: mods.prefix_lm(b.asarray(np.array([1, 3]))),
        "t5": lambda: mods.relative_position_bias(
            b.asarray(TABLE, "float32"), num_buckets=8, max_distance=5
        ),
    }[make]()
    reference = {
        "alibi": lambda: mods.alibi(mods.alibi_slopes(H).astype(np.float32)),
        "document": lambda: mods.document(SEGMENTS_Q, SEGMENTS_K),
        "prefix": lambda: mods.prefix_lm(np.array([1, 3])),
        "t5": lambda: mods.relative_position_bias(
            TABLE.astype(np.float32), num_buckets=8, max_distance=5
        ),
    }[make]()
    if b.library == "dask":
        with pytest.raises(TypeError, match="cannot be read on the host"):
            evaluate(mod, on, (B, H, L, S), "4d")
        return
    for _ in range(2):  # the second call uses the kept host copy
        got = evaluate(mod, on, (B, H, L, S), "gqa")
        np.testing.assert_array_equal(got, evaluate(reference, None, (B, H, L, S), "gqa"))


def test_jit_with_traced_data(jax_backend):
    """Under ``jax.jit`` the data closed over may be tracers, the indices concrete."""
    import jax

    b = jax_backend
    args = indices(lambda a: b.asarray(a, "int64"), B, H, L, S, "4d")

    @jax.jit
    def run(slopes, table, segments_q, segments_k, prefix):
        return (
            mods.alibi(slopes)(*args),
            mods.relative_position_bias(table, num_buckets=8, max_distance=5)(*args),
            mods.and_masks(mods.document(segments_q, segments_k), mods.prefix_lm(prefix))(*args),
        )

    data = (mods.alibi_slopes(H), TABLE, SEGMENTS_Q, SEGMENTS_K, np.array([1, 3]))
    traced = run(*(b.asarray(a) for a in data))
    eager = (
        mods.alibi(data[0])(*args),
        mods.relative_position_bias(data[1], num_buckets=8, max_distance=5)(*args),
        mods.and_masks(mods.document(data[2], data[3]), mods.prefix_lm(data[4]))(*args),
    )
    for got, want in zip(traced, eager, strict=True):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))

    @jax.jit
    def on_host(slopes):
        return mods.alibi(slopes)(*indices(np.asarray, B, H, L, S, "4d"))

    with pytest.raises(TypeError, match="cannot be read on the host"):
        on_host(b.asarray(mods.alibi_slopes(H)))


# --- arguments, names ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: mods.causal(1.5), TypeError, "offset"),
        (lambda: mods.causal(True), TypeError, "offset"),
        (lambda: mods.sliding_window(-1, 0), ValueError, "left"),
        (lambda: mods.sliding_window(0, -2), ValueError, "right"),
        (lambda: mods.sliding_window(1.0, 0), TypeError, "left"),
        (lambda: mods.sliding_window(0, "2"), TypeError, "right"),
        (lambda: mods.sliding_window(0, 0, offset=0.5), TypeError, "offset"),
        (lambda: mods.prefix_lm(-1), ValueError, "prefix_lengths"),
        (lambda: mods.prefix_lm(True), TypeError, "prefix_lengths"),
        (lambda: mods.prefix_lm(np.zeros((2, 2), dtype=int)), ValueError, "prefix_lengths"),
        (lambda: mods.prefix_lm(np.ones(2)), TypeError, "prefix_lengths.*integer"),
        (lambda: mods.prefix_lm("3"), TypeError, "prefix_lengths"),
        (lambda: mods.document(np.zeros(3), [0, 1]), TypeError, "query_segments.*integer"),
        (lambda: mods.document([0], np.zeros((1, 1, 2), int)), ValueError, "key_segments"),
        (lambda: mods.document(np.zeros((2, 3), int), np.zeros((3, 3), int)), ValueError, "rows"),
        (lambda: mods.alibi(np.zeros((2, 2))), ValueError, "slopes.*1-D"),
        (lambda: mods.alibi(np.arange(3)), TypeError, "slopes.*floating"),
        (lambda: mods.alibi(0.5), TypeError, "slopes"),
        (lambda: mods.alibi_slopes(0), ValueError, "heads"),
        (lambda: mods.alibi_slopes(2.0), TypeError, "heads"),
        (lambda: t5(num_buckets=3), ValueError, "num_buckets"),
        (lambda: t5(num_buckets=0, bidirectional=False), ValueError, "num_buckets"),
        (lambda: t5(num_buckets=8.0), TypeError, "num_buckets"),
        (lambda: t5(max_distance=2), ValueError, "max_distance"),
        (lambda: t5(bidirectional=1), TypeError, "bidirectional"),
        (lambda: t5(table=np.zeros((2, 7))), ValueError, "table.*num_buckets=8"),
        (lambda: t5(table=np.zeros(8)), ValueError, "table.*2-D"),
        (lambda: t5(table=np.zeros((2, 8), int)), TypeError, "table.*floating"),
        (lambda: mods.and_masks(), ValueError, "and_masks"),
        (lambda: mods.or_masks(mods.causal(), 3), TypeError, "or_masks.*1"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def t5(**options: Any) -> Any:
    kwargs = {"table": np.zeros((2, 8)), "num_buckets": 8, "max_distance": 5} | options
    return mods.relative_position_bias(**kwargs)


def test_bad_index_arrays():
    with pytest.raises(TypeError, match="q_idx"):
        mods.causal()(np.zeros(1, int), np.zeros(1, int), 3, np.arange(2))


def test_names():
    slopes = mods.alibi_slopes(2)
    named = {
        "causal(offset=0)": mods.causal(),
        "sliding_window(left=None, right=3, offset=1)": mods.sliding_window(None, 3, offset=1),
        "prefix_lm(prefix_lengths=2)": mods.prefix_lm(2),
        "prefix_lm(prefix_lengths=<numpy int64 array of shape (2,)>)": mods.prefix_lm([1, 2]),
        "alibi(slopes=<numpy float64 array of shape (2,)>)": mods.alibi(slopes),
        "or_masks(causal(offset=0), causal(offset=1))": mods.or_masks(
            mods.causal(), mods.causal(1)
        ),
        "relative_position_bias(table=<numpy float64 array of shape (2, 8)>, num_buckets=8, "
        "max_distance=5, bidirectional=True)": t5(),
    }
    for text, mod in named.items():
        assert repr(mod) == text
        assert mod.__name__ == text.partition("(")[0]


@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=70),
    sort=st.booleans(),
    block=st.sampled_from([1, 4, 16]),
)
def test_document_block_classes_from_ids_never_contradict_the_mask(ids, sort, block):
    """The document mask's classes from its ids' ranges: a block called empty or full is
    so on the evaluated mask; for packed documents numbered in order (each id the last one
    or one more) they equal the evaluated classes."""
    from sdpa_array._problem import block_mask

    doc = np.array(sorted(ids) if sort else ids)
    n = len(doc)
    mod = mods.document(doc, doc)
    mine = block_mask.segment_classes(doc, doc, n, n, block, block)
    evaluated = block_mask._evaluate(mod, (1,), (1,), n, n, block, block)
    assert mine.shape == evaluated.shape
    claimed = mine != block_mask.PARTIAL
    assert np.array_equal(mine[claimed], evaluated[claimed])
    if np.all(np.isin(np.diff(doc), (0, 1))):
        assert np.array_equal(mine, evaluated)
