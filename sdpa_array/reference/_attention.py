"""The oracle's public forward functions: attention and its intermediates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._forward import forward_pass, validate_and_prepare
from ._layout import heads_back, heads_first
from ._options import OracleOptions

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
    scale: Any = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    query_lengths: Any = None,
    key_lengths: Any = None,
    padding_side: str = "right",
    segment_ids: tuple[Any, Any] | None = None,
    sinks: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    bias_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_max_scores: bool = False,
    layout: str = "BHLE",
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
        ``diag(i)`` is ``i`` for ``"top_left"``. For ``"bottom_right"`` it is
        ``i + key_lengths[b] - query_lengths[b]`` in batch element ``b`` (``i + S - L``
        without lengths), so that the last valid query faces the last valid key.
    scale : float or 0-d array, optional
        Multiplier of ``Q Kᵀ``, positive and finite: a Python real, a NumPy scalar or a
        0-d array of any supported library (read as float64). Defaults to ``1 / sqrt(E)``.
    softcap : float, optional
        If given (> 0), scaled scores become ``softcap * tanh(scores / softcap)`` before
        ``bias`` and the masks apply.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` must be a multiple of ``Hkv`` and query head ``h``
        uses key/value head ``h // (Hq // Hkv)``.
    query_lengths : int or array_like of int, optional
        Valid queries per batch element, broadcastable to the batch shape (the broadcast
        leading axes before the heads axis; ``()`` for 2-D inputs), each in ``[0, L]``.
        Query ``i >= query_lengths[b]`` is padding: it attends nothing, so its output row
        is zero and its ``lse`` is ``-inf``.
    key_lengths : int or array_like of int, optional
        Valid keys per batch element, like ``query_lengths``, each in ``[0, S]``: key
        ``j >= key_lengths[b]`` is excluded for every query of batch element ``b``.
    padding_side : {"right", "left"}, default "right"
        ``"left"``: the padding comes first, the valid queries and keys are the last
        ``query_lengths[b]`` and ``key_lengths[b]``, and ``i`` and ``j`` above (the
        diagonal, the window) are the positions among them.
    segment_ids : pair of array_like of int, optional
        ``(query_segments, key_segments)``, broadcastable to ``batch + (L,)`` and
        ``batch + (S,)`` (no heads axis): query ``i`` may attend key ``j`` only if
        ``query_segments[b, i] == key_segments[b, j]`` (packed documents).
    sinks : array_like, optional
        One logit per query head, broadcastable to ``(..., Hq)``: each row's softmax gets
        the extra term ``exp(sinks[..., h])``, whose value is zero, so
        ``p_j = exp(z_j) / (exp(sink) + sum_k exp(z_k))``. ``lse`` includes it; a row with
        no admissible key has zero output and ``lse = sink``. Not scaled, capped or masked.
    dropout_p : float, default 0.0
        Probability of dropping each weight; kept weights are divided by ``1 - dropout_p``.
        The mask is :func:`sdpa_array.dropout_keep_mask` of ``dropout_seed``.
    dropout_seed : int or array, optional
        Required when ``dropout_p > 0``; a 0-d integer array counts by its value.
    mask_mod : callable, optional
        ``mask_mod(batch, head, q_idx, kv_idx)`` returns booleans, ``True`` where a query may
        attend a key, combined (logical and) with every other restriction. Called once with
        four integer arrays of the query's library and device that broadcast together to the
        scores' shape ``(*batch_shape, Hq, L, S)``: ``batch`` the row-major flattened index
        of the batch element, shape ``(*batch_shape, 1, 1, 1)`` (zeros without batch axes),
        ``head`` the query head, shape ``(Hq, 1, 1)``, ``q_idx`` shape ``(L, 1)`` and
        ``kv_idx`` shape ``(S,)``; for inputs without a heads axis ``batch`` and ``head``
        are 0-d zeros. The result must broadcast to the scores' shape.
    bias_mod : callable, optional
        ``bias_mod(batch, head, q_idx, kv_idx)`` returns real floating additive scores (read
        as float64), called like ``mask_mod`` and added where ``bias`` is (after
        ``softcap``, before the masks; with ``bias`` too, both are added); ``-inf``
        excludes a key.
    score_mod : callable, optional
        ``score_mod(score, batch, head, q_idx, kv_idx)`` returns the new scores: called once
        with the float64 NumPy scaled scores ``scale · q·k`` (shape ``(..., Hq, L, S)``)
        and NumPy index arrays shaped as for ``mask_mod``, before ``softcap``, ``bias`` and
        ``bias_mod``. Its ``derivative`` method, of the same arguments, is what the VJP
        multiplies by.
    return_weights : bool, default False
        Also return the attention weights (after dropout), shape ``(..., Hq, L, S)``.
    return_lse : bool, default False
        Also return the log-sum-exp of the final scores, shape ``(..., Hq, L)``.
    return_max_scores : bool, default False
        Also return, per batch element and query head (shape ``(..., Hq)``), the largest
        ``scale * q . k`` over the pairs that ``mask``, ``mask_mod``, causal, window,
        lengths and segments admit: before ``score_mod``, ``softcap``, ``bias`` and
        ``bias_mod`` (a
        ``-inf`` bias does not restrict it) and dropout; ``-inf`` where no pair is admitted.
    layout : {"BHLE", "BLHE"}, default "BHLE"
        ``"BLHE"``: ``query``, ``key``, ``value`` and the output are ``(..., L, H, E)``
        (the masks, bias, weights and log-sum-exp keep their shapes).

    Returns
    -------
    out : numpy.ndarray
        float64, shape ``(..., Hq, L, Ev)`` (``(..., L, Hq, Ev)`` with ``"BLHE"``).
    weights : numpy.ndarray
        Only if ``return_weights``.
    lse : numpy.ndarray
        Only if ``return_lse``; ``-inf`` for rows with no admissible key.
    max_scores : numpy.ndarray
        Only if ``return_max_scores``.

    Raises
    ------
    ValueError
        For inconsistent shapes, an unknown ``alignment``, a non-positive ``softcap``, a
        ``scale`` that is not positive and finite, a malformed ``window``, lengths outside
        ``[0, L]`` / ``[0, S]``, or lengths or segment ids that do not broadcast; if
        ``mask_mod`` or ``bias_mod`` raises (chained) or returns a shape that does not
        broadcast to the scores' shape.
    TypeError
        If ``mask`` is not boolean, ``scale`` is not a real number or 0-d array, lengths
        or segment ids are not integers, or ``segment_ids`` is not a pair; if ``mask_mod``
        or ``bias_mod`` is not callable, or returns a dtype other than boolean
        (``mask_mod``) or real floating (``bias_mod``).

    See Also
    --------
    scaled_dot_product_attention_vjp : gradients of this function.

    Notes
    -----
    A query row with no admissible key (all excluded, or ``S == 0``) gives an output row of
    zeros, weights of zeros and ``lse = -inf``; no NaN is produced and no floating-point
    warning is raised. Padded queries (``query_lengths``) are such rows.

    Causal, window, lengths and segments are one boolean matrix built from index
    arithmetic per batch element (see :mod:`sdpa_array.reference`).

    Examples
    --------
    >>> import numpy as np
    >>> q = k = np.eye(2)
    >>> v = np.array([[1.0], [2.0]])
    >>> scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    array([1.])

    Two documents packed in one sequence attend only within themselves:

    >>> q = k = np.zeros((3, 1))
    >>> v = np.array([[1.0], [3.0], [5.0]])
    >>> scaled_dot_product_attention(q, k, v, segment_ids=([0, 0, 1], [0, 0, 1]))
    array([[2.],
           [2.],
           [5.]])

    The same documents as a ``mask_mod``, written with the index arrays it receives:

    >>> doc = np.array([0, 0, 1])
    >>> scaled_dot_product_attention(q, k, v, mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    array([[2.],
           [2.],
           [5.]])
    """
    options = OracleOptions.gather(locals())
    query, key, value = heads_first(layout, query, key, value)
    prep = validate_and_prepare(query, key, value, options)
    fwd = forward_pass(prep, options)
    out = heads_back(layout, fwd["out"])
    if not (return_weights or return_lse or return_max_scores):
        return out
    result = [out]
    if return_weights:
        result.append(fwd["dropped"])
    if return_lse:
        result.append(fwd["lse"])
    if return_max_scores:
        result.append(fwd["max_scores"])
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
    scale: Any = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    query_lengths: Any = None,
    key_lengths: Any = None,
    padding_side: str = "right",
    segment_ids: tuple[Any, Any] | None = None,
    sinks: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    bias_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Every intermediate of the oracle's forward pass, in float64, for error analysis.

    Takes the arguments of :func:`scaled_dot_product_attention` (``scale`` as a number or a
    0-d array, ``query_lengths``, ``key_lengths``, ``segment_ids`` and the mods included)
    and returns a dict with ``q``, ``k_rep`` and ``v_rep`` (keys and values with one head
    per query head), ``group`` (query heads per key/value head), the resolved ``scale`` (a
    float), ``raw`` (scaled scores before ``score_mod``, the soft-cap, ``bias`` and
    ``bias_mod``), ``modded`` (``score_mod`` of ``raw``, or ``raw``), ``z`` (final
    scores, ``-inf`` where excluded), ``allowed`` (boolean, the scores' shape, every
    restriction included), ``weights``, ``out`` and ``lse``. :mod:`sdpa_array.testing`
    derives the gradients' error bounds from them.

    Returns
    -------
    dict
        The intermediates named above (and a few more of the forward pass), by name.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.reference import intermediates
    >>> q = np.array([[1.0, 0.0]])
    >>> k = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> v = np.array([[1.0], [0.0]])
    >>> steps = intermediates(q, k, v, scale=np.log(3.0))
    >>> steps["z"]
    array([[1.09861229, 0.        ]])
    >>> steps["weights"]
    array([[0.75, 0.25]])
    """
    options = OracleOptions.gather(locals())
    prep = validate_and_prepare(query, key, value, options)
    fwd = forward_pass(prep, options)
    keep = ("q", "k_rep", "v_rep", "group", "scale")
    return {**{name: prep[name] for name in keep}, **fwd}
