"""What a decoding step over a KV cache costs beside the forward on the same tokens.

torch CPU, float32: one new query, 32 query heads over 8 key/value heads (GQA), E = 128,
against a contiguous cache holding 256 tokens of 320 slots. :class:`DecodeStep` times, in
one process and interleaved (:data:`ROUNDS` rounds after a warm-up, :data:`CALLS` calls per
sample), ``attention_with_kv_cache`` on the cache (no new token), the same with one new
token written first, :func:`~sdpa_array.scaled_dot_product_attention` on the cache's first
256 tokens (views), and torch's own ``scaled_dot_product_attention`` on them. It tracks the
ratio of the decoding call's median to the forward's (good is <= 1.2: the planner runs
the forward on the cache's slice, so only the cache call's own checks are added) and the
host microseconds of one decoding call beyond torch's kernel (good is < 100).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, ClassVar

from sdpa_array import attention_with_kv_cache, scaled_dot_product_attention

#: Interleaved rounds (median), and calls per timed sample.
ROUNDS = 15
CALLS = 20

#: (query heads, key/value heads, head size, cached tokens, cache slots)
CASE = (32, 8, 128, 256, 320)


def _interleaved(candidates: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of one call of each candidate: ``rounds`` samples of :data:`CALLS`
    calls, the candidates taking turns within each round, after one untimed round."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(rounds + 1):
        for name, call in candidates.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            if round_:
                times[name].append((time.perf_counter() - start) / CALLS)
    return {name: statistics.median(found) for name, found in times.items()}


class DecodeStep:
    """One decoding step against the forward on the same contiguous cache."""

    params: ClassVar = (["32x8x128-256"],)
    param_names: ClassVar = ["case"]
    timeout = 300

    def setup(self, case: str) -> None:
        try:
            import torch
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        self.torch = torch
        hq, hkv, e, n, slots = CASE
        gen = torch.Generator().manual_seed(0)
        self.n = n
        self.q = torch.randn(1, hq, 1, e, generator=gen)
        self.k_cache = torch.randn(1, hkv, slots, e, generator=gen)
        self.v_cache = torch.randn(1, hkv, slots, e, generator=gen)
        self.new_k = torch.randn(1, hkv, 1, e, generator=gen)
        self.new_v = torch.randn(1, hkv, 1, e, generator=gen)
        self.k, self.v = self.k_cache[:, :, :n, :], self.v_cache[:, :, :n, :]

    def _decode(self) -> Any:
        return attention_with_kv_cache(
            self.q, self.k_cache, self.v_cache, cache_lengths=[self.n], enable_gqa=True
        )

    def _decode_new(self) -> Any:
        return attention_with_kv_cache(
            self.q,
            self.k_cache,
            self.v_cache,
            cache_lengths=[self.n - 1],
            new_key=self.new_k,
            new_value=self.new_v,
            enable_gqa=True,
        )

    def _forward(self) -> Any:
        return scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True)

    def _torch(self) -> Any:
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        return sdpa(self.q, self.k, self.v, enable_gqa=True)

    def _medians(self) -> dict[str, float]:
        return _interleaved(
            {
                "decode": self._decode,
                "decode_new": self._decode_new,
                "forward": self._forward,
                "torch": self._torch,
            },
            ROUNDS,
        )

    def track_decode_over_forward_ratio(self, case: str) -> float:
        """Median decoding call (no new token) / median
        ``scaled_dot_product_attention`` on the cache's 256 tokens; lower is better, good
        is <= 1.2."""
        medians = self._medians()
        return medians["decode"] / medians["forward"]

    track_decode_over_forward_ratio.unit = "ratio"  # type: ignore[attr-defined]

    def track_decode_new_token_over_forward_ratio(self, case: str) -> float:
        """The same with one new token written into the cache first; lower is better, good
        is <= 1.2."""
        medians = self._medians()
        return medians["decode_new"] / medians["forward"]

    track_decode_new_token_over_forward_ratio.unit = "ratio"  # type: ignore[attr-defined]

    def track_decode_host_microseconds(self, case: str) -> float:
        """Microseconds of one decoding call beyond torch's own kernel on the same tokens
        (the library's host work: checks, plan, slicing, the forward's own); lower is
        better, good is < 100."""
        medians = self._medians()
        return (medians["decode"] - medians["torch"]) * 1e6

    track_decode_host_microseconds.unit = "microseconds"  # type: ignore[attr-defined]

    def time_decode(self, case: str) -> None:
        """One decoding call."""
        self._decode()

    def time_forward(self, case: str) -> None:
        """``scaled_dot_product_attention`` on the same tokens."""
        self._forward()
