"""The oracle's forward pass: validation and every intermediate, in float64.

Which keys a query may attend by index (causal, window, lengths, segments) is written in
``_restrictions``; here it is combined with ``mask`` and ``-inf`` scores.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._convert import as_float64, to_numpy
from ._dropout import keep_mask
from ._mods import check_mods, evaluate_mod, evaluate_score, index_grids
from ._options import OracleOptions
from ._restrictions import allowed_by_index, as_lengths, as_segments, resolve_scale

__all__ = ["ALIGNMENTS", "forward_pass", "score_derivative", "validate_and_prepare"]

ALIGNMENTS = ("top_left", "bottom_right")


def validate_and_prepare(query: Any, key: Any, value: Any, o: OracleOptions) -> dict[str, Any]:
    """Convert the inputs, check their shapes and expand GQA heads.

    Returns a dict with float64 ``q``, ``k``, ``v`` and ``k_rep``, ``v_rep`` (keys/values
    with one head per query head), ``group`` (query heads per key/value head, 1 without
    GQA), the resolved ``scale`` (a float) and ``scale_is_array`` (whether it was given as
    an array), ``mask`` / ``bias`` as NumPy arrays or ``None``, ``batch`` (the broadcast
    leading shape without the heads axis), ``query_lengths`` / ``key_lengths`` (int64 of
    shape ``batch``, ``L`` / ``S`` where not given) and ``segments`` (``None`` or the pair
    of segment id arrays broadcast to ``batch + (L,)`` and ``batch + (S,)``), ``sinks``
    (float64 broadcast to ``(..., Hq)`` or ``None``) with ``sinks_shape`` (its own shape),
    ``dropout_p`` and ``dropout_seed``, and ``mask_mod`` / ``bias_mod``: ``None`` or the
    mod's result broadcast to the scores' shape (boolean / float64; see ``_mods``), and
    ``score_mod`` (the function, or ``None``) with ``score_grids``, NumPy index arrays.
    """
    check_mods(o.mask_mod, o.bias_mod, o.score_mod)
    q = as_float64(query)
    k = as_float64(key)
    v = as_float64(value)

    _check_shapes_and_options(q, k, v, o.alignment, o.softcap, o.window)
    group, k_rep, v_rep = _expand_gqa(q, k, v) if o.enable_gqa else (1, k, v)
    scale_value, scale_is_array = resolve_scale(o.scale, q.shape[-1])

    # Batch shape: the broadcast leading axes of all three inputs, less the heads axis
    # (-3) where there is one. Lengths and segment ids are per batch element, not per head.
    lead = np.broadcast_shapes(q.shape[:-2], k_rep.shape[:-2], v_rep.shape[:-2])
    batch = lead[:-1]
    L, S = q.shape[-2], k.shape[-2]
    q_lengths = as_lengths("query_lengths", o.query_lengths, batch, L)
    k_lengths = as_lengths("key_lengths", o.key_lengths, batch, S)
    segments = as_segments(o.segment_ids, batch, L, S)

    mask_np = None
    if o.mask is not None:
        mask_np = to_numpy(o.mask)
        if mask_np.dtype != np.bool_:
            raise TypeError(f"mask must be boolean (True = may attend), got {mask_np.dtype}")
    bias_np = None if o.bias is None else as_float64(o.bias)

    given_sinks = None if o.sinks is None else as_float64(o.sinks)
    sinks_np = None if given_sinks is None else _broadcast_sinks(given_sinks, lead)
    if not 0.0 <= o.dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {o.dropout_p!r}")
    if o.dropout_p > 0 and o.dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed")

    # The mods, evaluated once on the full (batch..., Hq, L, S) grid of indices.
    mods: dict[str, np.ndarray | None] = {"mask_mod": None, "bias_mod": None}
    if o.mask_mod is not None or o.bias_mod is not None:
        grids = index_grids(query, lead, L, S)
        for name, fn in (("mask_mod", o.mask_mod), ("bias_mod", o.bias_mod)):
            if fn is not None:
                mods[name] = evaluate_mod(name, fn, grids, (*lead, L, S))

    return {
        "q": q,
        "k": k,
        "v": v,
        "k_rep": k_rep,
        "v_rep": v_rep,
        "group": group,
        "scale": scale_value,
        "scale_is_array": scale_is_array,
        "mask": mask_np,
        "bias": bias_np,
        "batch": batch,
        "query_lengths": q_lengths,
        "key_lengths": k_lengths,
        "segments": segments,
        "sinks": sinks_np,
        "padding_side": o.padding_side,
        "sinks_shape": None if given_sinks is None else given_sinks.shape,
        "dropout_p": float(o.dropout_p),
        # a seed given as a 0-d array of any library counts by its value
        "dropout_seed": None if o.dropout_seed is None else int(to_numpy(o.dropout_seed)),
        **mods,
        "score_mod": o.score_mod,
        "score_grids": None if o.score_mod is None else index_grids(q, lead, L, S),
    }


def _check_shapes_and_options(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, alignment: str, softcap: Any, window: Any
) -> None:
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions, got shape {a.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key must share the embedding size E: {q.shape[-1]} != {k.shape[-1]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"key and value must share the sequence length S: {k.shape[-2]} != {v.shape[-2]}"
        )
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap!r}")
    if window is not None:
        if len(window) != 2:
            raise ValueError(f"window must be a pair (left, right), got {window!r}")
        for side in window:
            if side is not None and side != int(side):
                raise ValueError(f"window sides must be integers or None, got {window!r}")


def _expand_gqa(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """``(group, k_rep, v_rep)``: query heads per key/value head, and the keys and values
    repeated so that query head ``h`` meets key/value head ``h // group`` (torch's
    ``repeat_interleave`` grouping)."""
    if q.ndim < 3 or k.ndim < 3 or v.ndim < 3:
        raise ValueError("enable_gqa=True needs a heads axis (-3) on query, key and value")
    hq, hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != hkv:
        raise ValueError(
            f"key and value must have the same number of heads: {hkv} != {v.shape[-3]}"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    group = hq // hkv
    return group, np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)


def _broadcast_sinks(sinks: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    try:
        fits = np.broadcast_shapes(sinks.shape, lead) == tuple(lead)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"sinks of shape {sinks.shape} do not broadcast to {lead}")
    return np.broadcast_to(sinks, lead)


def forward_pass(prep: dict[str, Any], o: OracleOptions) -> dict[str, np.ndarray]:
    """All forward intermediates, in float64.

    Keys: ``raw`` (scaled scores before softcap), ``max_scores`` (``(..., Hq)``, the
    largest ``raw`` over the pairs the restrictions admit, ``-inf`` without any), ``z``
    (final scores with ``-inf`` at excluded keys), ``allowed`` (boolean, same shape as
    ``z``), ``has_key`` (per row),
    ``weights`` (the softmax, before dropout), ``sink_weight`` (``(..., L)``, the sink's share
    of each row, zeros without sinks), ``keep`` (the dropout multiplier ``keep / (1 - p)``,
    or ``None``), ``dropped`` (the weights after dropout), ``out``, ``lse``.

    Sinks: each row gets one more logit, ``sinks[..., h]``, whose value is zero: the softmax
    runs over ``[z, sink]`` and its last column is dropped, so the weights sum to less than
    one and ``lse`` includes the sink. Dropout multiplies the weights by the keep mask of
    :func:`sdpa_array.dropout_keep_mask` over ``1 - p``; ``lse`` is unaffected.
    """
    q, k_rep, v_rep = prep["q"], prep["k_rep"], prep["v_rep"]
    scale = prep["scale"]
    L, S = q.shape[-2], k_rep.shape[-2]

    # The batch (and heads) axes of all three inputs broadcast together, so that weights and
    # lse carry the same leading axes as the output even when only `value` has some.
    lead = np.broadcast_shapes(q.shape[:-2], k_rep.shape[:-2], v_rep.shape[:-2])
    raw = np.matmul(q, np.swapaxes(k_rep, -1, -2)) * scale
    raw = np.broadcast_to(raw, (*lead, L, S))  # (..., Hq, L, S)
    modded = raw
    if prep["score_mod"] is not None:  # after the scale, before the softcap
        modded = evaluate_score("score_mod", prep["score_mod"], raw, prep["score_grids"])
    softcap = o.softcap
    scores = softcap * np.tanh(modded / softcap) if softcap is not None else modded
    if prep["bias"] is not None:
        # Must broadcast *to* the scores' shape (it may not add batch axes).
        scores = scores + np.broadcast_to(prep["bias"], scores.shape)
    if prep["bias_mod"] is not None:  # where bias is: after the softcap, before masks
        scores = scores + prep["bias_mod"]

    # Causal, window, lengths and segments: one (batch..., L, S) array, the same for every
    # head (so a heads axis is inserted before L where the inputs have one).
    by_index = allowed_by_index(
        L,
        S,
        prep["query_lengths"],
        prep["key_lengths"],
        prep["segments"],
        o.is_causal,
        o.window,
        o.alignment,
        prep["padding_side"],
    )
    if lead:
        by_index = by_index[..., None, :, :]
    allowed = np.broadcast_to(by_index, scores.shape)
    if prep["mask"] is not None:
        allowed = allowed & np.broadcast_to(prep["mask"], scores.shape)
    if prep["mask_mod"] is not None:
        allowed = allowed & prep["mask_mod"]
    # The largest scaled product over the pairs the restrictions admit (a -inf bias does
    # not restrict: the maximum is taken before the bias), per batch element and head.
    max_scores = np.max(np.where(allowed, raw, -np.inf), axis=(-2, -1), initial=-np.inf)
    # A -inf score (from the bias) excludes its key. (NaN is not excluded: it propagates.)
    allowed = allowed & (scores != -np.inf)

    z = np.where(allowed, scores, -np.inf)
    if prep["sinks"] is not None:
        sink_col = np.broadcast_to(prep["sinks"][..., None, None], (*z.shape[:-1], 1))
        z = np.concatenate([z, sink_col], axis=-1)
        allowed = np.concatenate([allowed, sink_col != -np.inf], axis=-1)

    # Numerically stable softmax over the admissible keys of each row. Rows with no
    # admissible key have max -inf; use 0 there so that no inf - inf is ever formed.
    row_max = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    has_key = np.any(allowed, axis=-1, keepdims=True)
    shift = np.where(has_key, row_max, 0.0)
    exps = np.exp(np.where(allowed, z - shift, -np.inf))  # exactly 0 where excluded
    total = np.sum(exps, axis=-1, keepdims=True)  # >= 1 on rows with an admissible key
    safe_total = np.where(has_key, total, 1.0)
    weights_all = exps / safe_total
    weights = weights_all[..., :S]
    sink_weight = weights_all[..., S] if prep["sinks"] is not None else np.zeros(z.shape[:-1])

    keep = None
    dropped = weights
    if prep["dropout_p"] > 0:
        p = prep["dropout_p"]
        mask = keep_mask(prep["dropout_seed"], weights.shape, p)
        keep = mask.astype(np.float64) / (1.0 - p)
        dropped = weights * keep

    out = np.matmul(dropped, v_rep)
    lse = np.where(has_key, shift + np.log(safe_total), -np.inf)[..., 0]

    return {
        "raw": raw,
        "modded": modded,
        "z": z[..., :S],
        "allowed": allowed[..., :S],
        "has_key": np.any(allowed[..., :S], axis=-1),
        "weights": weights,
        "weights_all": weights_all,
        "sink_weight": sink_weight,
        "keep": keep,
        "dropped": dropped,
        "out": out,
        "lse": lse,
        "max_scores": max_scores,
    }


def score_derivative(prep: dict[str, Any], raw: np.ndarray) -> np.ndarray:
    """``score_mod.derivative(raw, ...)``: what the VJP multiplies by through ``score_mod``.

    Raises
    ------
    TypeError
        If ``score_mod`` has no ``derivative`` method (the oracle differentiates nothing
        itself).
    """
    fn = prep["score_mod"]
    derivative = getattr(fn, "derivative", None)
    if not callable(derivative):
        raise TypeError(
            "the reference VJP needs score_mod's derivative: give score_mod as "
            "sdpa_array.mods.score_function(score_mod, derivative)"
        )
    return evaluate_score("score_mod.derivative", derivative, raw, prep["score_grids"])
