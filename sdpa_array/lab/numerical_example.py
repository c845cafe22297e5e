"""The worked example of the Theory page, computed exactly, against hand-computed figures."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

import numpy as np

from .._api.forward import scaled_dot_product_attention
from ..testing.backends import Backend
from ._plumbing import configured, host, namespace_of

__all__ = [
    "EXAMPLE_KEY",
    "EXAMPLE_QUERY",
    "EXAMPLE_VALUE",
    "PUBLISHED",
    "PublishedFigure",
    "WorkedExample",
    "worked_example",
]

EXAMPLE_QUERY = ((1.0, 2.0), (3.0, 4.0))
EXAMPLE_KEY = ((5.0, 6.0), (7.0, 8.0), (9.0, 10.0))
EXAMPLE_VALUE = ((1.0, 0.0, 1.0), (0.0, 1.0, 0.0), (1.0, 1.0, 0.0))

#: The rounded figures of a hand computation of the example, as printed there.
PUBLISHED: dict[str, tuple[tuple[str, ...], ...]] = {
    "scaled": (("12.02", "16.26", "20.51"), ("27.58", "37.48", "47.38")),
    "weights": (("2.06e-4", "0.016", "0.984"), ("1.67e-9", "0.0001", "0.9999")),
    "output": (("0.984", "1.000", "0.0002"), ("0.9999", "0.9999", "0.0001")),
}


@dataclass(frozen=True)
class PublishedFigure:
    """One rounded hand-computed figure, against the exact value.

    Made by :func:`worked_example`; each parameter is the field of the same name.

    Parameters
    ----------
    matrix : str
        ``"scaled"``, ``"weights"`` or ``"output"``.
    index : tuple of int
        ``(row, column)``.
    published : str
        The figure as printed.
    exact : float
        The exact value (float64).
    """

    matrix: str
    index: tuple[int, int]
    published: str
    exact: float

    @property
    def half_unit(self) -> float:
        """Half a unit in the last printed digit: the largest error honest rounding leaves."""
        exponent = Decimal(self.published).as_tuple().exponent
        assert isinstance(exponent, int)
        return 0.5 * 10.0**exponent

    @property
    def error(self) -> float:
        """``|published - exact|``."""
        return abs(float(self.published) - self.exact)

    @property
    def consistent(self) -> bool:
        """Whether the figure is the exact value correctly rounded (error <= half a unit)."""
        return self.error <= self.half_unit * (1 + 1e-9)

    @property
    def correctly_rounded(self) -> str:
        """The exact value rounded to the published figure's last digit, in its style."""
        if "e" in self.published.lower():
            digits = len(self.published.lower().split("e")[0].replace(".", "")) - 1
            return f"{self.exact:.{digits}e}"
        exponent = Decimal(self.published).as_tuple().exponent
        assert isinstance(exponent, int)
        return f"{self.exact:.{max(-exponent, 0)}f}"


@dataclass(frozen=True)
class WorkedExample:
    """Every intermediate of the worked example, exact, and the hand-computed figures.

    Made by :func:`worked_example`; each parameter is the field of the same name.

    Parameters
    ----------
    query : numpy.ndarray
        ``Q`` (2×2).
    key : numpy.ndarray
        ``K`` (3×2).
    value : numpy.ndarray
        ``V`` (3×3).
    scores : numpy.ndarray
        ``Q Kᵀ`` = ``[[17, 23, 29], [39, 53, 67]]``.
    scaled : numpy.ndarray
        ``Q Kᵀ / sqrt(2)``.
    weights : numpy.ndarray
        ``softmax(Q Kᵀ / sqrt(2))``, from :func:`sdpa_array.scaled_dot_product_attention`
        with ``return_weights=True``.
    output : numpy.ndarray
        ``weights V``, from the same call.
    published : tuple of PublishedFigure
        The note's rounded figures, each with the exact value.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    scores: np.ndarray
    scaled: np.ndarray
    weights: np.ndarray
    output: np.ndarray
    published: tuple[PublishedFigure, ...]

    @property
    def discrepancies(self) -> tuple[PublishedFigure, ...]:
        """Published figures that are wrong beyond their rounding."""
        return tuple(f for f in self.published if not f.consistent)


def worked_example(*, backend: Backend | str = "numpy", dtype: str = "float64") -> WorkedExample:
    """The worked example (``d_k = 2``, two queries, three keys), computed exactly.

    Parameters
    ----------
    backend : Backend or str, default "numpy"
        Where the arithmetic runs: a backend or its id in
        :data:`sdpa_array.testing.backends.BACKENDS`.
    dtype : str, default "float64"
        Floating dtype on the backend.

    Returns
    -------
    WorkedExample
        The inputs, every intermediate (copied to float64 NumPy arrays) and each published
        figure with its exact value.

    Notes
    -----
    The exact weights are ``[[2.035e-4, 0.01416, 0.98563], [2.52e-9, 5.02e-5, 0.99995]]``
    and the output ``[[0.98584, 0.99980, 2.035e-4], [0.99995, 1.0000, 2.5e-9]]``. Of the
    published figures, four of the weights and three of the outputs are wrong beyond their
    rounding (:attr:`WorkedExample.discrepancies`); the scaled scores are right.

    Examples
    --------
    >>> ex = worked_example()
    >>> ex.weights.round(4)
    array([[2.000e-04, 1.420e-02, 9.856e-01],
           [0.000e+00, 1.000e-04, 9.999e-01]])
    >>> [(f.matrix, f.index, f.published, f.correctly_rounded) for f in ex.discrepancies][:2]
    [('weights', (0, 0), '2.06e-4', '2.04e-04'), ('weights', (0, 1), '0.016', '0.014')]
    """

    b = configured(backend)
    query = b.asarray(np.asarray(EXAMPLE_QUERY), dtype)
    key = b.asarray(np.asarray(EXAMPLE_KEY), dtype)
    value = b.asarray(np.asarray(EXAMPLE_VALUE), dtype)
    xp = namespace_of(query=query, key=key, value=value)
    scores = xp.matmul(query, xp.matrix_transpose(key))
    scaled = scores * (1.0 / math.sqrt(query.shape[-1]))
    output, weights = scaled_dot_product_attention(query, key, value, return_weights=True)
    exact = {"scaled": host(scaled), "weights": host(weights), "output": host(output)}
    figures = tuple(
        PublishedFigure(name, (i, j), text, float(exact[name][i, j]))
        for name, rows in PUBLISHED.items()
        for i, row in enumerate(rows)
        for j, text in enumerate(row)
    )
    return WorkedExample(
        query=host(query),
        key=host(key),
        value=host(value),
        scores=host(scores),
        scaled=exact["scaled"],
        weights=exact["weights"],
        output=exact["output"],
        published=figures,
    )
