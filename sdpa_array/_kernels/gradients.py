r"""Tile-level backward of attention, shared by the materialized and blocked VJPs.

With ``Z`` the final scores (soft-capped, biased, ``-inf`` where excluded), ``P = softmax(Z)``
row-wise and ``O = P V``, the vector-Jacobian product for a cotangent ``dO`` follows from the
softmax Jacobian ``dp_j/dz_k = p_j (delta_jk - p_k)``:

* ``dV = Pᵀ dO`` and ``dP = dO Vᵀ``;
* ``dZ = P * (dP - D)`` with ``D_i = sum_j P_ij dP_ij = rowsum(dO * O)_i``: the Jacobian applied
  to a row without ever forming it (FlashAttention-2);
* ``dBias = dZ``; the soft-cap ``c tanh(x / c)`` multiplies by ``1 - tanh²(x / c)``;
* ``dQ = scale * dS K`` and ``dK = scale * dSᵀ Q``, with ``dS`` the gradient of ``Q Kᵀ``.

A cotangent ``g`` of the log-sum-exp adds ``P * g`` to ``dZ`` (``d lse_i / d z_ij = P_ij``), so
it folds into ``D`` as ``D - g``.

Sinks: a sink is one more logit per row whose value is zero, so ``dZ`` keeps its form and
``D`` gets no sink term; ``P = exp(Z - lse)`` with the log-sum-exp that includes the sink,
or the tile's softmax with ``exp(sink - m)`` in its denominator. With ``p_sink`` the sink's
share of a row, the sink's own gradient is ``dZ_sink = p_sink * (0 - D)``, summed over the
rows: by each tile that holds whole rows (:attr:`TileGrads.dsink`), else from the saved
log-sum-exp (:func:`sink_gradient`).

Dropout: with ``M = keep / (1 - p)`` the output is ``(P * M) V``, so ``dV = (P * M)ᵀ dO`` and
``dP = (dO Vᵀ) * M``; ``D = rowsum(P * dP) = rowsum(dO * O)`` still holds. The keep mask is
regenerated from the tile's absolute indices (:mod:`.dropout`).

Every function here works on one (query tile, key tile) pair in the kernel layout, so that a
tile's ``P`` is either the softmax of the tile (when it covers every admissible key of its
rows) or ``exp(Z - lse)`` from a saved log-sum-exp. Excluded keys have ``P = 0`` and rows with
no admissible key (``lse = -inf``) have ``P = 0`` too, so their gradients are exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._arrays import inplace, products
from .._arrays.slicing import at_batch
from .._arrays.typing import Array
from .._problem.problem import Inputs, Problem
from .layout import merge_groups
from .operands import Operands, backward_tile_scores, prepare, prepare_rows
from .score_terms import ModInput, ScoreTerms
from .softmax import exp_shift, row_sum, safe_reciprocal

__all__ = [
    "BackwardOperands",
    "RowOperands",
    "TileGrads",
    "prepare_backward",
    "row_delta",
    "sink_gradient",
    "tile_gradients",
]


@dataclass(frozen=True)
class RowOperands:
    """The backward operands of some query rows, shared by all the tiles of those rows.

    Attributes
    ----------
    q, d_out : array
        Prepared query and output cotangent, ``(..., rows, E|Ev)``.
    lse : array or None
        Safe log-sum-exp ``(..., rows, 1)`` for ``P = exp(Z - lse)``; ``None`` when each
        tile holds every admissible key of its rows, so that its own softmax is ``P``.
    delta : array or None
        ``D`` of the rows, ``(..., rows, 1)`` (see :func:`row_delta`); ``None`` to compute it
        from the tile as ``rowsum(P * dP)``, which needs the tile to hold whole rows.
    grad_lse : array or None
        Log-sum-exp cotangent ``(..., rows, 1)``; used only when ``delta`` is ``None``.
    """

    q: Array
    d_out: Array
    lse: Array = None
    delta: Array = None
    grad_lse: Array = None


@dataclass(frozen=True)
class BackwardOperands:
    """The inputs of one backward pass, prepared once, in the kernel layout.

    Attributes
    ----------
    ops : Operands
        Query, key, value and their terms, as the forward prepares them.
    d_out : array
        The output cotangent ``(..., L, Ev)``.
    out : array or None
        The forward pass's output ``(..., L, Ev)``, when saved.
    lse : array or None
        The forward pass's log-sum-exp as ``(..., L, 1)`` rows, ``-inf`` replaced by 0
        (:func:`~sdpa_array._kernels.softmax.exp_shift`), when saved.
    grad_lse : array or None
        Cotangent of the log-sum-exp, ``(..., L, 1)``.
    """

    ops: Operands
    d_out: Array
    out: Array = None
    lse: Array = None
    grad_lse: Array = None

    def at(self, index: tuple[int, ...]) -> BackwardOperands:
        """The operands of the outer batch slice ``index``."""
        if not index:
            return self
        return BackwardOperands(
            self.ops.at(index),
            *(at_batch(a, index) for a in (self.d_out, self.out, self.lse, self.grad_lse)),
        )

    def rows(self, p: Problem, rows: slice) -> RowOperands:
        """The operands of the query rows ``rows``.

        Without a saved forward pass ``lse`` and ``delta`` are ``None``: each tile must then
        hold whole rows.
        """
        q, d_out = self.ops.q[..., rows, :], self.d_out[..., rows, :]
        g = None if self.grad_lse is None else self.grad_lse[..., rows, :]
        if self.lse is None:
            return RowOperands(q, d_out, grad_lse=g)
        delta = row_delta(p, d_out, self.out[..., rows, :], g)
        return RowOperands(q, d_out, self.lse[..., rows, :], delta, g)


@dataclass(frozen=True)
class TileGrads:
    """Gradient contributions of one tile (compute dtype, kernel layout).

    ``dq`` is ``(..., rows, E)``; ``dk`` and ``dv`` are ``(..., Hkv, cols, E|Ev)`` already summed
    over the query heads of each group; ``dz`` is the gradient of the tile's final scores
    (``dBias``), or ``None`` when no bias needs it; ``dsink`` is the sinks' gradient from the
    tile's rows, ``(..., 1, 1)``, when the tile holds whole rows (else ``None``:
    :func:`sink_gradient` then gives it from the log-sum-exp); ``dtables`` the tile's part
    of the gradients of ``bias_mod``'s parameters, when they are asked for.
    """

    dq: Array
    dk: Array
    dv: Array
    dz: Array
    dsink: Array = None
    dtables: tuple[Array, ...] | None = None


def prepare_backward(
    p: Problem,
    x: Inputs,
    grad_output: Array,
    *,
    out: Array = None,
    lse: Array = None,
    grad_lse: Array = None,
    ops: Operands | None = None,
) -> BackwardOperands:
    """Cast, scale and group every input of the backward pass once.

    ``ops``: the operands when :func:`~sdpa_array._kernels.operands.prepare` already ran.
    """
    saved_lse = None if lse is None else exp_shift(p, prepare_rows(p, lse, features=False))
    return BackwardOperands(
        ops=prepare(p, x) if ops is None else ops,
        d_out=prepare_rows(p, grad_output),
        out=None if out is None else prepare_rows(p, out),
        lse=saved_lse,
        grad_lse=None if grad_lse is None else prepare_rows(p, grad_lse, features=False),
    )


def _weights(
    p: Problem,
    terms: ScoreTerms,
    s: Array,
    lse_rows: Array,
    *,
    fixed: bool = False,
    strided: bool = False,
) -> tuple[Array, Array, Array]:
    """The weights of a tile from its final scores ``s``, which this consumes, as
    ``(w, inv, p_sink)`` with ``P = inv * w`` row by row.

    With ``lse_rows=None`` the tile holds every admissible key of its rows: ``w`` is
    ``exp(s - ref)`` and ``inv`` ``(..., 1)`` the reciprocal of its rows' sums (the sink in
    them), left for the caller to apply where it is cheap (to the small operands that the
    rows' products take), and the sink's share ``p_sink`` ``(..., 1)`` is returned too;
    otherwise ``w = P = exp(s - lse)`` and ``inv`` and ``p_sink`` are ``None``. ``fixed``:
    the softmax takes a reference of 0 instead of each row's maximum
    (:func:`~.score_bound.fixed_reference` holds); ``strided``: ``s`` is a transposed view
    (:func:`~.softmax.row_sum`).
    """
    xp = p.xp
    if lse_rows is not None:
        return inplace.exp(xp, inplace.subtract(s, lse_rows)), None, None
    if fixed:
        w = inplace.exp(xp, s)
        sink = terms.sink_total(xp, 0.0)
    else:
        ref = exp_shift(p, terms.row_max(xp, xp.max(s, axis=-1, keepdims=True)))
        w = inplace.exp(xp, inplace.subtract(s, ref))
        sink = terms.sink_total(xp, ref)
    total = row_sum(p, w, strided=strided)
    if sink is not None:
        total = total + sink
    inv = safe_reciprocal(p, total)
    return w, inv, None if sink is None else sink * inv


def row_delta(p: Problem, d_out: Array, out: Array, grad_lse: Array) -> Array:
    """``D = rowsum(dO * O)``, minus the log-sum-exp cotangent when there is one; ``(..., 1)``."""
    xp = p.xp
    delta = xp.sum(d_out * out, axis=-1, keepdims=True)
    return delta if grad_lse is None else delta - grad_lse


def sink_gradient(p: Problem, b: BackwardOperands) -> Array:
    """``dSink = -sum_i p_sink_i D_i`` with ``p_sink = exp(sink - lse)``, ``(..., 1, 1)``.

    ``D`` includes the log-sum-exp cotangent (``d lse_i / d sink = p_sink_i``). Needs the
    forward pass's output and log-sum-exp in ``b``.
    """
    xp = p.xp
    sink = b.ops.terms.sink
    p_sink = xp.exp(sink - b.lse)
    delta = row_delta(p, b.d_out, b.out, b.grad_lse)
    return -xp.sum(p_sink * delta, axis=-2, keepdims=True)


def tile_gradients(
    p: Problem,
    ops: Operands,
    r: RowOperands,
    rows: slice,
    cols: slice,
    *,
    need_dz: bool,
    fixed: bool = False,
) -> TileGrads:
    """Gradient contributions of the (``rows``, ``cols``) tile.

    Parameters
    ----------
    p : Problem
        The validated call.
    ops : Operands
        The prepared operands (keys, values and terms are cut to ``cols`` here).
    r : RowOperands
        The operands of the tile's query rows (:meth:`BackwardOperands.rows`).
    rows, cols : slice
        Query and key index ranges of the tile.
    need_dz : bool
        Whether to return the score gradient (for ``dBias``).
    fixed : bool
        Whether a tile holding whole rows takes its softmax with a reference of 0
        (:func:`~.score_bound.fixed_reference` holds for the call).
    """
    xp = p.xp
    k = ops.k[..., cols, :]
    v = ops.v[..., cols, :]
    bias_trained = ops.terms.bias_mod is not None and ops.terms.bias_mod.trainable
    keep_dz = need_dz or bias_trained
    # NumPy's wide tiles as transposed products; not across GQA groups, whose merged rows
    # (merge_groups) would then be a copy of the tile
    transposed = products.transposes(xp, r.q, k) and not p.grouped
    s, factor, mod_input = backward_tile_scores(p, ops, r.q, rows, cols, transposed=transposed)
    prob, inv, p_sink = _weights(p, ops.terms, s, r.lse, fixed=fixed, strided=transposed)
    del s
    # P = inv * w row by row (w = prob when inv is None): the rows' factor goes onto dO
    # (rows x Ev), not onto the tile, so dP and dV below come out as inv * dP and Pᵀ dO
    d_out = r.d_out if inv is None else r.d_out * inv
    d_prob = products.scores(xp, d_out, v, transposed=transposed)  # laid out as the scores
    kept = prob
    if ops.dropout is not None:
        keep = ops.dropout.keep(xp, rows, cols, p.device)
        d_prob = ops.dropout.apply(xp, d_prob, keep)
        kept = ops.dropout.apply(xp, prob, keep)
    delta = r.delta
    if delta is None:
        # Σ w inv dP = Σ P dP; along the strided rows of transposed tiles, as a product
        delta = (
            row_sum(p, prob * d_prob, strided=True)
            if transposed
            else xp.vecdot(prob, d_prob)[..., None]
        )
        if r.grad_lse is not None:
            delta = delta - r.grad_lse
    # the sink's dZ is p_sink * (0 - D), its value being zero
    dsink = None if p_sink is None else -xp.sum(p_sink * delta, axis=-2, keepdims=True)
    # P * (dP - D) = w * (inv dP - inv D)
    dz = inplace.multiply(inplace.subtract(d_prob, delta if inv is None else delta * inv), prob)
    rows_whole = p.L * (p.groups if p.grouped else 1)  # what dK and dV sum over
    dv = products.matmul(
        xp, xp.matrix_transpose(merge_groups(p, kept)), merge_groups(p, d_out), rows_whole
    )
    del prob, kept
    dtables = _table_cotangents(ops, dz, mod_input, bias_trained, rows, cols)
    if factor is None:
        ds = dz
    elif keep_dz or mod_input is not None:
        ds = dz * factor
    else:
        ds = dz = inplace.multiply(dz, factor)
    dq = products.matmul(xp, ds, k, p.S)
    if factor is None:
        dq = inplace.multiply(dq, ops.terms.scale)
    dk = products.matmul(
        xp, xp.matrix_transpose(merge_groups(p, ds)), merge_groups(p, r.q), rows_whole
    )
    return TileGrads(dq=dq, dk=dk, dv=dv, dz=dz if need_dz else None, dsink=dsink, dtables=dtables)


def _table_cotangents(
    ops: Operands,
    dz: Array,
    mod_input: ModInput | None,
    bias_trained: bool,
    rows: slice,
    cols: slice,
) -> tuple[Array, ...] | None:
    """The tile's parts of the trainable functions' parameter gradients (``score_mod``'s,
    then ``bias_mod``'s), from the score gradient ``dZ``: the bias is added to the scores,
    so ``dZ`` is its cotangent; the score function's values go through the soft-cap, so
    theirs is ``dZ`` times its derivative. ``None`` without a trainable function."""
    parts: list[Array] = []
    if mod_input is not None:
        d_mod = dz if mod_input.after is None else dz * mod_input.after
        parts += ops.terms.score_mod.cotangents(d_mod, mod_input.scores, rows, cols)  # type: ignore[union-attr]
    if bias_trained:
        parts += ops.terms.bias_mod.cotangents(dz, rows, cols)  # type: ignore[union-attr]
    return tuple(parts) if parts else None
