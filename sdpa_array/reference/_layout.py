"""The oracle's reading of the ``layout`` option: ``"BLHE"`` inputs have their length and
heads axes exchanged (in their own library, so mask and bias functions still receive that
library's index arrays), and the results exchanged back in NumPy."""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

LAYOUTS = ("BHLE", "BLHE")


def heads_first(layout: str, *arrays: Any) -> tuple[Any, ...]:
    """The arrays as ``(..., H, L, E)``: unchanged for ``"BHLE"``, axes -3 and -2 exchanged
    for ``"BLHE"`` (``ValueError`` for another layout or an array of fewer than 3 axes)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "BHLE":
        return arrays
    out = []
    for x in arrays:
        if len(np.shape(x)) < 3:
            raise ValueError(f'layout="BLHE" needs a heads axis, got shape {np.shape(x)}')
        if isinstance(x, np.ndarray) or not array_api_compat.is_array_api_obj(x):
            out.append(np.swapaxes(np.asarray(x), -3, -2))
        else:
            xp = array_api_compat.array_namespace(x)
            order = [*range(x.ndim - 3), x.ndim - 2, x.ndim - 3, x.ndim - 1]
            out.append(xp.permute_dims(x, tuple(order)))
    return tuple(out)


def heads_back(layout: str, x: np.ndarray) -> np.ndarray:
    """A NumPy result ``(..., H, L, E)`` in ``layout``."""
    return np.swapaxes(x, -3, -2) if layout == "BLHE" else x
