"""Packed documents: ``segment_ids`` against the same call with the equivalent dense mask.

8 documents of 512 tokens packed into L = S = 4096 (B=1, H=8, E=64, float32, NumPy,
``implementation="blocked"``): with segment ids the planner skips the tiles between
documents (1/8 of the dense work); the dense boolean mask gives the same answer but its
values are data, so every tile is computed and masked. ``track_speedup_over_dense_mask``
is the ratio of the medians of interleaved runs in one process (the issue's target: at
least 4x, goal 6x). Run it alone with ``python asv_benchmarks/benchmarks/sequences.py``.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, ClassVar

import numpy as np

from sdpa_array import scaled_dot_product_attention

from .common import interleaved_times

DOCUMENTS, DOC_LEN, HEADS, E = 8, 512, 8, 64
ROUNDS = 5


def _inputs(causal: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    n = DOCUMENTS * DOC_LEN
    q, k, v = (rng.standard_normal((1, HEADS, n, E), dtype=np.float32) for _ in range(3))
    ids = np.repeat(np.arange(DOCUMENTS), DOC_LEN)[None]
    dense = ids[:, :, None] == ids[:, None, :]  # (1, L, S)
    if causal:
        dense = dense & np.tri(n, dtype=bool)
    return {"q": q, "k": k, "v": v, "ids": ids, "dense": dense[:, None], "causal": causal}


def _segments(x: dict[str, Any]) -> Any:
    return scaled_dot_product_attention(
        x["q"],
        x["k"],
        x["v"],
        segment_ids=(x["ids"], x["ids"]),
        is_causal=x["causal"],
        implementation="blocked",
    )


def _dense(x: dict[str, Any]) -> Any:
    # the causal restriction is in the mask already
    return scaled_dot_product_attention(
        x["q"], x["k"], x["v"], mask=x["dense"], implementation="blocked"
    )


class PackedDocuments:
    """Segment ids against the dense mask that says the same thing."""

    params: ClassVar = ([False, True],)
    param_names: ClassVar = ["causal"]
    timeout = 600

    def setup(self, causal: bool) -> None:
        self.x = _inputs(causal)

    def time_segment_ids(self, causal: bool) -> None:
        _segments(self.x)

    def time_dense_mask(self, causal: bool) -> None:
        _dense(self.x)

    def track_speedup_over_dense_mask(self, causal: bool) -> float:
        times = _interleaved(self.x)
        return statistics.median(times["dense"]) / statistics.median(times["segments"])

    track_speedup_over_dense_mask.unit = "x"  # type: ignore[attr-defined]


def _interleaved(x: dict[str, Any], rounds: int = ROUNDS) -> dict[str, list[float]]:
    return interleaved_times(
        {"segments": lambda: _segments(x), "dense": lambda: _dense(x)},
        lambda _: None,
        repeat=rounds,
    )


def main() -> int:
    for causal in (False, True):
        x = _inputs(causal)
        out_s, out_d = _segments(x), _dense(x)
        diff = float(np.max(np.abs(out_s - out_d)))
        times = _interleaved(x)
        med = {k: statistics.median(v) for k, v in times.items()}
        spread = {k: f"{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}" for k, v in times.items()}
        print(
            f"causal={causal}: segment_ids {med['segments'] * 1e3:.0f} ms "
            f"({spread['segments']}), dense mask {med['dense'] * 1e3:.0f} ms "
            f"({spread['dense']}), speed-up {med['dense'] / med['segments']:.2f}x "
            f"(median of {ROUNDS} interleaved rounds; max |difference| {diff:.1e})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
