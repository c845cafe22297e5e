"""``mask_mod`` and ``bias_mod``: restrictions and scores given as functions of the indices.

A mod is called once, on the full grid of indices, with four integer arrays of the query's
own library and device (``array_api_compat.array_namespace(query)``; NumPy when the query is
not an array, e.g. a nested list) that broadcast together to the scores' shape
``(*batch, Hq, L, S)`` (``(L, S)`` for inputs without a heads axis):

* ``batch``: the row-major (flattened) index of the batch element, shape
  ``(*batch, 1, 1, 1)``; zeros when there are no batch axes, and a 0-d zero when there is
  no heads axis either;
* ``head``: the query head, shape ``(Hq, 1, 1)``; a 0-d zero without a heads axis;
* ``q_idx``: the query, shape ``(L, 1)``;
* ``kv_idx``: the key, shape ``(S,)``.

Here ``batch`` is the oracle's batch shape (the broadcast leading axes of ``query``,
``key`` and ``value`` without the heads axis) and ``Hq`` the broadcast heads axis (the query
heads, with GQA). The result is read with :func:`to_numpy`, checked (boolean for
``mask_mod``, real floating for ``bias_mod``, read as float64; its shape must broadcast to
the scores' shape) and broadcast to the scores' shape.

``score_mod(score, batch, head, q_idx, kv_idx)`` (and its ``derivative`` method) is called
once too (:func:`evaluate_score`), with the float64 NumPy scaled scores and NumPy index
arrays of the same shapes: the oracle computes on the host, whatever the inputs' library.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import array_api_compat
import numpy as np

from ._convert import to_numpy

__all__ = [
    "check_mods",
    "evaluate_mod",
    "evaluate_score",
    "index_grids",
    "parameter_gradients",
    "parameter_jacobian",
    "score_parameter_gradients",
    "score_parameter_jacobian",
]


def check_mods(mask_mod: Any, bias_mod: Any, score_mod: Any = None) -> None:
    """``TypeError`` if a mod is given but is not callable."""
    for name, fn in (("mask_mod", mask_mod), ("bias_mod", bias_mod), ("score_mod", score_mod)):
        if fn is not None and not callable(fn):
            score = "score, " if name == "score_mod" else ""
            raise TypeError(
                f"{name} must be callable as {name}({score}batch, head, q_idx, kv_idx), "
                f"got {type(fn).__name__}"
            )


def evaluate_score(
    name: str, fn: Callable[..., Any], score: np.ndarray, grids: tuple[Any, ...]
) -> np.ndarray:
    """``fn(score, *grids)`` (``score_mod`` or its derivative, named by ``name``) as float64
    of the scores' shape.

    Raises
    ------
    ValueError
        If it raises (chained), or returns a shape that does not broadcast to the scores'.
    TypeError
        If it returns something that is not a real floating NumPy array.
    """
    try:
        result = fn(score, *grids)
    except Exception as exc:
        raise ValueError(f"{name} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, np.ndarray) or result.dtype.kind != "f":
        raise TypeError(
            f"{name} must return a real floating NumPy array for NumPy scores, got "
            f"{type(result).__name__} {getattr(result, 'dtype', '')}"
        )
    try:
        return np.broadcast_to(result.astype(np.float64), score.shape)
    except ValueError:
        raise ValueError(
            f"{name} returned shape {result.shape}, which does not broadcast to the scores' "
            f"shape {score.shape}"
        ) from None


def index_grids(query: Any, lead: tuple[int, ...], L: int, S: int) -> tuple[Any, ...]:
    """The four index arrays ``(batch, head, q_idx, kv_idx)`` a mod is called with.

    ``lead`` is the scores' shape less ``(L, S)``: ``(*batch, Hq)``, or ``()`` for inputs
    without a heads axis.

    Examples
    --------
    >>> b, h, i, j = index_grids(np.zeros((3, 2)), (2, 3, 4), 3, 5)
    >>> b.shape, h.shape, i.shape, j.shape
    ((2, 3, 1, 1, 1), (4, 1, 1), (3, 1), (5,))
    >>> b.reshape(2, 3).tolist()
    [[0, 1, 2], [3, 4, 5]]
    """
    if not array_api_compat.is_array_api_obj(query):
        query = np.asarray(query)
    xp = array_api_compat.array_namespace(query)
    device = array_api_compat.device(query)

    def arange(n: int, shape: tuple[int, ...]) -> Any:
        return xp.reshape(xp.arange(n, device=device), shape)

    q_idx = arange(L, (L, 1))
    kv_idx = arange(S, (S,))
    if not lead:  # no heads axis (and so no batch axes): the scores are (L, S)
        return arange(1, ()), arange(1, ()), q_idx, kv_idx
    batch, heads = lead[:-1], lead[-1]
    return arange(math.prod(batch), (*batch, 1, 1, 1)), arange(heads, (heads, 1, 1)), q_idx, kv_idx


def evaluate_mod(
    name: str, fn: Callable[..., Any], grids: tuple[Any, ...], shape: tuple[int, ...]
) -> np.ndarray:
    """Call ``fn`` (``mask_mod`` or ``bias_mod``, named by ``name``) on ``grids`` once.

    Returns its result as NumPy, broadcast to the scores' ``shape``: boolean for
    ``mask_mod``, float64 for ``bias_mod``.

    Raises
    ------
    ValueError
        If the mod raises (chained to its exception), or its result does not broadcast to
        ``shape``.
    TypeError
        If the result is not boolean (``mask_mod``) or real floating (``bias_mod``).
    """
    try:
        result = fn(*grids)
    except Exception as exc:
        raise ValueError(f"{name} raised {type(exc).__name__}: {exc}") from exc
    try:
        array = to_numpy(result)  # computes lazy (Dask) results: their errors show here
    except Exception as exc:
        raise ValueError(
            f"{name}'s result ({type(result).__name__}) could not be read: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if name == "mask_mod":
        if array.dtype != np.bool_:
            raise TypeError(
                f"mask_mod must return booleans (True = may attend), got dtype {array.dtype}"
            )
    elif array.dtype.kind != "f":
        raise TypeError(f"bias_mod must return a real floating array, got dtype {array.dtype}")
    else:
        array = array.astype(np.float64)
    try:
        fits = np.broadcast_shapes(array.shape, shape) == tuple(shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name} returned shape {array.shape}, which does not broadcast to the scores' "
            f"shape {tuple(shape)}"
        )
    return np.broadcast_to(array, shape)


def parameter_jacobian(
    bias_mod: Any, grids: tuple[Any, ...], shape: tuple[int, ...]
) -> list[np.ndarray]:
    """``d bias / d theta`` of each of ``bias_mod``'s ``parameters`` ``theta``, as an array
    of ``theta``'s shape followed by the scores' ``shape``.

    For a mod affine in its parameters (ALiBi's slopes, T5's table: every bias value is a
    parameter times a constant), ``d bias / d theta_k`` is exactly the bias with the
    parameters set to the unit vector ``e_k`` less the bias with them all zero: each
    column is formed that way, from the mod's ``with_parameters``, in float64, with no
    finite difference.

    Raises
    ------
    TypeError
        If ``bias_mod`` has no ``parameters`` and ``with_parameters``.
    """
    if not hasattr(bias_mod, "parameters") or not hasattr(bias_mod, "with_parameters"):
        raise TypeError(
            "return_mod_gradients=True needs a bias_mod with 'parameters' and "
            f"'with_parameters' (the oracle forms its Jacobian from them), got {bias_mod!r}"
        )
    params = [to_numpy(a).astype(np.float64) for a in bias_mod.parameters]

    def bias_with(values: list[np.ndarray]) -> np.ndarray:
        return evaluate_mod("bias_mod", bias_mod.with_parameters(*values), grids, shape)

    zeros = [np.zeros_like(a) for a in params]
    offset = bias_with(zeros)
    jacobians = []
    for i, a in enumerate(params):
        columns = np.zeros((*a.shape, *shape))
        for index in np.ndindex(a.shape):
            unit = [z.copy() for z in zeros]
            unit[i][index] = 1.0
            columns[index] = bias_with(unit) - offset
        jacobians.append(columns)
    return jacobians


def parameter_gradients(
    bias_mod: Any, grids: tuple[Any, ...], shape: tuple[int, ...], d_z: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The gradient of each of ``bias_mod``'s ``parameters`` for the score gradient ``d_z``:
    the bias is added to the scores, so ``d theta_k = sum(d_z * d bias / d theta_k)``,
    with the Jacobian of :func:`parameter_jacobian`.

    Raises
    ------
    TypeError
        If ``bias_mod`` has no ``parameters`` and ``with_parameters``.
    """
    axes = tuple(range(-len(shape), 0))
    return tuple(np.sum(d_z * j, axis=axes) for j in parameter_jacobian(bias_mod, grids, shape))


