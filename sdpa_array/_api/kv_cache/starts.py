"""``cache_leftpad``: where each sequence's tokens start in its cache (left padding).

A batch padded on the left, as batched generation fills a cache, holds sequence ``b``'s
tokens at positions ``[cache_leftpad[b], n_b)``: the slots before are padding, never
attended and never read (FlashAttention's ``cache_leftpad``). The positions stay those of
the cache, so the bottom-right diagonal of query ``i`` is still token ``n_b - L + i``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["check_starts"]


def check_starts(
    xp: ModuleType,
    value: Any,
    B: int,
    host_lengths: tuple[int, ...] | None,
    new: int,
    integers: Any,
) -> tuple[int, ...] | Any:
    """``cache_leftpad`` as a tuple of ints where it can be read on the host (checked
    against ``[0, cache_lengths[b] + new]``), else the caller's array; ``None`` stays
    ``None``.

    ``integers`` is the argument checker of the lengths (shape ``(B,)``, integer dtype).

    Raises
    ------
    TypeError
        Not integers.
    ValueError
        Not of shape ``(B,)``, or a readable start outside ``[0, n_b]``.
    """
    if value is None:
        return None
    starts = integers(xp, "cache_leftpad", value, (B,), "(B,)")
    if not isinstance(starts, np.ndarray):
        return starts
    for b, start in enumerate(starts.tolist()):
        n = None if host_lengths is None else int(host_lengths[b]) + new
        if start < 0 or (n is not None and start > n):
            limit = "" if n is None else f" and at most the {n} attended tokens"
            raise ValueError(
                f"cache_leftpad[{b}] = {start}: each start must be non-negative{limit} "
                "(cache_lengths plus the new tokens)"
            )
    return tuple(int(s) for s in starts.tolist())
