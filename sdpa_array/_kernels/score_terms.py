"""Score terms: what turns a tile's raw product ``q kᵀ`` into its scores, in one place.

Every term that changes a score's *value* lives in :class:`ScoreTerms`, applied tile by
tile in the order of the public definition: the ``scale`` (folded into the query when
that rounds nothing, see :attr:`ScoreTerms.scale_in_query`), the score function
``score_mod`` (:class:`~.mod_terms.ModScore`), the ``softcap``
(``c · tanh(s / c)``), the additive ``bias`` and the bias function ``bias_mod`` (evaluated on
the tile's indices, :class:`~.mod_terms.ModBias`); then the softmax's own term, the ``sink``
(one logit per query head whose value is zero: :meth:`ScoreTerms.row_max` and
:meth:`ScoreTerms.sink_total` are its steps in the softmax and the online softmax).
Restrictions, which only *exclude* scores, live in :mod:`sdpa_array._kernels.restrictions`.
New terms become fields and steps of this class, so the forward and
backward kernels pick them up together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import ModuleType

from .._arrays import inplace
from .._arrays.slicing import at_batch, tile_of
from .._arrays.typing import Array
from .mod_terms import ModBias, ModScore

__all__ = ["LOG2E", "ModInput", "ScoreTerms"]

#: ``log2(e)``: scores times it have ``exp2`` equal to their ``exp``.
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ModInput:
    """What the parameter cotangents of a trainable score function need from a tile
    (:meth:`~.mod_terms.ModScore.cotangents`).

    Attributes
    ----------
    scores : array
        The scaled scores the function was applied to (an array of their own, which later
        steps do not overwrite).
    after : array or None
        The derivative of the final scores with respect to the function's values: the
        soft-cap's ``1 - tanh²``, ``None`` without a soft-cap (the bias terms add).
    """

    scores: Array
    after: Array | None


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
    sink : array or None
        The sink logits ``(..., 1, 1)`` in the compute dtype: every row's softmax
        denominator gets ``exp(sink)``, and the sink adds nothing to the output. Not scaled,
        capped or masked.
    bias_mod : ModBias or None
        The caller's ``bias_mod``, added where ``bias`` is.
    score_mod : ModScore or None
        The caller's ``score_mod``, applied to the scaled scores before the softcap.
    unit : float
        What the final scores are multiplied by: 1, or ``log2(e)`` for a softmax taken
        with ``exp2`` (:meth:`in_base2`). The sink stays in natural units.
    """

    scale: float | Array
    softcap: float | None
    bias: Array
    sink: Array = None
    bias_mod: ModBias | None = None
    score_mod: ModScore | None = None
    unit: float = 1.0

    @property
    def scale_in_query(self) -> bool:
        """Whether the scale is folded into the query, where it changes no score.

        Only when nothing non-linear follows the product and the scale is a power of two
        (``1/sqrt(E)`` for ``E`` = 4, 16, 64, 256, ...): multiplying by it then rounds
        nothing, so ``(q · scale) kᵀ`` is ``(q kᵀ) · scale`` bit for bit and costs a pass over
        ``q`` instead of one over every score tile. Any other scale rounds each query element
        once, and at large logits (``|score| ~ 1e3`` in float32) these roundings add an error
        comparable to the product's own (the output error was 1.1-1.5x that of torch's CPU
        kernel, which scales the scores): such a scale multiplies the scores of each tile
        instead (:meth:`apply`), which rounds each score once. A 0-d array scale is never
        inspected (that would synchronize with the device) and is applied to the scores.
        """
        if self.softcap is not None or self.score_mod is not None:
            return False
        if not isinstance(self.scale, (int, float)):
            return False
        return self.scale > 0 and math.frexp(self.scale)[0] == 0.5

    @property
    def changes_scores(self) -> bool:
        """Whether a term beyond the scale changes the scores (score function, softcap,
        bias, bias function): the final scores are then not the scaled products."""
        terms = (self.score_mod, self.softcap, self.bias, self.bias_mod)
        return any(t is not None for t in terms)

    def in_base2(self) -> ScoreTerms:
        """The same terms giving the scores times ``log2(e)``, whose ``exp2`` is the
        scores' ``exp`` (the scale, or the soft-cap's multiplier, carries the factor; with
        :attr:`scale_in_query` the query must: :meth:`Operands.in_base2`). Only for the
        scale and the soft-cap: a bias or a function would need the factor too."""
        if self.bias is not None or self.bias_mod is not None or self.score_mod is not None:
            raise ValueError("in_base2: only the scale and the soft-cap carry log2(e)")
        return replace(self, unit=LOG2E)

    def scaled(self, raw: Array) -> Array:
        """``scale · q kᵀ`` of a tile from its raw product, as a new array (:meth:`apply`
        may overwrite ``raw``)."""
        return raw * (1.0 if self.scale_in_query else self.scale)

    def at(self, index: tuple[int, ...]) -> ScoreTerms:
        """The terms of the outer batch slice ``index``."""
        per_batch = (self.bias, self.sink, self.bias_mod, self.score_mod)
        if all(t is None for t in per_batch) or not index:
            return self
        return ScoreTerms(
            self.scale,
            self.softcap,
            at_batch(self.bias, index),
            at_batch(self.sink, index),
            None if self.bias_mod is None else self.bias_mod.at(index),
            None if self.score_mod is None else self.score_mod.at(index),
            self.unit,
        )

    def exp(self, xp: ModuleType, s: Array) -> Array:
        """The exponential of scores in their :attr:`unit` (``exp2`` after
        :meth:`in_base2`), written into ``s`` where allowed: the scores' ``exp``."""
        return inplace.exp(xp, s) if self.unit == 1.0 else inplace.exp2(xp, s)

    def row_max(self, xp: ModuleType, tile_max: Array) -> Array:
        """The reference to subtract before ``exp``: the rows' maximum score ``(..., 1)``,
        and the sink where it is larger (so ``exp(sink - m) <= 1`` too)."""
        return tile_max if self.sink is None else xp.maximum(tile_max, self.sink)

    def sink_total(self, xp: ModuleType, ref: Array) -> Array:
        """The sink's term ``exp(sink - ref)`` of the softmax denominator, or ``None``."""
        return None if self.sink is None else xp.exp(self.sink - ref)

    def apply(
        self, xp: ModuleType, raw: Array, rows: slice, cols: slice, *, need_factor: bool = False
    ) -> tuple[Array, Array | None, ModInput | None]:
        """Scores of a tile from its raw product, their derivative factor, and what a
        trainable score function's parameter cotangents need.

        Parameters
        ----------
        raw : array
            ``q kᵀ`` of the tile (already scaled when :attr:`scale_in_query`); the caller's
            own array, which may be overwritten.
        rows, cols : slice
            Query and key index ranges of the tile (to cut the bias).
        need_factor : bool
            Also return ``d scores / d(q kᵀ)`` where ``q`` does not carry the scale:
            ``scale``, times the score function's derivative and the soft-cap's
            ``1 - tanh²`` where they are given; ``None`` when :attr:`scale_in_query`. With
            a trainable score function (``score_mod.trainable``) the :class:`ModInput` is
            returned too (else ``None``).
        """
        s, factor, kept = raw, None, None
        if self.score_mod is not None:
            x = inplace.multiply(raw, self.scale)
            if need_factor:
                if self.score_mod.trainable:  # the function's result may be x itself
                    kept = ModInput(xp.astype(x, x.dtype, copy=True), None)
                s, slope = self.score_mod.tile_and_slope(x, rows, cols)
                factor = slope * self.scale
            else:
                s = self.score_mod.tile(x, rows, cols)
            if self.softcap is not None:
                t = xp.tanh(s / self.softcap)
                if need_factor:
                    after = 1.0 - t * t
                    factor = factor * after
                    kept = None if kept is None else ModInput(kept.scores, after)
                s = t * self.softcap
        elif self.softcap is not None:
            t = xp.tanh(raw * (self.scale / self.softcap))
            if need_factor:
                factor = (1.0 - t * t) * self.scale
            s = t * (self.softcap * self.unit)
        elif not self.scale_in_query:
            s = inplace.multiply(raw, self.scale * self.unit)
            if need_factor:
                factor = self.scale
        b = tile_of(self.bias, rows, cols)
        if b is not None:
            s = s + b
        if self.bias_mod is not None:
            s = inplace.add(s, self.bias_mod.tile(rows, cols, s.dtype))
        return s, factor, kept
