"""The bits of attention dropout for the public face, from the kernels' hash."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._arrays.typing import Array
from .._kernels.dropout import keep_mask

__all__ = ["dropout_keep_bits"]


def dropout_keep_bits(
    xp: ModuleType, seed: int | Array, shape: tuple[int, ...], p: float, device: Any
) -> Array:
    """The keep mask of a validated ``(..., Hq, L, S)`` grid (``True`` where a weight is
    kept): the bits every kernel draws for ``dropout_seed`` ``seed`` and ``dropout_p``
    ``p`` (:func:`sdpa_array.dropout_keep_mask` checks the arguments)."""
    return keep_mask(xp, seed, shape, p, device)
