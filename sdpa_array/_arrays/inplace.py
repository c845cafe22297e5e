"""Updates in place where the array allows it: the one place that decides.

NumPy, CuPy, array-api-strict and torch (outside autograd) update an array in place, which
saves a temporary per tile; JAX arrays are immutable (array-api-compat's
``is_writeable_array`` says so, as it does for a read-only NumPy array) and get a new array,
and a Dask array's ``x -= y`` builds a new lazy array. A torch tensor that takes part in
autograd must not be changed in place (the values saved for its backward pass would change),
nor can a tensor combined with one that a
``torch.func`` transform wraps (under ``vmap`` the other operand may hold more elements than
it shows), and a read-only NumPy array cannot be.
The kernels call :func:`add`, :func:`add_rows`, :func:`subtract`, :func:`multiply`,
:func:`exp`, :func:`exp2` and :func:`where_tile` on arrays they created themselves, and
:func:`fillable` for a result they fill block by block.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
from array_api_compat import (
    device,
    is_dask_array,
    is_jax_array,
    is_numpy_array,
    is_torch_array,
    is_writeable_array,
)

from .compat import namespace_name
from .typing import Array

__all__ = [
    "add",
    "add_rows",
    "exp",
    "exp2",
    "exp2_is_faster",
    "fillable",
    "multiply",
    "subtract",
    "transposed_layout",
    "where_tile",
]


def _functorch_wrapped(a: Array) -> bool:
    """Whether ``a`` is a tensor wrapped by a ``torch.func`` transform (``vmap``, ``grad``)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(a, torch.Tensor):
        return False
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(a))


def _functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``) is running."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return torch._C._functorch.maybe_current_level() is not None


def _in_place(x: Array, y: Array) -> bool:
    """Whether ``x`` may take the result of ``x op y``: its shape holds it and it is writable."""
    xs, ys = tuple(x.shape), tuple(getattr(y, "shape", ()))
    if len(ys) > len(xs) or any(b not in (1, a) for a, b in zip(xs[::-1], ys[::-1], strict=False)):
        return False
    return _writable(x, y)


def _writable(x: Array, y: Array) -> bool:
    """Whether ``x`` may be changed in place with values computed from ``y``."""
    if getattr(x, "requires_grad", False) or getattr(y, "requires_grad", False):
        return False
    if _functorch_wrapped(x) or _functorch_wrapped(y):
        return False
    return bool(is_writeable_array(x))  # False for read-only NumPy arrays and for JAX


def add(x: Array, y: Array) -> Array:
    """``x + y``, written into ``x`` where that is allowed; use the returned array."""
    if _in_place(x, y):
        x += y
        return x
    return x + y


def subtract(x: Array, y: Array) -> Array:
    """``x - y``, written into ``x`` where that is allowed; use the returned array."""
    if _in_place(x, y):
        x -= y
        return x
    return x - y


def multiply(x: Array, y: Array) -> Array:
    """``x * y``, written into ``x`` where that is allowed; use the returned array."""
    if _in_place(x, y):
        x *= y
        return x
    return x * y


def add_rows(xp: ModuleType, x: Array, start: int, stop: int, y: Array) -> Array:
    """``x`` with ``y`` added to its rows ``[start, stop)`` (second-to-last axis), written
    into ``x`` where that is allowed, else put together anew; use the returned array."""
    if tuple(y.shape) == (*x.shape[:-2], stop - start, x.shape[-1]) and _writable(x, y):
        x[..., start:stop, :] += y
        return x
    parts = [x[..., :start, :], x[..., start:stop, :] + y, x[..., stop:, :]]
    return xp.concat(parts, axis=-2)


def exp(xp: ModuleType, x: Array) -> Array:
    """``exp(x)``, written into ``x`` where that is allowed; use the returned array.

    NumPy's ``exp`` writes through ``out=`` and torch's through ``exp_``; other libraries
    (the Array API has no ``out=``) get a new array. Writing in place saves a tile-sized
    allocation per tile, which on NumPy costs as much as the exponential itself.
    """
    return _unary(xp, x, "exp")


def has_exp2(xp: ModuleType) -> bool:
    """Whether ``xp`` has ``exp2`` (NumPy, torch, JAX, CuPy; not the Array API standard)."""
    return callable(getattr(xp, "exp2", None))


def exp2_is_faster(xp: ModuleType, dtype: Any) -> bool:
    """Whether to exponentiate arrays of the namespace ``xp`` and ``dtype`` with ``exp2``.

    A kernel that can take either ``exp`` of its scores or ``exp2`` of its scores times
    ``log2(e)`` asks this. NumPy's speed of the two depends on the CPU features its build
    dispatches to (float32 ``exp2`` is about twice as fast as ``exp`` with AVX-512, about
    twice as slow with AVX2 alone), so for NumPy both are timed once per dtype in the
    process (:func:`numpy_exp2_is_faster`) and ``exp2`` is taken where it is clearly
    faster. Other libraries with ``exp2`` take it (a GPU's ``exp2`` is its hardware
    instruction and ``exp`` is computed from it); libraries without it take ``exp``.
    """
    if not has_exp2(xp):
        return False
    if namespace_name(xp) == "numpy":
        return numpy_exp2_is_faster(np.dtype(dtype).name)
    return True


#: ``exp2`` is taken on NumPy when its best time is at most this share of ``exp``'s: a
#: clear margin, so that a CPU where the two are close keeps ``exp`` in every process.
EXP2_MARGIN = 0.8


