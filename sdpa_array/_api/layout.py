"""The ``layout`` option: inputs and outputs held as (batch..., length, heads, features).

The library computes in ``"BHLE"`` (batch..., heads, length, features). A ``"BLHE"`` call
has its query, key, value (and the VJP's output cotangent) viewed with the heads and
length axes swapped (``permute_dims``: a view in NumPy, torch and CuPy, a transpose XLA
folds into its consumers under ``jit``), computes as usual, and returns the output and
the query, key and value gradients swapped back. Masks, biases, weights and the
log-sum-exp keep their (..., heads, L[, S]) shapes in both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._arrays.compat import array_namespace
from .._arrays.typing import Array

__all__ = ["LAYOUTS", "check_layout", "heads_first_forward", "swap_heads_and_length"]

#: The ``layout`` values.
LAYOUTS = ("BHLE", "BLHE")


def check_layout(layout: Any, named: dict[str, Any]) -> None:
    """Raise ``ValueError`` for an unknown ``layout``, or for ``"BLHE"`` with an array of
    fewer than three axes (there is no heads axis to swap)."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "BLHE":
        for name, x in named.items():
            if x is not None and hasattr(x, "shape") and len(x.shape) < 3:
                raise ValueError(
                    f'layout="BLHE" needs (..., L, H, E) arrays with a heads axis; {name} '
                    f"has shape {tuple(x.shape)}"
                )


def swap_heads_and_length(*arrays: Array) -> tuple[Array, ...]:
    """Each array with its axes -3 and -2 swapped (``None`` stays ``None``)."""
    out: list[Array] = []
    for x in arrays:
        if x is None:
            out.append(None)
            continue
        xp = array_namespace({"x": x})
        axes = list(range(x.ndim))
        axes[-3], axes[-2] = axes[-2], axes[-3]
        out.append(xp.permute_dims(x, tuple(axes)))
    return tuple(out)


def heads_first_forward(
    function: Callable[..., Any], query: Array, key: Array, value: Array, keywords: dict[str, Any]
) -> Any:
    """``function(query, key, value, **keywords)`` on ``"BLHE"`` arrays: called heads first
    on views, its output (the first of its results) swapped back."""
    result = function(*swap_heads_and_length(query, key, value), **keywords)
    if isinstance(result, tuple):
        return (swap_heads_and_length(result[0])[0], *result[1:])
    return swap_heads_and_length(result)[0]
