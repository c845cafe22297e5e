"""``softcap``: scores bounded by ``softcap * tanh(score / softcap)`` before bias and mask.

On every path (:mod:`tests.paths`), backend and dtype, alone and with causal, window, a
mask and a bias, the forward result and the gradients against the float64 oracle within the
derived bounds (whose score error has the softcap's own term).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import KV, Q
from tests.paths import FeatureCase, check_on_path

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

_rng = np.random.default_rng(11)

PATH_CASES = [
    FeatureCase("softcap", Q, KV, KV, {"softcap": 2.5}),
    FeatureCase("small-cap", Q, KV, KV, {"softcap": 0.3, "scale": 4.0}),
    FeatureCase(
        "causal-bottom-right",
        Q,
        KV,
        KV,
        {"softcap": 5.0, "is_causal": True, "alignment": "bottom_right"},
    ),
    FeatureCase(
        "window+mask+bias",
        Q,
        KV,
        KV,
        {
            "softcap": 3.0,
            "window": (2, 1),
            "mask": _rng.random((6, 7)) > 0.3,
            "bias": _rng.standard_normal((2, 1, 6, 7)),
        },
    ),
]


def test_on_every_path(path_case):
    check_on_path(path_case)
