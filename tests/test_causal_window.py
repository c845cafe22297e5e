"""``is_causal``, ``window`` and ``alignment``: the band of keys each query may attend.

On every path (:mod:`tests.paths`), backend and dtype: causal masks aligned to the top left
and the bottom right with ``L < S``, ``L == S`` and ``L > S``, windows bounded on both
sides, on one side, and combined with causal; the forward result and the gradients against
the float64 oracle within the derived bounds. How the band classifies tiles is checked in
``tests/test_restrictions.py``; rows it excludes whole in ``tests/test_attention.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers import KV, Q
from tests.paths import FeatureCase, check_on_path

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

BOTTOM_RIGHT = {"alignment": "bottom_right"}

PATH_CASES = [
    FeatureCase("causal", KV, KV, KV, {"is_causal": True}, native=True),
    FeatureCase(
        "causal-top-left-L<S",
        Q,
        KV,
        KV,
        {"is_causal": True, "alignment": "top_left"},
        native=True,
    ),
    FeatureCase("causal-bottom-right-L<S", Q, KV, KV, {"is_causal": True, **BOTTOM_RIGHT}, True),
    FeatureCase("causal-bottom-right-L>S", KV, Q, Q, {"is_causal": True, **BOTTOM_RIGHT}, True),
    FeatureCase("window", KV, KV, KV, {"window": (2, 1)}, native=True),
    FeatureCase(
        "window-left-only+causal",
        Q,
        KV,
        KV,
        {"window": (3, None), "is_causal": True, **BOTTOM_RIGHT},
        native=True,
    ),
    FeatureCase("window-right-only", KV, Q, Q, {"window": (None, 0)}, native=True),
    FeatureCase("window-bottom-right-L<S", Q, KV, KV, {"window": (1, 2), **BOTTOM_RIGHT}, True),
]


def test_on_every_path(path_case):
    check_on_path(path_case)
