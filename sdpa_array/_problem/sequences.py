"""Validation of the sequence arguments: ``query_lengths``, ``key_lengths``, ``segment_ids``.

Each is checked here, before any array work, and becomes a record holding the values as an
integer array of the inputs' library (on their device) and, where they can be read, as a
NumPy copy: the blocked kernels plan with the host copy (skipping the tiles the values
exclude) and mask with the array. Values are range-checked where they can be read; on lazy
Dask arrays and JAX tracers they cannot, and lengths are clipped to ``[0, L]`` / ``[0, S]``
instead.

The *sequence batch* is the batch shape without the heads axis: the leading axes before
axis ``-3`` (``()`` for inputs without a heads axis).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace, device, host_values, is_array_api_obj
from .._arrays.typing import Array

__all__ = ["Lengths", "Segments", "check_lengths", "check_segments", "lengths_at", "zero_past"]


@dataclass(frozen=True)
class Lengths:
    """Per-sequence lengths of one side (queries or keys).

    Attributes
    ----------
    array : array
        Integer array of the inputs' library, broadcastable to the sequence batch.
    host : numpy.ndarray or None
        The same values on the host, or ``None`` where they cannot be read.
    left : bool
        Whether the padding comes first (``padding_side="left"``): the valid tokens are the
        last ``length`` of each row, ``[n - length, n)``, instead of the first.
    """

    array: Array
    host: np.ndarray | None
    left: bool = False


@dataclass(frozen=True)
class Segments:
    """Segment ids of queries ``(..., L)`` and keys ``(..., S)`` (no heads axis).

    Attributes
    ----------
    query, key : array
        Integer arrays of the inputs' library.
    query_host, key_host : numpy.ndarray or None
        The same values on the host, or ``None`` where they cannot be read.
    """

    query: Array
    key: Array
    query_host: np.ndarray | None
    key_host: np.ndarray | None


def lengths_at(xp: ModuleType, lengths: Array, offset: int, n: int) -> Array:
    """The lengths of the block of ``n`` rows at ``offset`` of the whole sequence: each
    sequence's valid rows among them, ``lengths - offset`` clipped to ``[0, n]`` (padding
    on the right)."""
    return xp.clip(lengths - offset, 0, n)


def zero_past(
    xp: ModuleType,
    rows: Array,
    lengths: Lengths | None,
    n: int,
    *,
    heads: int,
    features: bool = True,
) -> Array:
    """``rows`` with every padding row set to zero: at or past its sequence's length, or
    before ``n - length`` when the padding is on the left.

    ``rows`` is ``(*sequence batch, [Hq,] n, X)`` (``features=False``: without ``X``) and
    ``heads`` is 1 where it has the heads axis, else 0. Rows past the lengths are padding:
    memory the caller may never have initialised. Every restriction already gives them zero
    weight, but a product of a zero weight with a NaN or an infinity there is NaN, so the
    kernels receive zeros instead; ``xp.where`` also makes their gradients exactly zero.
    """
    if lengths is None:
        return rows
    limit = lengths.array
    trailing = (1,) * (heads + 1 + features)
    limit = xp.reshape(limit, (*tuple(limit.shape), *trailing))
    positions = xp.arange(n, dtype=limit.dtype, device=device(rows))
    if features:
        positions = xp.reshape(positions, (n, 1))
    zero = xp.zeros((), dtype=rows.dtype, device=device(rows))
    valid = positions >= n - limit if lengths.left else positions < limit
    return xp.where(valid, rows, zero)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return tuple(np.broadcast_shapes(shape, target)) == tuple(target)
    except ValueError:
        return False


def _integer_array(
    name: str, value: Any, xp: ModuleType, device: Any, like: Any
) -> tuple[Array, np.ndarray | None]:
    """``value`` as an integer array of ``xp`` on ``device``, and its host values if known.

    Accepts Python and NumPy integers, NumPy arrays (whatever the inputs' library: their
    values are on the host) and arrays of the inputs' library.
    """
    index_dtype = xp.asarray(0, device=device).dtype
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be integers, got a bool")
    if isinstance(value, numbers.Integral):
        if not -(2**62) <= int(value) <= 2**62:
            raise ValueError(f"{name} must be between 0 and the sequence length, got {value}")
        host = np.asarray(int(value))
        return xp.asarray(host, dtype=index_dtype, device=device), host
    if isinstance(value, np.ndarray) and xp.__name__ != np.__name__:
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
        return xp.asarray(value, dtype=index_dtype, device=device), value
    if not is_array_api_obj(value):
        raise TypeError(
            f"{name} must be an int or an integer array, got {type(value).__name__} {value!r}"
        )
    try:
        array_namespace({"query": like, name: value})
    except TypeError:
        raise TypeError(
            f"{name} must be an int, a NumPy array or an array of the inputs' library "
            f"({type(like).__module__}.{type(like).__qualname__}), got "
            f"{type(value).__module__}.{type(value).__qualname__}"
        ) from None
    if not xp.isdtype(value.dtype, "integral"):
        raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
    # on a GPU the values stay there: tiles are then planned without them (no host copy)
    return xp.astype(value, index_dtype), host_values(value, from_device=False)


def check_lengths(
    name: str,
    value: Any,
    *,
    xp: ModuleType,
    device: Any,
    like: Any,
    batch: tuple[int, ...],
    limit: int,
    left: bool = False,
) -> Lengths | None:
    """Validate ``query_lengths`` or ``key_lengths`` (``name``) against ``[0, limit]``;
    ``left``: the rows are padded on the left.

    Raises
    ------
    TypeError
        Not an int or an integer array of the inputs' library (or NumPy).
    ValueError
        A shape that does not broadcast to the sequence ``batch``, or readable values
        outside ``[0, limit]``.
    """
    if value is None:
        return None
    array, host = _integer_array(name, value, xp, device, like)
    shape = tuple(array.shape)
    if not _broadcasts_to(shape, batch):
        raise ValueError(
            f"{name} of shape {shape} does not broadcast to the batch shape {batch} (the "
            "axes before the heads axis)"
        )
    if host is not None:
        if host.size and (host.min() < 0 or host.max() > limit):
            raise ValueError(
                f"{name} must lie in [0, {limit}], got values from {host.min()} to {host.max()}"
            )
    else:  # values unknown here (lazy or traced): clipped instead of checked
        array = xp.clip(array, 0, limit)
    host_values_ = None if host is None else np.asarray(host, dtype=np.int64)
    return Lengths(array, host_values_, left)


def check_segments(
    value: Any,
    *,
    xp: ModuleType,
    device: Any,
    like: Any,
    batch: tuple[int, ...],
    L: int,
    S: int,
) -> Segments | None:
    """Validate ``segment_ids = (query_segments, key_segments)``.

    Raises
    ------
    TypeError
        Not a pair, or not integer arrays of the inputs' library (or NumPy).
    ValueError
        Shapes that do not broadcast to ``batch + (L,)`` and ``batch + (S,)``.
    """
    if value is None:
        return None
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise TypeError(
            "segment_ids must be a pair (query_segments, key_segments) of integer arrays, "
            f"got {type(value).__name__}"
        )
    sides = []
    for side, ids, n in (("query", value[0], L), ("key", value[1], S)):
        name = f"segment_ids[{0 if side == 'query' else 1}] ({side} segments)"
        array, host = _integer_array(name, ids, xp, device, like)
        shape = tuple(array.shape)
        if not _broadcasts_to(shape, (*batch, n)):
            raise ValueError(
                f"{name} of shape {shape} does not broadcast to {(*batch, n)} (batch shape "
                f"{batch} without the heads axis, then the {side} length {n})"
            )
        sides.append((array, host))
    (q, q_host), (k, k_host) = sides
    return Segments(q, k, q_host, k_host)
