"""``_arrays/products.py``: long contractions split into chunks on NumPy's BLAS.

The split product equals the plain one up to rounding for every length (ragged last chunk,
transposed views), cuts the contraction where it applies (into shorter chunks where the
whole sum is short) and nowhere else, and makes the
float32 error of a long contraction smaller (the accuracy against torch is pinned in
``test_accuracy_long_rows.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from sdpa_array._arrays import products
from sdpa_array._arrays.compat import array_namespace


@pytest.mark.parametrize("k", [1, 63, 64, 65, 127, 128, 129, 300, 1000, 1024])
def test_equals_the_plain_product(k):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((2, 3, 17, k))
    b = rng.standard_normal((2, 3, 5, k))
    xp = array_namespace({"a": a})
    got = products.matmul(xp, a, np.swapaxes(b, -1, -2))  # a transposed view, as dSᵀ Q
    want = np.einsum("...ik,...jk->...ij", a, b)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.sqrt(k))


def test_splits_only_long_contractions_on_numpy(monkeypatch):
    calls = []
    xp = array_namespace({"a": np.ones(1)})

    class Counting:
        def __getattr__(self, name):
            return getattr(xp, name)

        def matmul(self, a, b):
            calls.append(int(a.shape[-1]))
            return xp.matmul(a, b)

    monkeypatch.setattr(products, "namespace_name", lambda _: "numpy")
    products.matmul(Counting(), np.ones((4, 300)), np.ones((300, 2)))
    assert calls == [100, 100, 100]  # balanced chunks of at most CHUNK
    calls.clear()
    chunk = np.ones((4, products.CHUNK)), np.ones((products.CHUNK, 2))
    products.matmul(Counting(), *chunk, whole=1000)  # a tile of a long sum: one chain
    assert calls == [products.CHUNK]
    calls.clear()
    products.matmul(Counting(), *chunk)  # the whole sum, short: chunks of SHORT_CHUNK
    assert calls == [products.SHORT_CHUNK, products.SHORT_CHUNK]
    calls.clear()
    short = np.ones((4, products.SHORT_CHUNK)), np.ones((products.SHORT_CHUNK, 2))
    products.matmul(Counting(), *short)
    assert calls == [products.SHORT_CHUNK]
    calls.clear()
    monkeypatch.setattr(products, "namespace_name", lambda _: "torch")
    products.matmul(Counting(), np.ones((4, 300)), np.ones((300, 2)))
    assert calls == [300]


def test_smaller_float32_error_for_a_long_contraction():
    """Probabilities times values over 4096 keys: the split error is below the plain one."""
    rng = np.random.default_rng(0)
    e = rng.random((64, 4096)).astype(np.float32)
    v = rng.standard_normal((4096, 64)).astype(np.float32)
    exact = e.astype(np.float64) @ v.astype(np.float64)
    xp = array_namespace({"e": e})
    split = np.linalg.norm(products.matmul(xp, e, v) - exact)
    plain = np.linalg.norm(np.matmul(e, v) - exact)
    assert split < plain


@pytest.mark.parametrize(("rows", "cols"), [(5, 17), (17, 5), (8, 8)])
def test_scores_equal_the_plain_product_either_way(rows, cols):
    """``scores`` gives ``a @ bᵀ`` both as it stands and as the transposed view of
    ``b @ aᵀ``; ``transposes`` asks for the view on NumPy where ``b`` has more rows."""
    rng = np.random.default_rng(rows * cols)
    a = rng.standard_normal((2, rows, 6))
    b = rng.standard_normal((2, cols, 6))
    xp = array_namespace({"a": a})
    want = np.einsum("...ik,...jk->...ij", a, b)
    for transposed in (False, True):
        got = products.scores(xp, a, b, transposed=transposed)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert got.flags.c_contiguous is not transposed or rows == 1
    assert products.transposes(xp, a, b) is (cols > rows)


def test_transposes_only_on_numpy(backend):
    """Other libraries' products stand as they are (their kernels, not OpenBLAS)."""
    a = backend.asarray(np.ones((2, 3)), "float32")
    b = backend.asarray(np.ones((9, 3)), "float32")
    xp = array_namespace({"a": a})
    assert products.transposes(xp, a, b) is (backend.library == "numpy")


@pytest.mark.parametrize("n", [1, 127, 128, 129, 300, 2048])
def test_strided_row_sums_of_transposed_tiles(n):
    """``row_sum(strided=True)`` of a transposed view (NumPy's transposed score tiles) sums
    its rows in runs of ``CHUNK`` keys: the row sums of the view, at most the error of a
    run of ``CHUNK`` float32 additions plus one per run (``(CHUNK + n / CHUNK) u`` of the
    sum of the absolute values, the standard bound of a chain of additions)."""
    from sdpa_array._kernels.softmax import row_sum
    from sdpa_array._problem.options import Options
    from sdpa_array._problem.problem import validate

    rng = np.random.default_rng(n)
    stored = rng.standard_normal((2, 3, n, 5)).astype(np.float32)  # a transposed product
    e = np.swapaxes(stored, -1, -2)  # (2, 3, 5, n), rows strided
    p = validate(*(np.ones((1, 1, 2, 2), np.float32),) * 3, Options())
    got = row_sum(p, e, strided=True)
    assert got.shape == (2, 3, 5, 1)
    want = e.astype(np.float64).sum(axis=-1, keepdims=True)
    u = np.finfo(np.float32).eps / 2
    bound = (
        (products.CHUNK + n / products.CHUNK + 1)
        * u
        * np.abs(e).astype(np.float64).sum(axis=-1, keepdims=True)
    )
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("transposed", [False, True])
def test_many_chunks_as_one_stacked_product_add_alike(monkeypatch, transposed):
    """From ``BATCHED_CHUNKS`` chunks NumPy takes them as one stacked product
    (``_batched``): the same sums, in the same order, as one product per chunk."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((2, 24, 1024)).astype(np.float32)
    if transposed:  # dS as the transposed view of a product, as the backward pass has it
        a = np.swapaxes(np.ascontiguousarray(np.swapaxes(a, -1, -2)), -1, -2)
    b = rng.standard_normal((2, 1024, 8)).astype(np.float32)
    xp = array_namespace({"a": a})
    taken = []
    batched = products._batched
    monkeypatch.setattr(products, "_batched", lambda *x: taken.append(x[2]) or batched(*x))
    got = products.matmul(xp, a, b)
    monkeypatch.setattr(products, "BATCHED_CHUNKS", 10**9)
    one_by_one = products.matmul(xp, a, b)
    assert taken == [1024 // products.CHUNK]
    np.testing.assert_array_equal(got, one_by_one)


def test_stacked_chunk_products_stay_tile_sized(monkeypatch):
    """A stack of chunk products larger than ``BATCHED_BYTES`` (a whole call's, on the
    materialized paths) is not made: the chunks are multiplied one by one, as equal."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((3, 16, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 8)).astype(np.float32)
    xp = array_namespace({"a": a})
    taken = []
    batched = products._batched
    monkeypatch.setattr(products, "_batched", lambda *x: taken.append(x[2]) or batched(*x))
    stacked = 3 * 8 * 16 * 8 * 4  # lead * count * m * n * itemsize
    monkeypatch.setattr(products, "BATCHED_BYTES", stacked)
    at_the_cap = products.matmul(xp, a, b)
    monkeypatch.setattr(products, "BATCHED_BYTES", stacked - 1)
    over_it = products.matmul(xp, a, b)
    assert taken == [8]
    np.testing.assert_array_equal(at_the_cap, over_it)
