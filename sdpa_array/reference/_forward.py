"""The oracle's forward pass: validation, positional masks and every intermediate, in float64."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._convert import as_float64, to_numpy

__all__ = ["ALIGNMENTS", "forward_pass", "positional_mask", "validate_and_prepare"]

ALIGNMENTS = ("top_left", "bottom_right")


def validate_and_prepare(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    window: Any,
    alignment: str,
    scale: float | None,
    softcap: float | None,
    enable_gqa: bool,
) -> dict[str, Any]:
    """Convert the inputs, check their shapes and expand GQA heads.

    Returns a dict with float64 ``q``, ``k_rep``, ``v_rep`` (keys/values with one head per
    query head), the original key/value shapes, ``group`` (query heads per key/value head,
    1 without GQA), the resolved ``scale``, and ``mask`` / ``bias`` as NumPy arrays or
    ``None``.
    """
    q = as_float64(query)
    k = as_float64(key)
    v = as_float64(value)

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

    group = 1
    k_rep, v_rep = k, v
    if enable_gqa:
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
        # Query head h uses key/value head h // group (torch's repeat_interleave grouping).
        k_rep = np.repeat(k, group, axis=-3)
        v_rep = np.repeat(v, group, axis=-3)

    e = q.shape[-1]
    if scale is None:
        # With E == 0 every score is 0 whatever the scale, so any finite value will do.
        scale = 1.0 / math.sqrt(e) if e > 0 else 1.0

    mask_np = None
    if mask is not None:
        mask_np = to_numpy(mask)
        if mask_np.dtype != np.bool_:
            raise TypeError(f"mask must be boolean (True = may attend), got {mask_np.dtype}")
    bias_np = None if bias is None else as_float64(bias)

    return {
        "q": q,
        "k": k,
        "v": v,
        "k_rep": k_rep,
        "v_rep": v_rep,
        "group": group,
        "scale": float(scale),
        "mask": mask_np,
        "bias": bias_np,
    }


def positional_mask(L: int, S: int, is_causal: bool, window: Any, alignment: str) -> np.ndarray:
    """Boolean ``(L, S)`` array: may query ``i`` attend key ``j`` by position alone."""
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    diag = i if alignment == "top_left" else i + (S - L)
    allowed = np.ones((L, S), dtype=bool)
    if is_causal:
        allowed &= j <= diag
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= diag - int(left)
        if right is not None:
            allowed &= j <= diag + int(right)
    return allowed


def forward_pass(
    prep: dict[str, Any], is_causal: bool, window: Any, alignment: str, softcap: float | None
) -> dict[str, np.ndarray]:
    """All forward intermediates, in float64.

    Keys: ``raw`` (scaled scores before softcap), ``z`` (final scores with ``-inf`` at
    excluded keys), ``allowed`` (boolean, same shape as ``z``), ``has_key`` (per row),
    ``weights``, ``out``, ``lse``.
    """
    q, k_rep, v_rep = prep["q"], prep["k_rep"], prep["v_rep"]
    scale = prep["scale"]
    L, S = q.shape[-2], k_rep.shape[-2]

    # The batch (and heads) axes of all three inputs broadcast together, so that weights and
    # lse carry the same leading axes as the output even when only `value` has some.
    lead = np.broadcast_shapes(q.shape[:-2], k_rep.shape[:-2], v_rep.shape[:-2])
    raw = np.matmul(q, np.swapaxes(k_rep, -1, -2)) * scale
    raw = np.broadcast_to(raw, (*lead, L, S))  # (..., Hq, L, S)
    scores = softcap * np.tanh(raw / softcap) if softcap is not None else raw
    if prep["bias"] is not None:
        # Must broadcast *to* the scores' shape (it may not add batch axes).
        scores = scores + np.broadcast_to(prep["bias"], scores.shape)

    allowed = np.broadcast_to(positional_mask(L, S, is_causal, window, alignment), scores.shape)
    if prep["mask"] is not None:
        allowed = allowed & np.broadcast_to(prep["mask"], scores.shape)
    # A -inf score (from the bias) excludes its key. (NaN is not excluded: it propagates.)
    allowed = allowed & (scores != -np.inf)

    z = np.where(allowed, scores, -np.inf)

    # Numerically stable softmax over the admissible keys of each row. Rows with no
    # admissible key have max -inf; use 0 there so that no inf - inf is ever formed.
    row_max = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    has_key = np.any(allowed, axis=-1, keepdims=True)
    shift = np.where(has_key, row_max, 0.0)
    exps = np.exp(np.where(allowed, z - shift, -np.inf))  # exactly 0 where excluded
    total = np.sum(exps, axis=-1, keepdims=True)  # >= 1 on rows with an admissible key
    safe_total = np.where(has_key, total, 1.0)
    weights = exps / safe_total

    out = np.matmul(weights, v_rep)
    lse = np.where(has_key, shift + np.log(safe_total), -np.inf)[..., 0]

    return {
        "raw": raw,
        "z": z,
        "allowed": allowed,
        "has_key": has_key[..., 0],
        "weights": weights,
        "out": out,
        "lse": lse,
    }
