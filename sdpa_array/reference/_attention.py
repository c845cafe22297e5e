"""The oracle's public forward functions: attention and its intermediates."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._forward import forward_pass, validate_and_prepare

__all__ = ["intermediates", "scaled_dot_product_attention"]


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
    prep = validate_and_prepare(
        query, key, value, mask, bias, window, alignment, scale, softcap, enable_gqa
    )
    fwd = forward_pass(prep, is_causal, window, alignment, softcap)
    if not (return_weights or return_lse):
        return fwd["out"]
    result = [fwd["out"]]
    if return_weights:
        result.append(fwd["weights"])
    if return_lse:
        result.append(fwd["lse"])
    return tuple(result)


def intermediates(
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
) -> dict[str, Any]:
    """Every intermediate of the oracle's forward pass, in float64, for error analysis.

    Takes the arguments of :func:`scaled_dot_product_attention` and returns a dict with
    ``q``, ``k_rep`` and ``v_rep`` (keys and values with one head per query head), ``group``
    (query heads per key/value head), the resolved ``scale``, ``raw`` (scaled scores before
    the soft-cap), ``z`` (final scores, ``-inf`` where excluded), ``allowed`` (boolean, the
    scores' shape), ``weights``, ``out`` and ``lse``. :mod:`sdpa_array.testing` derives the
    gradients' error bounds from them.
    """
    prep = validate_and_prepare(
        query, key, value, mask, bias, window, alignment, scale, softcap, enable_gqa
    )
    fwd = forward_pass(prep, is_causal, window, alignment, softcap)
    keep = ("q", "k_rep", "v_rep", "group", "scale")
    return {**{name: prep[name] for name in keep}, **fwd}
