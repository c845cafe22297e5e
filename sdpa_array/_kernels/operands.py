"""The operands of a kernel, prepared once: cast, scaled, grouped, and with their terms.

:func:`prepare` turns the caller's arrays into :class:`Operands` in the kernel layout of
:mod:`sdpa_array._kernels.layout`:

1. query, key and value are cast to the compute dtype (at least float32); the scale is
   folded into the query when that is exact (:attr:`ScoreTerms.scale_in_query`, a power of
   two), else the scores of each tile are scaled; with grouped-query
   attention the query heads are split into ``(Hkv, G)`` so that keys and values are never
   repeated in memory;
2. the bias, ``bias_mod`` and the sinks become :class:`ScoreTerms` members, dropout a
   :class:`~.dropout.Dropout` with one hash key per batch element and head, the mask,
   ``mask_mod`` and the causal/window/sequence restrictions members of one
   :class:`Restrictions`.

:func:`tile_scores` then gives the final scores of any (query rows, key columns) tile, and
every kernel, forward or backward, materialized or blocked, goes through it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from .._arrays import inplace, products
from .._arrays.typing import Array
from .._problem.problem import Inputs, Problem
from .dropout import Dropout, key_grid
from .layout import (
    at_batch,
    broadcast_if_needed,
    grouped_operand,
    grouped_score_term,
    leading_axes,
)
from .mod_terms import mod_bias, mod_mask, mod_score
from .restrictions import DenseMask, Restrictions
from .score_terms import LOG2E, ModInput, ScoreTerms
from .sequences import sequence_members

__all__ = [
    "KEPT_MASKS",
    "KEPT_MASK_PAIRS",
    "Operands",
    "backward_tile_scores",
    "fixed_scores_and_scaled",
    "fixed_weights",
    "kernel_scale",
    "prepare",
    "prepare_rows",
    "tile_scores",
    "tile_scores_and_maxima",
]


#: Tile masks one :class:`Operands` keeps: it adds none once it holds this many (threads
#: adding at once may overshoot by a few).
KEPT_MASKS = 64

#: Largest tile mask kept (pairs): a tile's, not a whole call's (the materialized paths'
#: one mask would otherwise stay alive for the whole call).
KEPT_MASK_PAIRS = 2**20


@dataclass(frozen=True)
class Operands:
    """Prepared operands, each with ``len(p.kernel_batch) + 2`` axes.

    Attributes
    ----------
    q, k, v : array
        Compute dtype, kernel layout; ``q`` carries the scale when
        :attr:`ScoreTerms.scale_in_query`.
    terms : ScoreTerms
        What turns ``q kᵀ`` into scores.
    restrictions : Restrictions
        Which pairs are admissible.
    dropout : Dropout or None
        Dropout of the weights (``None`` without).
    masks : dict
        The excluded pairs of tiles, by :meth:`Restrictions.mask_key` (a key names one
        mask in every batch slice), built once for the call and shared by the slices of
        :meth:`at` (:data:`KEPT_MASKS` of at most :data:`KEPT_MASK_PAIRS` pairs).
    score_chunks : int
        Chunks of the scores' contraction: :func:`~sdpa_array._arrays.products.score_chunks`
        from :func:`prepare`; each kernel keeps them only where the scores may be large
        (:func:`~.score_bound.chunks_from_bound`; the materialized forward from its rows'
        largest scaled products) and takes 1 elsewhere.
    """

    q: Array
    k: Array
    v: Array
    terms: ScoreTerms
    restrictions: Restrictions
    dropout: Dropout | None = None
    masks: dict[Hashable, Array] = field(default_factory=dict, compare=False, repr=False)
    score_chunks: int = 1

    def at(self, index: tuple[int, ...]) -> Operands:
        """The operands of the outer batch slice ``index``."""
        if not index:
            return self
        return Operands(
            q=at_batch(self.q, index),
            k=at_batch(self.k, index),
            v=at_batch(self.v, index),
            terms=self.terms.at(index),
            restrictions=self.restrictions.at(index),
            dropout=None if self.dropout is None else self.dropout.at(index),
            masks=self.masks,
            score_chunks=self.score_chunks,
        )

    def in_base2(self, *, in_place: bool = False) -> Operands:
        """The operands whose final scores come out times ``log2(e)``
        (:meth:`ScoreTerms.in_base2`, for a forward softmax taken with ``exp2``): the query
        carries the factor where it carries the scale (one more rounding of each query
        element), the terms do otherwise. ``in_place``: the query carrying the scale
        (:func:`prepare`'s own array) is multiplied in place where the library allows it,
        for a caller whose ``self`` is not used again."""
        terms = self.terms.in_base2()
        q = self.q
        if terms.scale_in_query:
            q = inplace.multiply(q, LOG2E) if in_place else q * LOG2E
        return dataclasses.replace(self, q=q, terms=terms)


def prepare_rows(p: Problem, x: Array, *, features: bool = True) -> Array:
    """A query-shaped array in the compute dtype, the full batch shape and kernel layout.

    ``features=True``: ``(..., Hq, L, X)`` arrays (output, its cotangent); ``False``:
    ``(..., Hq, L)`` rows (log-sum-exp, its cotangent), returned as ``(..., L, 1)``.
    """
    xp = p.xp
    x = xp.astype(x, p.compute_dtype, copy=False)
    if not features:
        x = x[..., None]
    x = broadcast_if_needed(xp, x, (*p.batch_shape, p.L, int(x.shape[-1])))
    if p.grouped:
        x = grouped_operand(p, x, query=True)
    return x


def kernel_scale(p: Problem) -> float | Array:
    """``scale`` as the kernels multiply by it: a float, or the 0-d array in the compute dtype."""
    if p.scale_is_array:
        return p.xp.astype(p.scale, p.compute_dtype)
    return p.scale


def prepare(p: Problem, x: Inputs) -> Operands:
    """Cast, scale and group the caller's arrays once, and collect their terms."""
    xp = p.xp
    ndim = len(p.kernel_batch) + 2

    def layout(t: Array, *, query: bool = False, term: bool = False) -> Array:
        if t is None:
            return None
        if p.grouped:
            t = grouped_score_term(p, t) if term else grouped_operand(p, t, query=query)
        return leading_axes(xp, t, ndim)

    bias = None if x.bias is None else xp.astype(x.bias, p.compute_dtype, copy=False)
    sink = None
    if x.sinks is not None:
        sink = xp.astype(x.sinks, p.compute_dtype, copy=False)[..., None, None]
    terms = ScoreTerms(
        kernel_scale(p),
        p.softcap,
        layout(bias, term=True),
        layout(sink, term=True),
        mod_bias(p),
        mod_score(p),
    )
    dropout = None
    if p.dropout_p > 0:
        keys = key_grid(xp, p.keep_seed, p.batch_shape, p.device, p.dropout_batch_start)
        keys = keys[..., None, None]
        dropout = Dropout(p.dropout_p, layout(keys, term=True))
    q = xp.astype(x.query, p.compute_dtype, copy=False)
    if terms.scale_in_query:
        q = q * terms.scale
    members, replaces_band = sequence_members(p)
    if p.band.restricts and not replaces_band:
        members.insert(0, p.band)
    if x.mask is not None:
        members.append(DenseMask(layout(x.mask, term=True), p.S))
    mask_fn = mod_mask(p)
    if mask_fn is not None:
        members.append(mask_fn)
    return Operands(
        q=layout(q, query=True),
        k=layout(xp.astype(x.key, p.compute_dtype, copy=False)),
        v=layout(xp.astype(x.value, p.compute_dtype, copy=False)),
        terms=terms,
        restrictions=Restrictions(tuple(members), p.L, p.S),
        dropout=dropout,
        score_chunks=products.score_chunks(xp, p.E),
    )


def tile_scores(
    p: Problem,
    ops: Operands,
    q_rows: Array,
    rows: slice,
    cols: slice,
    *,
    need_factor: bool = False,
) -> tuple[Array, Any]:
    """Final scores of the (``rows``, ``cols``) tile, ``-inf`` where excluded.

    ``q_rows`` is ``ops.q`` cut to ``rows`` (the caller cuts it once per query block).
    Returns the scores and, with ``need_factor``, the factor that takes their gradient back
    to ``q kᵀ`` (see :meth:`ScoreTerms.apply`).
    """
    s, factor, _, _ = _tile(p, ops, q_rows, rows, cols, need_factor=need_factor, maxima=False)
    return s, factor


def backward_tile_scores(
    p: Problem, ops: Operands, q_rows: Array, rows: slice, cols: slice, *, transposed: bool
) -> tuple[Array, Any, ModInput | None]:
    """Final scores of the tile and their factor (:func:`tile_scores` with
    ``need_factor``), and what a trainable score function's parameter cotangents need
    (:class:`~.score_terms.ModInput`; ``None`` without one). ``transposed``: the scores are
    a transposed view (:func:`~sdpa_array._arrays.products.scores`)."""
    s, factor, _, kept = _tile(
        p, ops, q_rows, rows, cols, need_factor=True, maxima=False, transposed=transposed
    )
    return s, factor, kept


def tile_scores_and_maxima(
    p: Problem, ops: Operands, q_rows: Array, rows: slice, cols: slice, *, maxima: bool
) -> tuple[Array, Array, Array | None]:
    """Final scores of the tile (as :func:`tile_scores`), their row maxima ``(..., rows,
    1)`` (what a softmax subtracts), and with ``maxima`` each row's largest scaled product
    ``scale · q·k`` over the tile's admissible pairs, ``(..., rows, 1)``, ``-inf`` where it
    has none (else ``None``).

    Without a term beyond the scale (:attr:`ScoreTerms.changes_scores`) the final scores
    are the scaled products, and both maxima are one reduction; otherwise the scaled
    products are kept beside the scores and masked alike.
    """
    s, _, best, _ = _tile(p, ops, q_rows, rows, cols, need_factor=False, maxima=maxima)
    if best is not None and not ops.terms.changes_scores:
        return s, best, best
    return s, p.xp.max(s, axis=-1, keepdims=True), best


def fixed_weights(
    p: Problem, ops: Operands, q_rows: Array, rows: slice, cols: slice, *, full: bool = False
) -> Array:
    """The weights ``exp(score)`` of the tile with a reference of 0 (only where
    :func:`~.score_bound.fixed_reference` holds: every score, admissible or not, is
    bounded), 0 where excluded: the restrictions are applied to the weights, after the
    exponential of the scores in their unit (:meth:`ScoreTerms.exp`; NumPy's ``exp2``
    takes a slow path on ``-inf``). ``full``: the plan found every pair admissible, so the
    restrictions are not asked."""
    xp = p.xp
    raw = products.scores(
        xp, q_rows, ops.k[..., cols, :], transposed=False, chunks=ops.score_chunks
    )
    s, _, _ = ops.terms.apply(xp, raw, rows, cols)
    e = ops.terms.exp(xp, s)
    return e if full else _excluded(p, ops, rows, cols, (e,), 0.0)[0]


def fixed_scores_and_scaled(
    p: Problem, ops: Operands, q_rows: Array, rows: slice, cols: slice
) -> tuple[Array, Array]:
    """The tile's final scores as :func:`fixed_weights` takes their exponentials, and its
    scaled products ``scale · q·k`` (times the scores' :attr:`ScoreTerms.unit`), whose row
    maxima are those of :func:`tile_scores_and_maxima`; both ``-inf`` where excluded. They
    are one array where no term beyond the scale changes the scores
    (:attr:`ScoreTerms.changes_scores`; otherwise ``ops`` must not be in base 2,
    :meth:`Operands.in_base2`): read the scaled products before the scores' exponentials
    are written into them."""
    s, scaled, _ = _masked_scores(p, ops, q_rows, rows, cols)
    return s, s if scaled is None else scaled


def _excluded(
    p: Problem,
    ops: Operands,
    rows: slice,
    cols: slice,
    tiles: tuple[Array, ...],
    fill: float,
    *,
    transposed: bool = False,
) -> tuple[Array, ...]:
    """``tiles`` (of the tile's shape) with ``fill`` where the restrictions exclude a pair;
    a run of columns at either end that every query of the tile may attend, and then a run
    of rows at either end that attend every remaining column, are left as they are.
    ``transposed``: the tiles are transposed views
    (:func:`~sdpa_array._arrays.products.scores`), and so is the mask made for them."""
    xp = p.xp
    restrictions = ops.restrictions
    masked = restrictions.partial_columns(rows, cols)
    if masked.start >= masked.stop:
        return tiles
    masked_rows = restrictions.partial_rows(rows, masked)
    if masked_rows.start >= masked_rows.stop:
        return tiles
    key = restrictions.mask_key(masked_rows, masked)
    key = None if key is None else (key, transposed)
    excluded = None if key is None else ops.masks.get(key)
    if excluded is None:
        allowed = restrictions.tile_mask(xp, p.device, masked_rows, masked)
        if allowed is None:
            return tiles
        excluded = xp.logical_not(allowed)
        if transposed:
            excluded = inplace.transposed_layout(xp, excluded)
        pairs = (masked_rows.stop - masked_rows.start) * (masked.stop - masked.start)
        if key is not None and len(ops.masks) < KEPT_MASKS and pairs <= KEPT_MASK_PAIRS:
            ops.masks[key] = excluded
    r = slice(masked_rows.start - rows.start, masked_rows.stop - rows.start)
    c = slice(masked.start - cols.start, masked.stop - cols.start)
    value = xp.asarray(fill, dtype=tiles[0].dtype, device=p.device)
    return tuple(inplace.where_tile(xp, t, r, c, excluded, value) for t in tiles)


def _tile(
    p: Problem,
    ops: Operands,
    q_rows: Array,
    rows: slice,
    cols: slice,
    *,
    need_factor: bool,
    maxima: bool,
    transposed: bool = False,
) -> tuple[Array, Any, Array, ModInput | None]:
    """The tile's final scores, their factor, row maxima and score-function input;
    ``transposed``: the product is a transposed view (:func:`~.products.scores`)."""
    s, scaled, (factor, kept) = _masked_scores(
        p, ops, q_rows, rows, cols, need_factor=need_factor, maxima=maxima, transposed=transposed
    )
    row_maxima = None
    if maxima:
        row_maxima = p.xp.max(s if scaled is None else scaled, axis=-1, keepdims=True)
    return s, factor, row_maxima, kept


def _masked_scores(
    p: Problem,
    ops: Operands,
    q_rows: Array,
    rows: slice,
    cols: slice,
    *,
    need_factor: bool = False,
    maxima: bool = True,
    transposed: bool = False,
) -> tuple[Array, Array | None, tuple[Any, ModInput | None]]:
    """The tile's final scores, ``-inf`` where excluded; with ``maxima`` where a term beyond
    the scale changes the scores, the scaled products masked alike (else ``None``); the
    scores' factor and score-function input (:meth:`ScoreTerms.apply`)."""
    xp = p.xp
    raw = products.scores(
        xp, q_rows, ops.k[..., cols, :], transposed=transposed, chunks=ops.score_chunks
    )
    scaled = ops.terms.scaled(raw) if maxima and ops.terms.changes_scores else None
    s, factor, kept = ops.terms.apply(xp, raw, rows, cols, need_factor=need_factor)
    if scaled is None:
        (s,) = _excluded(p, ops, rows, cols, (s,), -math.inf, transposed=transposed)
    else:
        s, scaled = _excluded(p, ops, rows, cols, (s, scaled), -math.inf, transposed=transposed)
    return s, scaled, (factor, kept)
