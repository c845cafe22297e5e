"""Plain float64 NumPy reference ("oracle") for scaled dot-product attention.

This module is the test suite's yardstick for the fast Array API implementation. It is
written to be *read*, not to be fast: every step of the definition appears as one NumPy
expression, in float64, with the causal/window restrictions built from explicit index
grids and a hand-written, max-subtracted softmax. It deliberately shares no code with the
rest of :mod:`sdpa_array`, so that a mistake in one cannot hide in the other.

The gradients in :func:`scaled_dot_product_attention_vjp` are written directly from the
chain rule, forming the softmax Jacobian ``J = diag(p) - p pᵀ`` explicitly for every
query row (an ``(..., L, S, S)`` array), rather than using the FlashAttention shortcut.

Semantics
---------
With ``Q`` of shape ``(..., Hq, L, E)``, ``K`` of shape ``(..., Hkv, S, E)`` and ``V`` of
shape ``(..., Hkv, S, Ev)`` (the heads axis is optional, leading batch axes broadcast):

1. ``z = (Q Kᵀ) * scale`` with ``scale = 1/sqrt(E)`` by default;
2. if ``softcap`` is given, ``z = softcap * tanh(z / softcap)``;
3. if ``bias`` is given, ``z = z + bias``;
4. keys excluded by ``mask`` (``False``), ``is_causal``, ``window`` or a ``-inf`` score get
   ``-inf``;
5. ``P = softmax(z)`` row-wise and ``out = P V``.

A query row with no admissible key yields an output row of zeros, weights of zeros and a
log-sum-exp of ``-inf``.

Examples
--------
>>> import numpy as np
>>> from sdpa_array.reference import scaled_dot_product_attention
>>> q = np.array([[1.0, 0.0]])
>>> k = np.array([[1.0, 0.0], [0.0, 1.0]])
>>> v = np.array([[1.0], [0.0]])
>>> out, w = scaled_dot_product_attention(q, k, v, scale=np.log(3.0), return_weights=True)
>>> w
array([[0.75, 0.25]])
>>> out
array([[0.75]])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "to_numpy",
]

_ALIGNMENTS = ("top_left", "bottom_right")


# --------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------


def to_numpy(x: Any) -> np.ndarray:
    """Copy an array of any supported library to a NumPy array on the host.

    Parameters
    ----------
    x : array_like
        A NumPy, torch (any device, any dtype, with or without ``requires_grad``), JAX,
        Dask, array-api-strict or CuPy array, or anything :func:`numpy.asarray` accepts
        (Python scalars, nested lists).

    Returns
    -------
    numpy.ndarray
        A new NumPy array that shares no memory with ``x``. Its dtype is the closest NumPy
        dtype to that of ``x``; ``bfloat16`` (which NumPy lacks; torch and JAX have it)
        becomes ``float32``.

    Notes
    -----
    Dask arrays are computed. Array-api-strict arrays on one of its simulated non-CPU
    devices are first moved to its CPU device.

    Examples
    --------
    >>> to_numpy([1, 2, 3])
    array([1, 2, 3])
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return np.array(x, copy=True)

    library = type(x).__module__.split(".")[0]

    if library == "torch":
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)
        return np.array(t.resolve_conj().resolve_neg().numpy(), copy=True)

    if library == "cupy":
        return np.array(x.get(), copy=True)

    if library == "array_api_strict":
        import array_api_strict

        cpu = array_api_strict.Device("CPU_DEVICE")
        if x.device != cpu:
            x = x.to_device(cpu)
        return np.array(np.from_dlpack(x), copy=True)

    if library == "dask":
        return np.array(x.compute(), copy=True)

    # JAX arrays, Python scalars and sequences, and anything else with __array__.
    try:
        result = np.array(x, copy=True)
    except (TypeError, ValueError):
        result = np.array(np.from_dlpack(x), copy=True)
    if result.dtype.name == "bfloat16":  # JAX's ml_dtypes.bfloat16: widen, as for torch
        result = result.astype(np.float32)
    return result


# --------------------------------------------------------------------------------------
# shared forward building blocks (private to the oracle)
# --------------------------------------------------------------------------------------


def _as_float64(x: Any) -> np.ndarray:
    return to_numpy(x).astype(np.float64)


