"""``mask`` and ``bias``: a boolean array of admissible pairs and an additive score term,
broadcast against ``(..., Hq, L, S)``.

On every path (:mod:`tests.paths`), backend and dtype, each alone and both together, in
several broadcast shapes: the forward result and the gradients (the bias's too) against the
float64 oracle within the derived bounds. Rows that they exclude whole are checked in
``tests/test_attention.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers import KV, Q
from tests.paths import FeatureCase, check_on_path, random_mask, random_normal

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

PATH_CASES = [
    FeatureCase("mask", Q, KV, KV, {"mask": random_mask(2, 1, 6, 7, seed=3)}, native=True),
    FeatureCase("bias", Q, KV, KV, {"bias": random_normal(2, 6, 7, seed=4)}, native=True),
    FeatureCase("bias-broadcast-L", Q, KV, KV, {"bias": random_normal(2, 1, 1, 7)}, native=True),
    FeatureCase("bias-broadcast-S", Q, KV, KV, {"bias": random_normal(6, 1)}, native=True),
    FeatureCase(
        "mask+bias",
        Q,
        KV,
        KV,
        {"mask": random_mask(6, 7, seed=5), "bias": random_normal(2, 2, 1, 7, seed=5)},
        native=True,
    ),
    FeatureCase(
        "sparse-mask+full-bias",
        Q,
        KV,
        KV,
        {"mask": random_mask(2, 2, 6, 7, seed=6, keep=0.2), "bias": random_normal(*Q[:-1], 7)},
        native=True,
    ),
]


def test_on_every_path(path_case):
    check_on_path(path_case)
