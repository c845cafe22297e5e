"""Forward attention: time, achieved GFLOP/s, GEMM-bound fraction, ratio to torch, memory.

Every class is parametrized by backend (the registry's ids), dtype, implementation (ours:
``auto``, ``materialized``, ``blocked``, ``native``; peers: ``torch-sdpa``, torch's own
kernel on the same memory, and ``naive``, the three-step computation in the backend's
library) and shape, so that one ``asv run`` holds every ratio.
"""

from __future__ import annotations

import statistics
from typing import ClassVar

from .common import (
    BACKEND_IDS,
    DTYPES,
    IMPLEMENTATIONS,
    LONG_LENGTHS,
    MAX_SCORE_BYTES,
    OURS,
    SHAPES,
    TRACK_ROUNDS,
    Shape,
    interleaved_times,
    make_case,
    peak_rss_growth,
    products_case,
)


class Forward:
    """One forward call per implementation and peer."""

    param_names: ClassVar = ["backend", "dtype", "implementation", "shape"]
    params: ClassVar = [BACKEND_IDS, DTYPES, IMPLEMENTATIONS, SHAPES]
    timeout = 600

    def setup(self, backend, dtype, implementation, shape):
        self.case = make_case(backend, dtype, implementation, shape)

    def time_forward(self, backend, dtype, implementation, shape):
        self.case()

    def track_gflops(self, backend, dtype, implementation, shape):
        """Flops of the two products over the admissible pairs, per second."""
        return self.case.shape.flops / self.case.median_seconds() / 1e9

    track_gflops.unit = "GFLOP/s"

    def track_gemm_bound_fraction(self, backend, dtype, implementation, shape):
        """Time of the two matrix products alone / time of the attention (1 = GEMM-bound).

        The products run on the same backend, with the same shapes, interleaved with the
        attention; for a causal call their time is scaled to the admissible pairs.
        """
        products = products_case(backend, dtype, shape)
        times = interleaved_times(
            {"attention": self.case.run, "products": products.run},
            self.case.backend.synchronize,
            TRACK_ROUNDS,
        )
        s = self.case.shape
        useful = s.flops / (4.0 * s.B * s.H * s.L * s.L * s.E)
        attention = statistics.median(times["attention"])
        return statistics.median(times["products"]) * useful / attention

    track_gemm_bound_fraction.unit = "fraction"


class VersusTorch:
    """Throughput relative to torch's native kernel on the same memory, same process."""

    param_names: ClassVar = ["backend", "dtype", "implementation", "shape"]
    params: ClassVar = [BACKEND_IDS, DTYPES, OURS, SHAPES]
    timeout = 600

    def setup(self, backend, dtype, implementation, shape):
        self.ours = make_case(backend, dtype, implementation, shape)
        self.torch = make_case(backend, dtype, "torch-sdpa", shape)

    def track_speedup_over_torch(self, backend, dtype, implementation, shape):
        """torch's median time / ours, interleaved (> 1: ours is faster)."""
        times = interleaved_times(
            {"ours": self.ours.run, "torch": self.torch.run},
            self.ours.backend.synchronize,
            TRACK_ROUNDS,
        )
        return statistics.median(times["torch"]) / statistics.median(times["ours"])

    track_speedup_over_torch.unit = "ratio"


class LongSequence:
    """One head, long sequences: memory beyond the inputs (B=1, H=1, E=64, float32)."""

    param_names: ClassVar = ["backend", "implementation", "length"]
    params: ClassVar = [BACKEND_IDS, [*OURS, "torch-sdpa"], LONG_LENGTHS]
    timeout = 600

    def setup(self, backend, implementation, length):
        shape = f"1x1x{length}x64"
        if implementation == "materialized" and Shape.parse(shape).score_bytes("float32") > (
            MAX_SCORE_BYTES // 4
        ):
            raise NotImplementedError("the materialized score matrix alone would exceed 1 GiB")
        self.case = make_case(backend, "float32", implementation, shape)

    def peakmem_forward(self, backend, implementation, length):
        self.case()

    def track_peak_rss_growth(self, backend, implementation, length):
        """Peak resident memory above the process's size before the call (Linux)."""
        growth = peak_rss_growth(self.case)
        if growth is None:
            raise NotImplementedError("needs Linux /proc/self/clear_refs")
        return growth / 2**20

    track_peak_rss_growth.unit = "MiB"