def _validate_and_prepare(
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
    q = _as_float64(query)
    k = _as_float64(key)
    v = _as_float64(value)

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
    if alignment not in _ALIGNMENTS:
        raise ValueError(f"alignment must be one of {_ALIGNMENTS}, got {alignment!r}")
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
    bias_np = None if bias is None else _as_float64(bias)

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


def _positional_mask(L: int, S: int, is_causal: bool, window: Any, alignment: str) -> np.ndarray:
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


def _forward(
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

    allowed = np.broadcast_to(_positional_mask(L, S, is_causal, window, alignment), scores.shape)
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


def _sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Adjoint of broadcasting: sum ``grad`` down to ``shape``.

    Leading axes that ``shape`` lacks are summed away; axes where ``shape`` has size 1 but
    ``grad`` does not are summed with ``keepdims``.
    """
    extra = grad.ndim - len(shape)
    if extra < 0:
        raise ValueError(f"cannot reduce gradient of shape {grad.shape} to {shape}")
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(
        ax for ax, (g, s) in enumerate(zip(grad.shape, shape, strict=True)) if s == 1 and g != 1
    )
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    if grad.shape != tuple(shape):
        raise ValueError(f"cannot reduce gradient of shape {grad.shape} to {shape}")
    return grad


def _unrepeat_heads(grad: np.ndarray, group: int) -> np.ndarray:
    """Adjoint of ``np.repeat(x, group, axis=-3)``: sum each group of ``group`` heads."""
    if group == 1:
        return grad
    *batch, h, s, e = grad.shape
    return grad.reshape(*batch, h // group, group, s, e).sum(axis=-3)


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    /,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    scale: float | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    return_weights: bool = False,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Reference scaled dot-product attention, computed in float64 NumPy.

    Parameters
    ----------
    query : array_like
        Shape ``(..., Hq, L, E)`` or ``(..., L, E)``; any supported array library.
    key : array_like
        Shape ``(..., Hkv, S, E)`` or ``(..., S, E)``.
    value : array_like
        Shape ``(..., Hkv, S, Ev)`` or ``(..., S, Ev)``.
    mask : array_like of bool, optional
        ``True`` where a query may attend a key; broadcastable to ``(..., Hq, L, S)``.
    bias : array_like, optional
        Additive scores, broadcastable to ``(..., Hq, L, S)``; ``-inf`` excludes a key.
    is_causal : bool, default False
        Query ``i`` may attend key ``j`` only if ``j <= diag(i)``.
    window : tuple of (int or None, int or None), optional
        ``(left, right)``: query ``i`` may attend key ``j`` only if
        ``diag(i) - left <= j <= diag(i) + right``; ``None`` leaves that side unbounded.
    alignment : {"top_left", "bottom_right"}, default "top_left"
        ``diag(i)`` is ``i`` for ``"top_left"`` and ``i + S - L`` for ``"bottom_right"``.
    scale : float, optional
        Multiplier of ``Q Kᵀ``; defaults to ``1 / sqrt(E)``.
    softcap : float, optional
        If given (> 0), scaled scores become ``softcap * tanh(scores / softcap)`` before
        ``bias`` and the masks apply.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` must be a multiple of ``Hkv`` and query head ``h``
        uses key/value head ``h // (Hq // Hkv)``.
    return_weights : bool, default False
        Also return the attention weights, shape ``(..., Hq, L, S)``.
    return_lse : bool, default False
        Also return the log-sum-exp of the final scores, shape ``(..., Hq, L)``.

    Returns
    -------
    out : numpy.ndarray
        float64, shape ``(..., Hq, L, Ev)``.
    weights : numpy.ndarray
        Only if ``return_weights``.
    lse : numpy.ndarray
        Only if ``return_lse``; ``-inf`` for rows with no admissible key.

    Raises
    ------
    ValueError
        For inconsistent shapes, an unknown ``alignment``, a non-positive ``softcap`` or a
        malformed ``window``.
    TypeError
        If ``mask`` is not boolean.

    See Also
    --------
    scaled_dot_product_attention_vjp : gradients of this function.

    Notes
    -----
    A query row with no admissible key (all excluded, or ``S == 0``) gives an output row of
    zeros, weights of zeros and ``lse = -inf``; no NaN is produced and no floating-point
    warning is raised.

    Examples
    --------
    >>> import numpy as np
    >>> q = k = np.eye(2)
    >>> v = np.array([[1.0], [2.0]])
    >>> scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    array([1.])
    """
    prep = _validate_and_prepare(
        query, key, value, mask, bias, window, alignment, scale, softcap, enable_gqa
    )
    fwd = _forward(prep, is_causal, window, alignment, softcap)
    if not (return_weights or return_lse):
        return fwd["out"]
    result = [fwd["out"]]
    if return_weights:
        result.append(fwd["weights"])
    if return_lse:
        result.append(fwd["lse"])
    return tuple(result)


def scaled_dot_product_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    /,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    scale: float | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
) -> tuple[np.ndarray, ...]:
    """Reference vector-Jacobian product of :func:`scaled_dot_product_attention`.

    Parameters
    ----------
    query, key, value : array_like
        As in :func:`scaled_dot_product_attention`.
    grad_output : array_like
        Cotangent ``dO`` of the output, same shape as the output ``(..., Hq, L, Ev)``.
    mask, bias, is_causal, window, alignment, scale, softcap, enable_gqa
        As in :func:`scaled_dot_product_attention`.

    Returns
    -------
    grad_query : numpy.ndarray
        float64, same shape as ``query``.
    grad_key : numpy.ndarray
        float64, same shape as ``key`` (summed over each group of query heads with GQA).
    grad_value : numpy.ndarray
        float64, same shape as ``value``.
    grad_bias : numpy.ndarray
        Only if ``bias`` is given: float64, same shape as ``bias`` (summed over the axes
        along which ``bias`` was broadcast).

    Notes
    -----
    With ``P = softmax(Z)`` row-wise:

    * ``dV = Pᵀ dO`` and ``dP = dO Vᵀ``;
    * for each query row, ``dZ_row = J dP_row`` with the softmax Jacobian
      ``J = diag(p) - p pᵀ`` (formed explicitly, shape ``(..., L, S, S)``); excluded keys
      and rows without an admissible key get zero;
    * ``dBias = dZ``; through the softcap the scaled scores get
      ``dZ * (1 - tanh²(raw / softcap))``;
    * ``dQ = scale * dRaw K`` and ``dK = scale * dRawᵀ Q``.

    Every gradient is then summed back to the shape of its own input (broadcast batch
    axes, GQA head groups, broadcast bias axes).

    Examples
    --------
    >>> import numpy as np
    >>> q, k, v = np.ones((1, 2)), np.ones((3, 2)), np.arange(3.0)[:, None]
    >>> dq, dk, dv = scaled_dot_product_attention_vjp(q, k, v, np.ones((1, 1)))
    >>> dv
    array([[0.33333333],
           [0.33333333],
           [0.33333333]])
    """
    prep = _validate_and_prepare(
        query, key, value, mask, bias, window, alignment, scale, softcap, enable_gqa
    )
    fwd = _forward(prep, is_causal, window, alignment, softcap)
    q, k_rep, v_rep = prep["q"], prep["k_rep"], prep["v_rep"]
    P = fwd["weights"]  # (..., Hq, L, S)
    S = P.shape[-1]

    d_out = _as_float64(grad_output)
    if d_out.shape != fwd["out"].shape:
        raise ValueError(
            f"grad_output has shape {d_out.shape}, expected the output's {fwd['out'].shape}"
        )

    # out = P @ V
    d_v_rep = np.matmul(np.swapaxes(P, -1, -2), d_out)  # (..., Hq, S, Ev)
    d_P = np.matmul(d_out, np.swapaxes(v_rep, -1, -2))  # (..., Hq, L, S)

    # Softmax Jacobian, one S x S matrix per query row: J[a, b] = p_a (delta_ab - p_b).
    eye = np.eye(S)
    J = P[..., :, None] * eye - P[..., :, None] * P[..., None, :]  # (..., Hq, L, S, S)
    d_Z = np.einsum("...ab,...b->...a", J, d_P)
    # Excluded keys have p = 0 so J already vanishes there; make it explicit (and exact).
    d_Z = np.where(fwd["allowed"], d_Z, 0.0)

    # Z = softcap(raw) + bias; softcap'(raw) = 1 - tanh²(raw / softcap).
    d_raw = d_Z
    if softcap is not None:
        d_raw = d_Z * (1.0 - np.tanh(fwd["raw"] / softcap) ** 2)

    # raw = scale * Q @ Kᵀ
    scale_ = prep["scale"]
    d_q = scale_ * np.matmul(d_raw, k_rep)  # (..., Hq, L, E)
    d_k_rep = scale_ * np.matmul(np.swapaxes(d_raw, -1, -2), q)  # (..., Hq, S, E)

    grads = [
        _sum_to_shape(d_q, prep["q"].shape),
        _sum_to_shape(_unrepeat_heads(d_k_rep, prep["group"]), prep["k"].shape),
        _sum_to_shape(_unrepeat_heads(d_v_rep, prep["group"]), prep["v"].shape),
    ]
    if prep["bias"] is not None:
        grads.append(_sum_to_shape(d_Z, prep["bias"].shape))
    return tuple(grads)
