"""Tile-level backward of attention, shared by the materialized and blocked VJPs.

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

Every function here works on one (query tile, key tile) pair in the grouped layout of
:mod:`sdpa_array._scores`, so that a tile's ``P`` is either the softmax of the tile (when it
covers every admissible key of its rows) or ``exp(Z - lse)`` from a saved log-sum-exp. Excluded
keys have ``P = 0`` and rows with no admissible key (``lse = -inf``) have ``P = 0`` too, so their
gradients are exactly zero, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._problem import Problem
from ._scores import (
    _grouped_operand,
    apply_score_terms,
    exp_shift,
    prepare_operands,
    prepare_score_terms,
    safe_reciprocal,
    safe_row_max,
)


@dataclass(frozen=True)
class Operands:
    """The inputs of one backward pass, prepared once.

    Attributes
    ----------
    q, k, v : array
        As :func:`sdpa_array._scores.prepare_operands` returns them: compute dtype, grouped
        layout with GQA, ``q`` already multiplied by ``scale`` unless there is a soft-cap.
    mask, bias : array or None
        As :func:`sdpa_array._scores.prepare_score_terms` returns them.
    d_out : array
        The output cotangent ``(..., [Hkv, G,] L, Ev)`` in the compute dtype and grouped layout.
    """

    q: Any
    k: Any
    v: Any
    mask: Any
    bias: Any
    d_out: Any


@dataclass(frozen=True)
class Saved:
    """What the forward pass leaves for the backward pass, prepared for the tiles.

    Attributes
    ----------
    out : array
        The output ``(..., [Hkv, G,] L, Ev)`` in the compute dtype and grouped layout.
    lse : array
        Safe log-sum-exp ``(..., [Hkv, G,] L, 1)`` (see :func:`safe_lse`).
    """

    out: Any
    lse: Any


@dataclass(frozen=True)
class RawGrads:
    """Gradients in the compute dtype, before they are summed to the inputs' shapes.

    ``dq`` is in the grouped query layout; ``dk`` and ``dv`` are ``(..., Hkv, S, E|Ev)``
    with the query heads of each group already summed; ``dbias`` is the score gradient,
    reduced at least to something that broadcasts to the grouped scores (``None`` without
    a bias). Leading axes may still be those of the broadcast batch.
    """

    dq: Any
    dk: Any
    dv: Any
    dbias: Any | None


@dataclass(frozen=True)
class TileGrads:
    """Gradient contributions of one tile (compute dtype, grouped layout).

    ``dq`` is ``(..., rows, E)``; ``dk`` and ``dv`` are ``(..., Hkv, cols, E|Ev)`` already summed
    over the query heads of each group; ``dz`` is the gradient of the tile's final scores
    (``dBias``), or ``None`` when no bias needs it.
    """

    dq: Any
    dk: Any
    dv: Any
    dz: Any


def group_rows(p: Problem, x: Any) -> Any:
    """Put a ``(..., Hq, L, X)`` array into the grouped ``(..., Hkv, G, L, X)`` layout."""
    return _grouped_operand(p, x, "query") if p.grouped else x


def merge_groups(p: Problem, x: Any) -> Any:
    """Merge the group and row axes: ``(..., Hkv, G, n, X)`` to ``(..., Hkv, G * n, X)``.

    A product ``xᵀ y`` of two merged arrays then sums over the query heads of each group,
    which is the adjoint of sharing one key/value head among ``G`` query heads.
    """
    if not p.grouped:
        return x
    shape = tuple(x.shape)
    return p.xp.reshape(x, (*shape[:-3], shape[-3] * shape[-2], shape[-1]))


def sum_to_shape(p: Problem, x: Any, shape: tuple[int, ...]) -> Any:
    """Adjoint of broadcasting ``shape`` to ``x.shape``: sum the broadcast axes away."""
    xp = p.xp
    shape = tuple(shape)
    extra = x.ndim - len(shape)
    if extra > 0:
        x = xp.sum(x, axis=tuple(range(extra)))
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 != n)
    if axes:
        x = xp.sum(x, axis=axes, keepdims=True)
    return x


def prepare_backward(
    p: Problem, query: Any, key: Any, value: Any, mask: Any, bias: Any, grad_output: Any
) -> Operands:
    """Cast, scale and group every input of the backward pass once."""
    q, k, v = prepare_operands(p, query, key, value)
    mask, bias = prepare_score_terms(p, mask, bias)
    xp = p.xp
    d_out = xp.astype(grad_output, p.compute_dtype, copy=False)
    if tuple(d_out.shape) != p.out_shape:
        d_out = xp.broadcast_to(d_out, p.out_shape)
    return Operands(q=q, k=k, v=v, mask=mask, bias=bias, d_out=group_rows(p, d_out))


def prepare_saved(p: Problem, out: Any, lse: Any) -> Saved:
    """Bring a forward pass's output and log-sum-exp into the tiles' layout and dtype."""
    xp = p.xp
    out = xp.astype(out, p.compute_dtype, copy=False)
    lse = xp.astype(lse, p.compute_dtype, copy=False)
    if tuple(out.shape) != p.out_shape:
        out = xp.broadcast_to(out, p.out_shape)
    if tuple(lse.shape) != p.score_shape[:-1]:
        lse = xp.broadcast_to(lse, p.score_shape[:-1])
    return Saved(out=group_rows(p, out), lse=safe_lse(p, group_rows(p, lse[..., None])))


def prepare_grad_lse(p: Problem, grad_lse: Any | None) -> Any | None:
    """A log-sum-exp cotangent ``(..., Hq, L)`` as ``(..., [Hkv, G,] L, 1)`` rows."""
    if grad_lse is None:
        return None
    xp = p.xp
    g = xp.astype(grad_lse, p.compute_dtype, copy=False)
    if tuple(g.shape) != p.score_shape[:-1]:
        g = xp.broadcast_to(g, p.score_shape[:-1])
    return group_rows(p, g[..., None])


def tile_logits(
    p: Problem, q: Any, k: Any, mask: Any, bias: Any, rows: slice, cols: slice
) -> tuple[Any, Any]:
    """Final scores of a tile and the factor that takes their gradient back to ``q kᵀ``.

    The scores are those of :func:`sdpa_array._scores.tile_scores` (the same product,
    soft-cap and :func:`~sdpa_array._scores.apply_score_terms`); this version also keeps
    ``tanh``, whose derivative the soft-cap needs. The factor is ``scale * (1 - tanh²)``
    with a soft-cap and ``None`` without one (the scale is then already in ``q``).
    """
    xp = p.xp
    s = xp.matmul(q, xp.matrix_transpose(k))
    factor = None
    if p.softcap is not None:
        t = xp.tanh(s * (p.scale / p.softcap))
        factor = (1.0 - t * t) * p.scale
        s = t * p.softcap
    return apply_score_terms(p, s, mask, bias, rows, cols), factor


def probabilities(p: Problem, s: Any, lse_rows: Any | None) -> Any:
    """``P`` of a tile from its final scores ``s``, which this consumes (in place if it can).

    With ``lse_rows=None`` the tile holds every admissible key of its rows and ``P`` is its
    row-wise softmax; otherwise ``P = exp(s - lse)`` with the safe log-sum-exp of the rows.
    """
    xp = p.xp
    if lse_rows is None:
        s -= safe_row_max(p, s)  # in place where the library allows; rebinds otherwise
        prob = xp.exp(s)
        prob *= safe_reciprocal(p, xp.sum(prob, axis=-1, keepdims=True))
        return prob
    if tuple(lse_rows.shape[:-1]) == tuple(s.shape[:-1]):
        s -= lse_rows
        return xp.exp(s)
    return xp.exp(s - lse_rows)  # the scores broadcast along an axis the output has


def safe_lse(p: Problem, lse: Any) -> Any:
    """The log-sum-exp with ``-inf`` (no admissible key) replaced by 0: see ``exp_shift``."""
    return exp_shift(p, lse)


def row_delta(p: Problem, d_out: Any, out: Any, grad_lse: Any) -> Any:
    """``D = rowsum(dO * O)``, minus the log-sum-exp cotangent when there is one; ``(..., 1)``."""
    xp = p.xp
    delta = xp.sum(d_out * out, axis=-1, keepdims=True)
    return delta if grad_lse is None else delta - grad_lse


def tile_gradients(
    p: Problem,
    q_rows: Any,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    d_out_rows: Any,
    rows: slice,
    cols: slice,
    *,
    lse_rows: Any | None,
    delta_rows: Any | None,
    grad_lse_rows: Any | None,
    need_dz: bool,
) -> TileGrads:
    """Gradient contributions of the (``rows``, ``cols``) tile.

    Parameters
    ----------
    p : Problem
        The validated call.
    q_rows, d_out_rows : array
        Prepared query and output cotangent cut to ``rows``.
    k, v : array
        Prepared keys and values (all of them: cut to ``cols`` here).
    mask, bias : array or None
        Prepared score terms (uncut, see :func:`sdpa_array._scores.tile_of`).
    rows, cols : slice
        Query and key index ranges of the tile.
    lse_rows : array or None
        Safe log-sum-exp of the rows, ``(..., rows, 1)`` (see :func:`safe_lse`), for
        ``P = exp(Z - lse)``; ``None`` when the tile holds every admissible key of its rows,
        so that its own softmax is ``P``.
    delta_rows : array or None
        ``D`` of the rows, ``(..., rows, 1)`` (see :func:`row_delta`); ``None`` to compute it
        from the tile as ``rowsum(P * dP)``, which needs the tile to hold every admissible
        key of its rows.
    grad_lse_rows : array or None
        Log-sum-exp cotangent ``(..., rows, 1)``; used only when ``delta_rows`` is ``None``.
    need_dz : bool
        Whether to return the score gradient (for ``dBias``).
    """
    xp = p.xp
    k = k[..., cols, :]
    v = v[..., cols, :]
    s, factor = tile_logits(p, q_rows, k, mask, bias, rows, cols)
    prob = probabilities(p, s, lse_rows)
    del s
    # dP = dO Vᵀ has the output's full batch shape, so the updates below work in place.
    d_prob = xp.matmul(d_out_rows, xp.matrix_transpose(v))
    if delta_rows is None:
        delta_rows = xp.vecdot(prob, d_prob)[..., None]
        if grad_lse_rows is not None:
            delta_rows = delta_rows - grad_lse_rows
    d_prob -= delta_rows
    d_prob *= prob
    dz = d_prob  # P * (dP - D)
    dv = xp.matmul(xp.matrix_transpose(merge_groups(p, prob)), merge_groups(p, d_out_rows))
    del prob
    if factor is None:
        ds = dz
    elif need_dz:
        ds = dz * factor
    else:
        dz *= factor
        ds = dz
    dq = xp.matmul(ds, k)
    if factor is None:
        dq *= p.scale
    dk = xp.matmul(xp.matrix_transpose(merge_groups(p, ds)), merge_groups(p, q_rows))
    return TileGrads(dq=dq, dk=dk, dv=dv, dz=dz if need_dz else None)
