"""The keep mask of attention dropout, as a public function: :func:`dropout_keep_mask`."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace
from .._arrays.compat import device as array_device
from .._arrays.typing import Array
from .._plan.dropout_bits import dropout_keep_bits
from .._problem.options import check_dropout

__all__ = ["dropout_keep_mask"]


def dropout_keep_mask(
    seed: int | Array,
    shape: tuple[int, ...],
    dropout_p: float,
    *,
    xp: ModuleType | None = None,
    device: Any = None,
) -> Array:
    """The keep mask of attention dropout for a full ``(..., Hq, L, S)`` grid.

    ``True`` where ``scaled_dot_product_attention(..., dropout_p=dropout_p,
    dropout_seed=seed)`` keeps weight ``[..., h, i, j]`` (and multiplies it by
    ``1 / (1 - dropout_p)``), ``False`` where it drops it. The bits depend only on the seed,
    the flattened index of the batch axes before ``Hq``, the head and ``(i, j)``, identically
    on every library, device and dtype, so a mask for a smaller grid (fewer queries, keys or
    heads, or a shorter first batch axis) is the corresponding slice of a larger one.

    Parameters
    ----------
    seed : int or array
        The ``dropout_seed``: any int (taken modulo ``2**62``), or a 0-d integer array
        giving the bits of its value (its library and device are the result's by default).
    shape : tuple of int
        ``(..., L, S)``: the shape of the attention weights (a missing heads axis counts as
        one head).
    dropout_p : float
        Drop probability in ``[0, 1)``; 0 keeps everything.
    xp : namespace, optional
        Array-API namespace of the result (default: NumPy).
    device : optional
        Device of the result (default: the namespace's default device).

    Returns
    -------
    array of bool, shape ``shape``
        ``True`` where the weight is kept.

    Examples
    --------
    >>> from sdpa_array import dropout_keep_mask
    >>> m = dropout_keep_mask(0, (2, 4, 8), 0.5)
    >>> m.shape, bool(m.any()), bool(m.all())
    ((2, 4, 8), True, False)
    """
    p, seed_value = check_dropout(dropout_p, seed)
    if seed_value is None:
        seed_value = 0
    shape = _shape(shape)
    if xp is None:
        like = np.empty(0) if isinstance(seed_value, int) else seed_value
        xp = array_namespace({"x": like})
        if device is None and not isinstance(seed_value, int):
            device = array_device(seed_value)
    elif not isinstance(xp, ModuleType) or not callable(getattr(xp, "asarray", None)):
        raise TypeError(
            f"xp must be an Array-API namespace (a module such as array_api_compat.numpy), "
            f"got {type(xp).__name__} {xp!r}"
        )
    try:
        with warnings.catch_warnings():  # some versions warn on a bad device before failing
            warnings.simplefilter("error")
            xp.asarray(0, device=device)
    except (TypeError, ValueError, RuntimeError, Warning) as exc:
        raise ValueError(f"device must be a device of {xp.__name__}, got {device!r}") from exc
    return dropout_keep_bits(xp, seed_value, shape, p, device)


def _shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints with at least two entries, or an error
    naming it."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape must be a tuple of ints (..., L, S), got {type(shape).__name__}")
    sizes = []
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"shape must be a tuple of ints (..., L, S), got {tuple(shape)!r}")
        sizes.append(int(n))
    if len(sizes) < 2 or any(n < 0 for n in sizes):
        raise ValueError(f"shape must be (..., L, S) with non-negative sizes, got {tuple(sizes)}")
    return tuple(sizes)