def score_parameter_jacobian(
    score_mod: Any, raw: np.ndarray, grids: tuple[Any, ...]
) -> list[np.ndarray]:
    """``d score_mod / d theta`` of each of ``score_mod``'s ``parameters`` ``theta`` at the
    scaled scores ``raw``: the function's own ``parameter_derivatives(raw, *grids)``, one
    array per parameter of ``theta``'s shape followed by the scores' (broadcast to it), as
    float64.

    Raises
    ------
    TypeError
        If ``score_mod`` has no ``parameters`` and ``parameter_derivatives``.
    ValueError
        If a Jacobian does not broadcast to its parameter's shape and the scores'.
    """
    derivatives = getattr(score_mod, "parameter_derivatives", None)
    if not hasattr(score_mod, "parameters") or not callable(derivatives):
        raise TypeError(
            "return_mod_gradients=True needs a score_mod with 'parameters' and "
            "'parameter_derivatives' (the oracle contracts its Jacobian), got "
            f"{score_mod!r}"
        )
    shapes = [tuple(np.shape(to_numpy(a))) for a in score_mod.parameters]
    jacobians = []
    for shape, jacobian in zip(shapes, derivatives(raw, *grids), strict=True):
        full = (*shape, *raw.shape)
        try:
            j = np.broadcast_to(np.asarray(to_numpy(jacobian), dtype=np.float64), full)
        except ValueError:
            raise ValueError(
                f"score_mod's parameter_derivatives returned shape {np.shape(jacobian)}, "
                f"which does not broadcast to {full}"
            ) from None
        jacobians.append(j)
    return jacobians


def score_parameter_gradients(
    score_mod: Any, raw: np.ndarray, grids: tuple[Any, ...], d_modded: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The gradient of each of ``score_mod``'s ``parameters`` for the gradient
    ``d_modded`` of its values: ``d theta = sum(d_modded * d score_mod / d theta)`` over
    the scores, with the Jacobian of :func:`score_parameter_jacobian` (the function's own
    derivatives; the contraction is the oracle's).

    Raises
    ------
    TypeError, ValueError
        As :func:`score_parameter_jacobian`.
    """
    grads = []
    for j in score_parameter_jacobian(score_mod, raw, grids):
        axes = tuple(range(j.ndim - raw.ndim, j.ndim))
        grads.append(np.sum(j * d_modded, axis=axes))
    return tuple(grads)
