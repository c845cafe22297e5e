"""Adjoints of the oracle's broadcasting and head repetition (for its gradients)."""

from __future__ import annotations

import numpy as np

__all__ = ["sum_to_shape", "unrepeat_heads"]


def sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Adjoint of broadcasting: sum ``grad`` down to ``shape``.

    Leading axes that ``shape`` lacks are summed away; axes where ``shape`` has size 1 but
    ``grad`` does not are summed with ``keepdims``.

    Examples
    --------
    The gradient of an array of shape ``(3, 1)`` broadcast to ``(2, 3, 4)``:

    >>> import numpy as np
    >>> from sdpa_array.reference import sum_to_shape
    >>> sum_to_shape(np.ones((2, 3, 4)), (3, 1))
    array([[8.],
           [8.],
           [8.]])
    """
    extra = grad.ndim - len(shape)
    if extra < 0:
        raise ValueError(f"cannot reduce gradient of shape {grad.shape} to {shape}")
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(
        ax for ax, (g, s) in enumerate(zip(grad.shape, shape, strict=True)) if s == 1 and g != 1
    )
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    if grad.shape != tuple(shape):
        raise ValueError(f"cannot reduce gradient of shape {grad.shape} to {shape}")
    return grad


def unrepeat_heads(grad: np.ndarray, group: int) -> np.ndarray:
    """Adjoint of ``np.repeat(x, group, axis=-3)``: sum each group of ``group`` heads.

    Examples
    --------
    Four query heads sharing two key/value heads (grouped-query attention):

    >>> import numpy as np
    >>> from sdpa_array.reference import unrepeat_heads
    >>> grad = np.ones((4, 2, 3))  # (heads, keys, width)
    >>> unrepeat_heads(grad, 2).shape
    (2, 2, 3)
    >>> unrepeat_heads(grad, 2)[0, 0]
    array([2., 2., 2.])
    """
    if group == 1:
        return grad
    *batch, h, s, e = grad.shape
    return np.asarray(grad.reshape(*batch, h // group, group, s, e).sum(axis=-3))
