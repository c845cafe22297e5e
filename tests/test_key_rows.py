"""The blocked backward's sums of key rows by range (``_kernels/key_rows.py``).

The kernels pass the array-api-compat namespace (``xp``), as here: NumPy's own module lacks
``concat`` and ``zeros(device=)`` before NumPy 2.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from sdpa_array._kernels.key_rows import KeyRows, covering


def _dense(rows: KeyRows, keys: int, features: int) -> np.ndarray:
    out = np.zeros((keys, features))
    for (a, b), piece in rows.items():
        out[a:b] += piece
    return out


def test_disjoint_ranges_stay_pieces_and_the_first_is_not_copied():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    xp = array_namespace(x)
    rows = KeyRows()
    rows.add(xp, x, 0, 2, 10)
    rows.add(xp, y, 5, 9, 10)
    assert sorted(rows) == [(0, 2), (5, 9)]
    assert rows[(0, 2)] is x
    kept = x.copy()
    rows.add(xp, x, 0, 2, 10)  # the same range: a new sum, x unchanged
    np.testing.assert_array_equal(x, kept)
    np.testing.assert_array_equal(rows[(0, 2)], 2 * x)
    assert covering(rows, 10) == [((0, 2), 0, 2), (None, 2, 5), ((5, 9), 5, 9), (None, 9, 10)]
    assert covering(None, 4) == [(None, 0, 4)]


def test_overlapping_ranges_add_into_all_keys():
    rng = np.random.default_rng(1)
    pieces = [((0, 4), rng.standard_normal((4, 2))), ((2, 6), rng.standard_normal((4, 2)))]
    pieces += [((2, 6), rng.standard_normal((4, 2))), ((7, 8), rng.standard_normal((1, 2)))]
    expected = np.zeros((8, 2))
    xp = array_namespace(expected)
    rows = KeyRows()
    for (a, b), x in pieces:
        expected[a:b] += x
        before = x.copy()
        rows.add(xp, x, a, b, 8)
        np.testing.assert_array_equal(x, before)
    assert list(rows) == [(0, 8)]
    np.testing.assert_allclose(_dense(rows, 8, 2), expected)
    other = KeyRows()
    other.add(xp, pieces[0][1], 0, 4, 8)
    rows.merge(xp, other, 8)
    expected[0:4] += pieces[0][1]
    np.testing.assert_allclose(_dense(rows, 8, 2), expected)
