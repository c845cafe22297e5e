"""Validation of the call's scalar options: flags, ``alignment``, ``padding_side``,
``scale``, ``softcap`` and ``window``, each into the value the problem holds."""

from __future__ import annotations

import math
import numbers
import operator
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace, is_array_api_obj, known_value
from .._arrays.typing import Array

__all__ = [
    "ALIGNMENTS",
    "PADDING_SIDES",
    "check_flag",
    "check_padding_side",
    "positive_finite",
    "scale_option",
    "window_option",
]

ALIGNMENTS = ("top_left", "bottom_right")

#: Where each row's padding sits: after its valid tokens (``"right"``) or before them.
PADDING_SIDES = ("right", "left")


def check_padding_side(padding_side: Any) -> bool:
    """Whether the rows are padded on the left; ``ValueError`` unless ``padding_side`` is
    one of :data:`PADDING_SIDES`."""
    if not isinstance(padding_side, str) or padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    return padding_side == "left"


def positive_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    result = float(value)
    if not (math.isfinite(result) and result > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return result


def scale_option(xp: ModuleType, query: Any, scale: Any, E: int) -> float | Array:
    """The validated ``scale``: a float, or the caller's 0-d array of the inputs' library.

    An array's value is checked where it can be read (not on lazy or traced arrays).
    """
    if scale is None:  # with E == 0 every score is 0 whatever the scale
        return 1.0 / math.sqrt(E) if E > 0 else 1.0
    if isinstance(scale, np.generic) or not is_array_api_obj(scale):
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(
                "scale must be a real number or a 0-d array of the inputs' library, got "
                f"{type(scale).__name__} {scale!r}"
            )
        return positive_finite("scale", scale)
    try:
        array_namespace({"query": query, "scale": scale})
    except TypeError:
        raise TypeError(
            "scale must be a real number or a 0-d array of the inputs' library "
            f"({type(query).__module__}.{type(query).__qualname__}), got "
            f"{type(scale).__module__}.{type(scale).__qualname__}"
        ) from None
    if scale.ndim != 0:
        raise ValueError(
            "scale must be a real number or a 0-d array, got an array of shape "
            f"{tuple(scale.shape)}"
        )
    if not xp.isdtype(scale.dtype, "real floating"):
        raise TypeError(f"scale must have a real floating dtype, got {scale.dtype}")
    value = known_value(scale)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a positive finite number, got {value!r}")
    return scale


def check_flag(name: str, flag: Any) -> None:
    """Raise ``TypeError`` unless ``flag`` is a bool (Python's or NumPy's)."""
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def window_option(window: Any) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints or None, got {window!r}")
    sides: list[int | None] = []
    for side_name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool):
            raise TypeError(f"window {side_name} size must be an int or None, got {side!r}")
        try:
            size = operator.index(side)
        except TypeError:
            raise TypeError(
                f"window {side_name} size must be an int or None, got {type(side).__name__}"
            ) from None
        if size < 0:
            raise ValueError(f"window {side_name} size must be non-negative, got {size}")
        sides.append(size)
    return sides[0], sides[1]
