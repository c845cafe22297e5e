"""What ``return_max_scores=True`` costs on the NumPy blocked path.

NumPy, float32, B=1, H=8, L = S = 2048, E=64, ``implementation="blocked"``, the block pool
as configured (``SDPA_ARRAY_NUM_THREADS``; the development machine's 2 threads):
:class:`MaxScoresCost` times the call with the maximum scores and the call without,
interleaved in one process (:data:`ROUNDS` rounds after a warm-up), and tracks the ratio of
their medians. The maximum scores are one elementwise maximum per score tile beside the
fixed reference's softmax (:mod:`sdpa_array._kernels.blocked`), so good is at most 1.05.
"""

from __future__ import annotations

import statistics
from typing import ClassVar

import numpy as np

from sdpa_array import scaled_dot_product_attention

from .common import interleaved_times

#: Interleaved rounds (median).
ROUNDS = 7

SHAPE = (1, 8, 2048, 64)


class MaxScoresCost:
    """The call with the maximum scores against the call without."""

    params: ClassVar = (["1x8x2048x64"],)
    param_names: ClassVar = ["shape"]
    timeout = 600

    def setup(self, shape: str) -> None:
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = (rng.standard_normal(SHAPE, dtype=np.float32) for _ in range(3))

    def _call(self, max_scores: bool) -> object:
        return scaled_dot_product_attention(
            self.q, self.k, self.v, implementation="blocked", return_max_scores=max_scores
        )

    def track_max_scores_time_ratio(self, shape: str) -> float:
        """Median time with ``return_max_scores=True`` / median time without; lower is
        better, good is <= 1.05."""
        times = interleaved_times(
            {"with": lambda: self._call(True), "without": lambda: self._call(False)},
            lambda _: None,
            ROUNDS,
        )
        return statistics.median(times["with"]) / statistics.median(times["without"])

    track_max_scores_time_ratio.unit = "ratio"  # type: ignore[attr-defined]

    def time_with_max_scores(self, shape: str) -> None:
        """One call with the maximum scores."""
        self._call(True)

    def time_without_max_scores(self, shape: str) -> None:
        """One call without them."""
        self._call(False)
