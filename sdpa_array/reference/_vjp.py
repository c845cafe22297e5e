"""The oracle's gradients, from the chain rule with the softmax Jacobian formed explicitly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._adjoints import sum_to_shape, unrepeat_heads
from ._convert import as_float64
from ._forward import forward_pass, score_derivative, validate_and_prepare
from ._layout import heads_back, heads_first
from ._mods import index_grids, parameter_gradients, score_parameter_gradients
from ._options import OracleOptions

__all__ = ["scaled_dot_product_attention_vjp"]


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
    return_mod_gradients: bool = False,
    layout: str = "BHLE",
) -> tuple[np.ndarray, ...]:
    """Reference vector-Jacobian product of :func:`scaled_dot_product_attention`.

    Parameters
    ----------
    query, key, value : array_like
        As in :func:`scaled_dot_product_attention`.
    grad_output : array_like
        Cotangent ``dO`` of the output, same shape as the output ``(..., Hq, L, Ev)``.
    mask, bias, is_causal, window, alignment
        As in :func:`scaled_dot_product_attention`.
    scale : float or 0-d array, optional
        As in :func:`scaled_dot_product_attention`. Given as an array (anything with a
        ``shape`` other than a NumPy scalar) it gets a gradient, ``grad_scale``.
    softcap, enable_gqa
        As in :func:`scaled_dot_product_attention`.
    query_lengths, key_lengths, padding_side, segment_ids
        As in :func:`scaled_dot_product_attention`. Padded queries and excluded keys get
        no gradient and pass none on.
    sinks : array_like, optional
        As in :func:`scaled_dot_product_attention`; given, they get a gradient,
        ``grad_sinks``.
    dropout_p : float, default 0.0
        As in :func:`scaled_dot_product_attention`: the gradients are those of the forward
        call with the same arguments, dropout mask included.
    dropout_seed : int or array, optional
        As in :func:`scaled_dot_product_attention`; required when ``dropout_p > 0``.
    mask_mod, bias_mod : callable, optional
        As in :func:`scaled_dot_product_attention`; keys they exclude pass no gradient on.
        ``bias_mod``'s parameters get gradients with ``return_mod_gradients``.
    score_mod : callable, optional
        As in :func:`scaled_dot_product_attention`; the score gradients are multiplied by
        its ``derivative`` method (a ``TypeError`` without one); its parameters get
        gradients with ``return_mod_gradients``.
    return_mod_gradients : bool, default False
        Also return the gradient of each of the ``parameters`` of ``score_mod`` and then
        ``bias_mod`` (those that declare any), last. The Jacobian of the bias in its
        parameters is formed column by column from the mod's ``with_parameters``, exactly
        for a mod affine in its parameters (ALiBi's slopes, T5's table), and contracted
        with ``dBias``; that of the score function is its ``parameter_derivatives``,
        contracted with the gradient of its values (``dZ`` through the soft-cap).
    layout : {"BHLE", "BLHE"}, default "BHLE"
        As in :func:`scaled_dot_product_attention`; with ``"BLHE"`` ``grad_output`` and
        the three gradients are ``(..., L, H, E)`` too.

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
    grad_sinks : numpy.ndarray
        Only if ``sinks`` is given: float64, same shape as ``sinks``.
    grad_scale : numpy.ndarray
        Only if ``scale`` is given as an array: a 0-d float64 array.
    grad_mod_parameters : numpy.ndarray
        Only with ``return_mod_gradients=True``: one float64 array of each of
        ``score_mod``'s, then ``bias_mod``'s, parameters' shape.

    Notes
    -----
    With ``P = softmax(Z)`` row-wise:

    * ``dV = Pᵀ dO`` and ``dP = dO Vᵀ``;
    * for each query row, ``dZ_row = J dP_row`` with the softmax Jacobian
      ``J = diag(p) - p pᵀ`` (formed explicitly, shape ``(..., L, S, S)``); excluded keys
      and rows without an admissible key get zero;
    * ``dBias = dZ`` (``bias_mod`` gets none); through the softcap the scores get
      ``dZ * (1 - tanh²(modded / softcap))``, and through ``score_mod`` the scaled scores
      ``raw`` that times ``score_mod.derivative(raw, ...)`` (a ``TypeError`` without one);
    * ``dQ = scale * dRaw K`` and ``dK = scale * dRawᵀ Q``;
    * ``dScale = sum(dRaw * (Q Kᵀ))`` over every batch entry, head, query and key (with
      GQA, ``Q`` against the repeated keys).

    * sinks: the softmax and its Jacobian run over ``S + 1`` columns, the last being the
      sink, whose ``dP`` is 0 (its value is zero); ``dSink`` is that column of ``dZ``;
    * dropout: with ``M = keep / (1 - p)``, ``out = (P * M) V``, so ``dV = (P * M)ᵀ dO``
      and ``dP = (dO Vᵀ) * M``.

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

    A ``scale`` given as a 0-d array has a gradient too; here the scores are all equal, so
    it is zero:

    >>> dq, dk, dv, dscale = scaled_dot_product_attention_vjp(
    ...     q, k, v, np.ones((1, 1)), scale=np.array(0.5)
    ... )
    >>> dscale
    array(0.)
    """
    options = OracleOptions.gather(locals())
    query, key, value, grad_output = heads_first(layout, query, key, value, grad_output)
    prep = validate_and_prepare(query, key, value, options)
    fwd = forward_pass(prep, options)
    q, k_rep, v_rep = prep["q"], prep["k_rep"], prep["v_rep"]
    P = fwd["weights_all"]  # (..., Hq, L, S [+ 1 sink column])
    S = fwd["weights"].shape[-1]
    n = P.shape[-1]

    d_out = as_float64(grad_output)
    if d_out.shape != fwd["out"].shape:
        raise ValueError(
            f"grad_output has shape {d_out.shape}, expected the output's {fwd['out'].shape}"
        )

    # out = P @ V
    d_v_rep = np.matmul(np.swapaxes(fwd["dropped"], -1, -2), d_out)  # (..., Hq, S, Ev)
    d_P = np.matmul(d_out, np.swapaxes(v_rep, -1, -2))  # (..., Hq, L, S)
    if fwd["keep"] is not None:
        d_P = d_P * fwd["keep"]
    if n > S:  # the sink column: its value is zero, so is its dP
        d_P = np.concatenate([d_P, np.zeros((*d_P.shape[:-1], n - S))], axis=-1)

    # Softmax Jacobian, one n x n matrix per query row: J[a, b] = p_a (delta_ab - p_b).
    eye = np.eye(n)
    J = P[..., :, None] * eye - P[..., :, None] * P[..., None, :]  # (..., Hq, L, n, n)
    d_Z_all = np.einsum("...ab,...b->...a", J, d_P)
    # Excluded keys have p = 0 so J already vanishes there; make it explicit (and exact).
    d_Z = np.where(fwd["allowed"], d_Z_all[..., :S], 0.0)

    # Z = softcap(score_mod(raw)) + bias; softcap'(m) = 1 - tanh²(m / softcap).
    d_modded = d_Z
    if softcap is not None:
        d_modded = d_Z * (1.0 - np.tanh(fwd["modded"] / softcap) ** 2)
    d_raw = d_modded
    if prep["score_mod"] is not None:
        d_raw = d_raw * score_derivative(prep, fwd["raw"])

    # raw = scale * Q @ Kᵀ
    scale_ = prep["scale"]
    d_q = scale_ * np.matmul(d_raw, k_rep)  # (..., Hq, L, E)
    d_k_rep = scale_ * np.matmul(np.swapaxes(d_raw, -1, -2), q)  # (..., Hq, S, E)

    grads = [
        heads_back(layout, sum_to_shape(d_q, prep["q"].shape)),
        heads_back(layout, sum_to_shape(unrepeat_heads(d_k_rep, prep["group"]), prep["k"].shape)),
        heads_back(layout, sum_to_shape(unrepeat_heads(d_v_rep, prep["group"]), prep["v"].shape)),
    ]
    if prep["bias"] is not None:
        grads.append(sum_to_shape(d_Z, prep["bias"].shape))
    if prep["sinks"] is not None:
        d_sink = np.sum(d_Z_all[..., S], axis=-1)  # (..., Hq): summed over the queries
        grads.append(sum_to_shape(d_sink, prep["sinks_shape"]))
    if prep["scale_is_array"]:
        # raw = scale * (Q @ Kᵀ): d scale = sum(dRaw * (Q @ Kᵀ)), over every entry.
        qk = np.matmul(q, np.swapaxes(k_rep, -1, -2))
        grads.append(np.asarray(np.sum(d_raw * qk), dtype=np.float64))
    if return_mod_gradients:
        trained = [m for m in (score_mod, bias_mod) if hasattr(m, "parameters")]
        if not trained:
            raise TypeError(
                "return_mod_gradients=True needs a score_mod or bias_mod with 'parameters'"
            )
        if hasattr(score_mod, "parameters"):
            grids = prep["score_grids"]
            grads.extend(score_parameter_gradients(score_mod, fwd["raw"], grids, d_modded))
        if hasattr(bias_mod, "parameters"):
            grids = index_grids(q, d_Z.shape[:-2], d_Z.shape[-2], S)
            grads.extend(parameter_gradients(bias_mod, grids, d_Z.shape, d_Z))
    return tuple(grads)