@functools.cache
def numpy_exp2_is_faster(dtype: str) -> bool:
    """Whether NumPy's ``exp2`` is clearly faster than its ``exp`` on this machine for
    ``dtype`` (a floating dtype's name): :func:`clearly_faster`, about a millisecond once
    per dtype and process."""
    return clearly_faster(np.exp2, np.exp, dtype)


def clearly_faster(candidate: Callable[..., Any], baseline: Callable[..., Any], dtype: str) -> bool:
    """Whether the NumPy ufunc-like ``candidate`` takes at most :data:`EXP2_MARGIN` of
    ``baseline``'s time: the best of 7 interleaved timings of each, in place (``out=``) on
    2**14 elements of ``dtype`` spread over ``[-30, 0]`` (where a softmax's exponents lie)."""
    values = np.linspace(-30.0, 0.0, 1 << 14, dtype=dtype)
    work = np.empty_like(values)
    best = [math.inf, math.inf]
    for _ in range(7):
        for i, function in enumerate((candidate, baseline)):
            np.copyto(work, values)
            start = time.perf_counter()
            function(work, out=work)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] <= EXP2_MARGIN * best[1]


def exp2(xp: ModuleType, x: Array) -> Array:
    """``2 ** x`` (``xp`` must have ``exp2``: :func:`has_exp2`), written into ``x`` where
    that is allowed, as :func:`exp`; use the returned array."""
    return _unary(xp, x, "exp2")


def _unary(xp: ModuleType, x: Array, name: str) -> Array:
    """``xp.<name>(x)``, through NumPy's ``out=`` or torch's ``<name>_`` where ``x`` may be
    written."""
    if _writable(x, x):
        if is_numpy_array(x):
            return getattr(np, name)(x, out=x)
        if is_torch_array(x):
            return getattr(x, f"{name}_")()
    return getattr(xp, name)(x)


def _broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The broadcast shape of ``a`` and ``b``, or ``None`` when they do not broadcast."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b, strict=True)):
        return None
    return tuple(max(x, y) for x, y in zip(a, b, strict=True))


def _fill_through_view(x: Array) -> bool:
    """Whether to fill through a boolean index of a slice's view: NumPy, whose slices are
    views and whose boolean fill needs no temporary (a boolean index on a GPU library
    would wait for the device to count the entries)."""
    return bool(is_numpy_array(x))


def transposed_layout(xp: ModuleType, x: Array) -> Array:
    """``x`` laid out as the transposed view of an array (its last axis strided), to update
    such a view element by element in memory order (NumPy; other libraries keep ``x``)."""
    if is_numpy_array(x):
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)
    return x


def where_tile(
    xp: ModuleType, x: Array, rows: slice, cols: slice, excluded: Array, fill: Array
) -> Array:
    """``x`` whose entries in ``rows`` and ``cols`` (its last two axes, slices of ``x``'s
    own indices) hold ``fill`` where ``excluded`` is true; all others are kept as they are.

    Written into ``x`` where that is allowed (the library writes through indexing and
    ``x`` keeps its shape): on NumPy through a boolean index of the region's view (no
    temporary of it), else by assigning a ``where``; otherwise put together anew, with
    ``excluded`` grown by rows of ``False`` to all of ``x``'s rows. Use the returned array.
    """
    view = x[..., rows, cols]
    shape = _broadcast_shape(tuple(excluded.shape), tuple(view.shape))
    if shape == tuple(view.shape) and _writable(x, excluded):
        if _fill_through_view(x):
            view[xp.broadcast_to(excluded, shape)] = fill
        else:
            x[..., rows, cols] = xp.where(excluded, fill, view)
        return x
    n = int(x.shape[-2])
    if rows.start > 0 or rows.stop < n:
        lead, width = tuple(excluded.shape[:-2]), cols.stop - cols.start
        where = device(excluded)
        excluded = xp.concat(
            [
                xp.zeros((*lead, rows.start, width), dtype=xp.bool, device=where),
                xp.broadcast_to(excluded, (*lead, rows.stop - rows.start, width)),
                xp.zeros((*lead, n - rows.stop, width), dtype=xp.bool, device=where),
            ],
            axis=-2,
        )
    part = xp.where(excluded, fill, x[..., cols])
    if cols.start == 0 and cols.stop >= x.shape[-1]:
        return part
    lead = tuple(part.shape[:-1])
    pieces = [x[..., : cols.start], part, x[..., cols.stop :]]
    shaped = [xp.broadcast_to(a, (*lead, int(a.shape[-1]))) for a in pieces]
    return xp.concat(shaped, axis=-1)


def fillable(
    xp: ModuleType, shape: tuple[int, ...], dtype: object, device: object, *operands: Array
) -> Array | None:
    """A new uninitialised array of ``shape`` that the kernels may fill through indexing
    with values computed from ``operands``, or ``None`` where that is not allowed (the
    rules of :func:`add`; inside a ``torch.func`` transform any other value of the call, a
    scale or a function's parameters, may be the transformed one) or not worth it: JAX
    arrays are immutable, and a Dask array's assignment only adds tasks to its graph."""
    if _functorch_active() or any(is_dask_array(x) or is_jax_array(x) for x in operands):
        return None  # before allocating: a JAX array would be made and thrown away
    out = xp.empty(shape, dtype=dtype, device=device)
    writable = is_writeable_array(out) and all(_writable(out, x) for x in operands)
    return out if writable else None
