"""The packed variable-length layout against the same work padded to a batch.

NumPy, float32, 16 sequences of lengths between 64 and 2048 (drawn once, total 16384
tokens), 8 heads of 64 features, self-attention, plain and causal. Three calls compute the
same sequences:

* ``packed``: :func:`sdpa_array.scaled_dot_product_attention_varlen` on ``(16384, 8, 64)``;
* ``padded, key_lengths``: :func:`sdpa_array.scaled_dot_product_attention` on the
  sequences padded to ``(16, 2048, 8, 64)`` (``layout="BLHE"``) with ``key_lengths``, the
  comparison the target names (the padded queries are computed too);
* ``padded, both lengths``: the same with ``query_lengths`` as well.

Rounds interleave the calls (rotating which goes first); the table gives each median with
its min-max and the padded / packed ratio. The *work ratio* beside it counts the (query,
key) pairs each call computes at most (the padded call skips the key tiles past
``key_lengths``, so it computes ``2048 * sum(L)`` pairs against the packed call's
``sum(L**2)``; with causal, ``sum(L**2 / 2 + (2048 - L) * L)`` against ``sum(L**2 / 2)``,
the padded queries attending every key of their sequence). With 16 sequences of total
16384, ``sum(L**2) >= 16384**2 / 16``, so the work ratio is at most 2 without causal and 3
with it, both reached only when every length is 1024::

    python asv_benchmarks/studies/varlen_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import sdpa_array

N, H, E, LONGEST, SHORTEST, TOTAL = 16, 8, 64, 2048, 64, 16384


def lengths(seed: int = 0) -> np.ndarray:
    """16 lengths in [64, 2048] summing to 16384, drawn uniformly then scaled to the total."""
    rng = np.random.default_rng(seed)
    drawn = rng.uniform(SHORTEST, LONGEST, N)
    out = np.clip(np.round(drawn * TOTAL / drawn.sum()), SHORTEST, LONGEST).astype(np.int64)
    i = 0
    while out.sum() != TOTAL:  # spread the rounding's remainder, within the range
        step = 1 if out.sum() < TOTAL else -1
        if SHORTEST <= out[i % N] + step <= LONGEST:
            out[i % N] += step
        i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sizes = lengths()
    cu = np.concatenate([[0], np.cumsum(sizes)])
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((TOTAL, H, E), dtype=np.float32) for _ in range(3))
    padded = []
    for x in (q, k, v):
        p = np.zeros((N, LONGEST, H, E), dtype=np.float32)
        for n in range(N):
            p[n, : sizes[n]] = x[cu[n] : cu[n + 1]]
        padded.append(p)

    def packed(**o):
        return sdpa_array.scaled_dot_product_attention_varlen(q, k, v, cu, **o)

    def by_keys(**o):
        return sdpa_array.scaled_dot_product_attention(
            *padded, layout="BLHE", key_lengths=sizes, **o
        )

    def by_both(**o):
        return sdpa_array.scaled_dot_product_attention(
            *padded, layout="BLHE", key_lengths=sizes, query_lengths=sizes, **o
        )

    calls = {"packed": packed, "padded, key_lengths": by_keys, "padded, both lengths": by_both}
    variants = {"plain": {}, "causal": {"is_causal": True}}
    out = packed(is_causal=True)
    want = by_keys(is_causal=True)
    for n in range(N):  # the same results, sequence by sequence
        np.testing.assert_allclose(out[cu[n] : cu[n + 1]], want[n, : sizes[n]], atol=1e-4)
    times = {(c, w): [] for c in calls for w in variants}
    for r in range(args.rounds):
        for w, options in variants.items():
            order = list(calls)
            order = order[r % len(order) :] + order[: r % len(order)]
            for c in order:
                t0 = time.perf_counter()
                calls[c](**options)
                times[(c, w)].append(time.perf_counter() - t0)
    print(
        f"NumPy {np.__version__}, float32, {N} sequences (lengths {sorted(sizes.tolist())}), "
        f"H={H}, E={E}, {args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    pairs = float(np.sum(sizes.astype(np.float64) ** 2))
    causal = (pairs / 2 + float(np.sum((LONGEST - sizes) * sizes))) / (pairs / 2)
    print(
        "work ratio (pairs computed, padded with key_lengths / packed): "
        f"plain {LONGEST * TOTAL / pairs:.2f}, causal {causal:.2f}"
    )
    for w in variants:
        base = statistics.median(times[("packed", w)])
        for c in calls:
            t = times[(c, w)]
            print(
                f"{w:6s} {c:22s} {statistics.median(t) * 1e3:9.1f} ms "
                f"({min(t) * 1e3:.1f}-{max(t) * 1e3:.1f})  / packed "
                f"{statistics.median(t) / base:.2f}"
            )


if __name__ == "__main__":
    main()
