"""Score terms: what turns a tile's raw product ``q kᵀ`` into its scores, in one place.

Every term that changes a score's *value* lives in :class:`ScoreTerms`, applied tile by
tile in the order of the public definition: the ``scale`` (folded into the query when
nothing non-linear follows the product), the ``softcap`` (``c · tanh(s / c)``) and the
additive ``bias``. Restrictions, which only *exclude* scores, live in
:mod:`sdpa_array._kernels.restrictions`. New terms (bias functions, sinks) become fields and
steps of this class, so the forward and backward kernels pick them up together.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from .._typing import Array
from .slicing import at_batch, tile_of

__all__ = ["ScoreTerms"]


@dataclass(frozen=True)
class ScoreTerms:
    """The score terms of one call, in the kernel layout.

    Attributes
    ----------
    scale : float or array
        Multiplier of ``q kᵀ`` (a 0-d array in the compute dtype when the caller gave one).
    softcap : float or None
        Tanh soft-capping of the scaled scores.
    bias : array or None
        Additive term ``(..., L|1, S|1)`` in the compute dtype.
    """

    scale: float | Array
    softcap: float | None
    bias: Array

    @property
    def scale_in_query(self) -> bool:
        """Whether the scale is folded into the query (exact: nothing non-linear follows)."""
        return self.softcap is None

    def at(self, index: tuple[int, ...]) -> ScoreTerms:
        """The terms of the outer batch slice ``index``."""
        if self.bias is None or not index:
            return self
        return ScoreTerms(self.scale, self.softcap, at_batch(self.bias, index))

    def apply(
        self, xp: ModuleType, raw: Array, rows: slice, cols: slice, *, need_factor: bool = False
    ) -> tuple[Array, Array | None]:
        """Scores of a tile from its raw product, and their derivative factor.

        Parameters
        ----------
        raw : array
            ``q kᵀ`` of the tile (already scaled when :attr:`scale_in_query`).
        rows, cols : slice
            Query and key index ranges of the tile (to cut the bias).
        need_factor : bool
            Also return ``d scores / d(q kᵀ)`` where it is not the scale alone: with a
            soft-cap ``scale · (1 - tanh²)``; ``None`` otherwise (the scale is in ``q``).
        """
        s, factor = raw, None
        if self.softcap is not None:
            t = xp.tanh(raw * (self.scale / self.softcap))
            if need_factor:
                factor = (1.0 - t * t) * self.scale
            s = t * self.softcap
        b = tile_of(self.bias, rows, cols)
        if b is not None:
            s = s + b
        return s, factor
