"""Which keys each query may attend, from index arithmetic alone; and the oracle's ``scale``.

For batch element ``b``, query ``i`` and key ``j``, the pair is admissible by index only if

* ``i < query_lengths[b]`` and ``j < key_lengths[b]`` (the rest is padding); with
  ``padding_side="left"`` the padding comes first, and ``i``, ``j`` below are the
  positions within the valid tokens, ``i - (L - query_lengths[b])`` and
  ``j - (S - key_lengths[b])``, which must be at least 0;
* ``query_segments[b, i] == key_segments[b, j]`` (packed documents);
* ``j <= diag`` with ``is_causal``, and ``diag - left <= j <= diag + right`` with
  ``window=(left, right)``, where ``diag = i`` for ``"top_left"`` and
  ``diag = i + key_lengths[b] - query_lengths[b]`` for ``"bottom_right"`` (a length not
  given counts as ``L`` or ``S``, which gives the familiar ``i + S - L``).

:func:`allowed_by_index` writes this down as one boolean array of shape ``batch + (L, S)``,
where ``batch`` is the inputs' broadcast leading shape without its heads axis: the
restrictions are the same for every head. The lengths and segment ids are first checked
and broadcast by :func:`as_lengths` and :func:`as_segments`; :func:`resolve_scale` reads a
``scale`` given as a number or as a 0-d array of any library.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from ._convert import to_numpy

__all__ = ["allowed_by_index", "as_lengths", "as_segments", "resolve_scale"]


def resolve_scale(scale: Any, E: int) -> tuple[float, bool]:
    """The multiplier of ``Q Kᵀ`` as a float, and whether it was given as an array.

    Parameters
    ----------
    scale : float, NumPy scalar, 0-d array of any supported library, or None
        ``None`` means ``1 / sqrt(E)`` (and 1 when ``E == 0``, where every score is 0).
    E : int
        The embedding size of queries and keys.

    Returns
    -------
    value : float
        The scale, positive and finite.
    given_as_array : bool
        True if ``scale`` has a ``shape`` and is not a NumPy scalar: then the VJP also
        returns its gradient.

    Raises
    ------
    TypeError
        If ``scale`` is not a real number or an array of a real dtype.
    ValueError
        If ``scale`` is not 0-d, or not positive and finite.

    Examples
    --------
    >>> resolve_scale(None, 4)
    (0.5, False)
    >>> resolve_scale(np.array(2), 4)
    (2.0, True)
    """
    if scale is None:
        return (1.0 / math.sqrt(E) if E > 0 else 1.0), False
    given_as_array = hasattr(scale, "shape") and not isinstance(scale, np.generic)
    if (
        not given_as_array
        and isinstance(scale, numbers.Real)
        and not isinstance(scale, (bool, np.bool_))
    ):
        array = np.asarray(float(scale))
    else:
        try:
            array = to_numpy(scale)
        except (TypeError, ValueError):
            raise TypeError(
                f"scale must be a real number or a 0-d array, got {type(scale).__name__}"
            ) from None
    if array.ndim != 0:  # a ValueError, as in the fast paths: the kind is right, the shape not
        raise ValueError(
            f"scale must be a real number or a 0-d array, got shape {tuple(array.shape)}"
        )
    if array.dtype.kind not in "iuf":
        raise TypeError(f"scale must be a real number, got dtype {array.dtype} (shape ())")
    value = float(array.astype(np.float64))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a positive finite number, got {value!r}")
    return value, given_as_array


def _integers(name: str, x: Any) -> np.ndarray:
    """``x`` on the host as a NumPy array of an integer dtype, else ``TypeError``."""
    try:
        array = to_numpy(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}") from None
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got {array.dtype}")
    return array


def as_lengths(name: str, lengths: Any, batch: tuple[int, ...], limit: int) -> np.ndarray:
    """Valid sequence lengths as an int64 array of shape ``batch``.

    Parameters
    ----------
    name : str
        ``"query_lengths"`` or ``"key_lengths"``, for the error messages.
    lengths : int, array_like of int, or None
        Broadcastable to ``batch``; ``None`` means ``limit`` everywhere.
    batch : tuple of int
        The batch shape (the inputs' leading axes before the heads axis).
    limit : int
        ``L`` or ``S``: every length must lie in ``[0, limit]``.

    Returns
    -------
    numpy.ndarray
        int64, shape ``batch``.

    Raises
    ------
    TypeError
        If ``lengths`` does not have an integer dtype.
    ValueError
        If it does not broadcast to ``batch`` or a length is outside ``[0, limit]``.

    Examples
    --------
    >>> as_lengths("query_lengths", [3, 0], (2,), 4)
    array([3, 0])
    >>> as_lengths("key_lengths", None, (2,), 5)
    array([5, 5])
    """
    if lengths is None:
        return np.full(batch, limit, dtype=np.int64)
    array = _integers(name, lengths)
    try:
        array = np.broadcast_to(array, batch)
    except ValueError:
        raise ValueError(
            f"{name} of shape {array.shape} does not broadcast to the batch shape {batch}"
        ) from None
    outside = (array < 0) | (array > limit)
    if np.any(outside):
        raise ValueError(f"{name} must lie in [0, {limit}], got {array[outside].tolist()}")
    return array.astype(np.int64)


def as_segments(
    segment_ids: Any, batch: tuple[int, ...], L: int, S: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Query and key segment ids broadcast to ``batch + (L,)`` and ``batch + (S,)``.

    Parameters
    ----------
    segment_ids : pair of array_like of int, or None
        ``(query_segments, key_segments)``.
    batch : tuple of int
        The batch shape (the inputs' leading axes before the heads axis).
    L, S : int
        Query and key sequence lengths.

    Returns
    -------
    tuple of numpy.ndarray or None
        ``None`` if ``segment_ids`` is.

    Raises
    ------
    TypeError
        If ``segment_ids`` is not a pair or a side does not have an integer dtype.
    ValueError
        If a side does not broadcast to its shape.

    Examples
    --------
    >>> q_seg, k_seg = as_segments(([0, 0, 1], 7), (), 3, 2)
    >>> q_seg, k_seg
    (array([0, 0, 1]), array([7, 7]))
    """
    if segment_ids is None:
        return None
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
        raise TypeError(
            "segment_ids must be a pair (query_segments, key_segments) of integer arrays, "
            f"got {type(segment_ids).__name__}"
        )
    result = []
    sides = (("query", segment_ids[0], L, "L"), ("key", segment_ids[1], S, "S"))
    for side, ids, n, letter in sides:
        array = _integers(f"segment_ids ({side} segments)", ids)
        target = (*batch, n)
        try:
            result.append(np.broadcast_to(array, target))
        except ValueError:
            raise ValueError(
                f"segment_ids: the {side} segments of shape {array.shape} do not broadcast "
                f"to batch + ({letter},) = {target}"
            ) from None
    return result[0], result[1]


def allowed_by_index(
    L: int,
    S: int,
    query_lengths: np.ndarray,
    key_lengths: np.ndarray,
    segments: tuple[np.ndarray, np.ndarray] | None,
    is_causal: bool,
    window: Any,
    alignment: str,
    padding_side: str = "right",
) -> np.ndarray:
    """Boolean ``batch + (L, S)``: may query ``i`` of batch element ``b`` attend key ``j``.

    ``query_lengths`` and ``key_lengths`` have shape ``batch`` (from :func:`as_lengths`),
    ``segments`` is ``None`` or the pair from :func:`as_segments`; the rule is the one in
    this module's docstring.

    Examples
    --------
    Two batch elements with 3 queries and 4 keys; the second has 2 queries and 3 keys, and
    its bottom-right diagonal starts one key later:

    >>> allowed = allowed_by_index(
    ...     3, 4, np.array([3, 2]), np.array([4, 3]), None, True, None, "bottom_right"
    ... )
    >>> allowed.astype(int)
    array([[[1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]],
    <BLANKLINE>
           [[1, 1, 0, 0],
            [1, 1, 1, 0],
            [0, 0, 0, 0]]])
    """
    q_len = query_lengths[..., None, None]  # batch + (1, 1)
    k_len = key_lengths[..., None, None]
    i = np.arange(L)[:, None]  # (L, 1)
    j = np.arange(S)[None, :]  # (1, S)
    if padding_side == "left":  # positions within the valid tokens, the last ones
        i = i - (L - q_len)
        j = j - (S - k_len)
    elif padding_side != "right":
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    # Query i's diagonal: key i, or with bottom-right alignment key i + k_len - q_len,
    # so that the last valid query lines up with the last valid key of its element.
    diag = i if alignment == "top_left" else i + (k_len - q_len)

    allowed = (i >= 0) & (i < q_len) & (j >= 0) & (j < k_len)  # padding excluded
    if is_causal:
        allowed &= j <= diag
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= diag - int(left)
        if right is not None:
            allowed &= j <= diag + int(right)
    if segments is not None:
        q_seg, k_seg = segments
        allowed &= q_seg[..., :, None] == k_seg[..., None, :]
    return allowed
