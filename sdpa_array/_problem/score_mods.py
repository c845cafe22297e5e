"""The score functions of :mod:`sdpa_array.mods`: ``score_mod``s that carry their derivative.

A ``score_mod(score, batch, head, q_idx, kv_idx)`` maps the scaled scores to new ones,
element by element; the backward pass multiplies by its derivative with respect to
``score``, which each function here gives as its ``derivative`` method (same arguments),
so that NumPy, CuPy, array-api-strict and Dask, which have no autodiff, can differentiate
through it. Each is a small frozen dataclass named by its factory call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .._arrays.compat import array_namespace
from .._arrays.typing import ScoreMod
from .mod_parameters import sum_by_index
from .mods_data import Captured, NamedMod, gather

__all__ = [
    "ScoreFunction",
    "TanhSoftcapScore",
    "TemperatureScore",
    "score_function",
    "tanh_softcap",
    "temperature",
]


def _namespace(score: Any) -> Any:
    return array_namespace({"score": score})


@dataclass(frozen=True, repr=False)
class ScoreFunction(NamedMod):
    """A ``score_mod`` with the ``derivative`` its backward pass multiplies by."""

    factory: ClassVar[str] = "score_function"
    function: Callable[..., Any]
    slope: Callable[..., Any]

    def arguments(self) -> str:
        names = (getattr(f, "__qualname__", None) or repr(f) for f in (self.function, self.slope))
        return ", ".join(names)

    def __call__(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.function(score, batch, head, q_idx, kv_idx)

    def derivative(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        """``d score_mod / d score`` at ``score``."""
        return self.slope(score, batch, head, q_idx, kv_idx)


@dataclass(frozen=True, repr=False)
class TanhSoftcapScore(NamedMod):
    """``cap * tanh(score / cap)``."""

    factory: ClassVar[str] = "tanh_softcap"
    cap: float

    def arguments(self) -> str:
        return repr(self.cap)

    def __call__(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return _namespace(score).tanh(score / self.cap) * self.cap

    def derivative(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        """``1 - tanh²(score / cap)``."""
        t = _namespace(score).tanh(score / self.cap)
        return 1.0 - t * t


@dataclass(frozen=True, repr=False)
class TemperatureScore(NamedMod):
    """``score / values[head]``."""

    factory: ClassVar[str] = "temperature"
    values: Captured

    def arguments(self) -> str:
        return f"values={self.values!r}"

    def _per_head(self, score: Any, head: Any) -> Any:
        xp = _namespace(score)
        return xp.astype(gather(xp, self.values.flat(xp, head), head), score.dtype)

    def __call__(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score / self._per_head(score, head)

    def derivative(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        """``1 / values[head]``."""
        return 1.0 / self._per_head(score, head)

    @property
    def head_rows(self) -> int:
        """How many query heads the temperatures cover (checked against the call's)."""
        return self.values.shape[0]

    @property
    def parameters(self) -> tuple[Any, ...]:
        """The trainable temperatures (:mod:`~sdpa_array._problem.mod_parameters`)."""
        return (self.values.value,)

    def with_parameters(self, values: Any) -> TemperatureScore:
        """The same function with other temperatures (traced ones, under autodiff)."""
        return TemperatureScore(_captured(values))

    def parameter_cotangents(
        self, cotangent: Any, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any
    ) -> tuple[Any, ...]:
        """``d values[h] = -sum(cotangent * score) / values[h]²`` over head ``h``'s
        entries (the sum first, then one division per head)."""
        xp = _namespace(cotangent)
        sums = sum_by_index(xp, cotangent * score, head, self.values.shape[0])
        values = xp.astype(self.values.flat(xp, head), sums.dtype)
        return (-sums / (values * values),)

    def parameter_derivatives(
        self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any
    ) -> tuple[Any, ...]:
        """``d (score / values[head]) / d values[n]`` on the grid, for each ``n``: an array
        of shape ``(heads, *grid)``, ``-score / values[n]²`` where ``head == n`` and 0
        elsewhere (the oracle contracts it with the cotangent)."""
        xp = _namespace(score)
        n = self.values.shape[0]
        shape = (n,) + (1,) * score.ndim
        units = xp.reshape(xp.arange(n), shape)
        values = xp.reshape(xp.astype(self.values.flat(xp, head), score.dtype), shape)
        return (xp.where(units == head[None, ...], -score[None, ...] / (values * values), 0.0),)


def score_function(function: ScoreMod, derivative: ScoreMod) -> ScoreMod:
    """``function`` as a ``score_mod`` whose gradient is ``derivative``.

    Libraries without autodiff (NumPy, CuPy, array-api-strict, Dask) need the derivative
    for a gradient through a ``score_mod``; torch and JAX use it instead of
    differentiating ``function``.

    Parameters
    ----------
    function : callable
        ``function(score, batch, head, q_idx, kv_idx)``: the new scores, element by element
        (scores in the compute dtype, indices as for a mask mod), an array that broadcasts
        to the scores'.
    derivative : callable
        ``derivative(score, batch, head, q_idx, kv_idx)``: ``d function / d score``, element
        by element, an array that broadcasts to the scores'.

    Returns
    -------
    callable
        The ``score_mod``: ``function`` with a ``derivative`` method.

    Examples
    --------
    >>> import numpy as np
    >>> square = score_function(lambda s, b, h, i, j: s * s, lambda s, b, h, i, j: 2 * s)
    >>> square.derivative(np.array([3.0]), 0, 0, 0, 0)
    array([6.])
    """
    for name, f in (("function", function), ("derivative", derivative)):
        if not callable(f):
            raise TypeError(f"score_function: {name} must be callable, got {type(f).__name__}")
    return ScoreFunction(function, derivative)


def tanh_softcap(cap: float) -> ScoreMod:
    """Soft-capping as a score mod: ``cap * tanh(score / cap)``, Gemma 2's logit cap.

    The same scores as ``softcap=cap``, with the derivative ``1 - tanh²(score / cap)``.

    Parameters
    ----------
    cap : float
        The cap, positive and finite.

    Returns
    -------
    callable
        The ``score_mod``, with its ``derivative`` method.

    Examples
    --------
    >>> import numpy as np
    >>> tanh_softcap(2.0)(np.array([0.0, 100.0]), 0, 0, 0, 0)
    array([0., 2.])
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
        raise ValueError(f"tanh_softcap: cap must be a positive finite number, got {cap!r}")
    return TanhSoftcapScore(float(cap))


def temperature(values: Any) -> ScoreMod:
    """A temperature per query head: ``score / values[head]``.

    Its derivative is ``1 / values[head]``. The temperatures are trainable: the function
    declares them as its ``parameters``, so they get their gradients through torch
    autograd and ``jax.grad`` on every path, and from
    :func:`sdpa_array.scaled_dot_product_attention_vjp` with ``return_mod_gradients=True``
    (``d values[h] = -Σ cotangent · score / values[h]²`` over head ``h``'s scores).

    Parameters
    ----------
    values : array or sequence of float
        One nonzero temperature per query head: a 1-D real floating array of any library,
        or a sequence of numbers.

    Returns
    -------
    callable
        The ``score_mod``, with its ``derivative`` method and its trainable parameters.

    Examples
    --------
    >>> import numpy as np
    >>> head = np.arange(2)[:, None]
    >>> temperature([1.0, 2.0])(np.ones((2, 3)), 0, head, 0, 0)
    array([[1. , 1. , 1. ],
           [0.5, 0.5, 0.5]])
    """
    return TemperatureScore(_captured(values))


def _captured(values: Any) -> Captured:
    return Captured("temperature", "values", values, kind="real floating", ndims=(1,))
