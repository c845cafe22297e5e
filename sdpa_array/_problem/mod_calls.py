"""Calling a ``mask_mod``, ``bias_mod`` or ``score_mod`` and checking what it returns, in
one place.

A mod is called as ``mod(batch, head, q_idx, kv_idx)`` with integer arrays of one library
that broadcast together to the shape of the scores being computed (see
:mod:`sdpa_array.mods`); a ``score_mod`` (and its ``derivative``) gets the scores first,
``score_mod(score, batch, head, q_idx, kv_idx)``. :func:`index_grid` builds those arrays
for a grid of scores; :func:`call_mod` calls the mod and turns every way it can go wrong (it
raises, returns something that is not an array of that library, of the wrong dtype or of a
shape that does not broadcast to the scores) into an error that names the argument and the
mod. The validation, :func:`sdpa_array.create_block_mask` and the kernels all call mods
through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace, is_array_api_obj
from .._arrays.typing import Array

__all__ = ["MOD_KINDS", "call_mod", "check_mod_callable", "index_grid"]

#: The dtype kind each mod must return (``xp.isdtype`` kinds) and how it is described.
MOD_KINDS = {
    "mask_mod": ("bool", "a boolean"),
    "bias_mod": ("real floating", "a real floating"),
    "score_mod": ("real floating", "a real floating"),
    "score_mod.derivative": ("real floating", "a real floating"),
}


def check_mod_callable(name: str, mod: Any) -> None:
    """Raise ``TypeError`` unless ``mod`` is callable (``None`` is accepted: no mod)."""
    if mod is not None and not callable(mod):
        score = "score, " if name.startswith("score_mod") else ""
        raise TypeError(
            f"{name} must be a callable {name}({score}batch, head, q_idx, kv_idx) or None, "
            f"got {type(mod).__name__} {mod!r}"
        )


def index_grid(
    xp: ModuleType,
    device: Any,
    batch: tuple[int, ...],
    heads: tuple[int, ...],
    rows: slice,
    cols: slice,
) -> tuple[Array, Array, Array, Array]:
    """``(batch, head, q_idx, kv_idx)`` index arrays for the scores of a grid.

    The scores have the shape ``(*batch, *heads, rows, cols)``: ``batch`` is the shape of the
    leading batch axes (their row-major flat index is passed), ``heads`` that of the heads
    axes (one axis, or ``(Hkv, G)`` under grouped-query attention; the query head index
    ``hkv * G + g`` is passed). Each array has ``len(batch) + len(heads) + 2`` axes, of
    size 1 except its own.
    """
    nb, nh = len(batch), len(heads)
    ndim = nb + nh + 2

    def axis_range(start: int, stop: int, shape: tuple[int, ...], before: int) -> Array:
        values = xp.arange(start, stop, device=device)
        return xp.reshape(values, (1,) * before + shape + (1,) * (ndim - before - len(shape)))

    return (
        axis_range(0, math.prod(batch), batch, 0),
        axis_range(0, math.prod(heads), heads, nb),
        axis_range(rows.start, rows.stop, (rows.stop - rows.start,), nb + nh),
        axis_range(cols.start, cols.stop, (cols.stop - cols.start,), nb + nh + 1),
    )


def _describe(mod: Callable[..., Any]) -> str:
    return getattr(mod, "__qualname__", None) or repr(mod)


def call_mod(
    name: str,
    mod: Callable[..., Any],
    indices: tuple[Array, ...],
    shape: tuple[int, ...],
    score: Array | None = None,
) -> Array:
    """``mod(*indices)`` (``mod(score, *indices)`` for a score function), checked: an array
    of the indices' library and ``name``'s dtype kind that broadcasts to the scores' ``shape``
    (``score_mod``'s: of exactly ``score``'s shape, as it computes element by element; its
    derivative, a factor, may broadcast).

    Raises
    ------
    ValueError
        The mod raised (the original error is chained), or its result does not broadcast
        to ``shape`` (``score_mod``'s is not of ``score``'s shape).
    TypeError
        The result is not an array of the indices' library, or has the wrong dtype.
    """
    try:
        result = mod(*indices) if score is None else mod(score, *indices)
    except Exception as exc:
        raise ValueError(f"{name} {_describe(mod)} raised {type(exc).__name__}: {exc}") from exc
    q_idx = indices[2]
    if not is_array_api_obj(result) or isinstance(result, np.generic):
        raise TypeError(
            f"{name} {_describe(mod)} must return an array of the index arrays' library "
            f"({type(q_idx).__module__}.{type(q_idx).__qualname__}), got "
            f"{type(result).__module__}.{type(result).__qualname__}"
        )
    try:
        xp = array_namespace({name: result, "q_idx": q_idx})
    except TypeError:
        raise TypeError(
            f"{name} {_describe(mod)} returned a {type(result).__module__}."
            f"{type(result).__qualname__} for index arrays of "
            f"{type(q_idx).__module__}.{type(q_idx).__qualname__}; it must compute with "
            "the index arrays' library (array_api_compat.array_namespace(q_idx))"
        ) from None
    kind, described = MOD_KINDS[name]
    if not xp.isdtype(result.dtype, kind):
        raise TypeError(
            f"{name} {_describe(mod)} must return {described} array, got {result.dtype}"
        )
    got = tuple(result.shape)
    if name == "score_mod" and score is not None and got != tuple(score.shape):
        raise ValueError(
            f"{name} {_describe(mod)} returned shape {got}, not the shape "
            f"{tuple(score.shape)} of the scores it was given: a score function computes "
            "element by element, so its result has exactly the scores' shape"
        )
    try:
        fits = tuple(np.broadcast_shapes(got, shape)) == tuple(shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name} {_describe(mod)} returned shape {got}, which does not broadcast to the "
            f"shape {tuple(shape)} of the scores its index arrays describe"
        )
    return result
