"""``enable_gqa``: query heads in groups sharing one key and value head.

On every path (:mod:`tests.paths`), backend and dtype, with the value's feature size equal to
the key's and not, alone and with a mask, a bias and causal: the forward result and the
gradients (summed over each group for the key and value) against the float64 oracle within
the derived bounds. Features combined with GQA are in ``tests/test_attention.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers import KV, KV_EV, Q_GQA
from tests.paths import FeatureCase, check_on_path, random_mask, random_normal

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

GQA = {"enable_gqa": True}

PATH_CASES = [
    FeatureCase("gqa", Q_GQA, KV, KV, GQA, native=True),
    FeatureCase("gqa-Ev!=E", Q_GQA, KV, KV_EV, GQA, native="Ev == E"),
    FeatureCase(
        "gqa+mask+bias+causal",
        Q_GQA,
        KV,
        KV,
        {
            **GQA,
            "is_causal": True,
            "mask": random_mask(2, 4, 6, 7, seed=7),
            "bias": random_normal(4, 1, 7, seed=7),
        },
        native=True,
    ),
    FeatureCase("one-key-head", Q_GQA, (2, 1, 7, 4), (2, 1, 7, 4), GQA, native=True),
]


def test_on_every_path(path_case):
    check_on_path(path_case)
