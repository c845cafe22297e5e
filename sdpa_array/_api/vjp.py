"""The public VJP entry point: validate, choose, run the backward kernel, finish.

It reads like the forward (:mod:`sdpa_array._api.forward`):
:func:`~sdpa_array._problem.problem.validate` checks every argument before any array work,
:func:`~sdpa_array._plan.dispatch.choose` picks the backward implementation from the same
table, and :mod:`sdpa_array._kernels.result` casts and sums the gradients back to the
inputs' shapes.
"""

from __future__ import annotations

import dataclasses

from .._arrays.compat import array_namespace
from .._arrays.typing import (
    Alignment,
    Array,
    BiasMod,
    Layout,
    MaskMod,
    PaddingSide,
    ScoreMod,
    VJPImplementationName,
)
from .._plan.run import run_vjp
from .._problem.mod_parameters import check_mod_gradients
from .._problem.peer_keywords import names_peer_spellings
from .._problem.problem import Problem, validate
from .._problem.scalar_options import check_flag
from .call import Call
from .jax_eager import eager_jax, run_jitted
from .layout import swap_heads_and_length

__all__ = [
    "check_cotangent",
    "check_grad_output",
    "check_saved_forward",
    "scaled_dot_product_attention_vjp",
]


def check_grad_output(p: Problem, query: Array, grad_output: Array) -> None:
    """Raise unless ``grad_output`` is an array of the inputs' library with the output's
    dtype and shape ``p.out_shape``."""
    check_cotangent(query, grad_output, p.out_shape, "(..., Hq, L, Ev)")


def check_cotangent(
    query: Array, grad_output: Array, shape: tuple[int, ...], named: str = "(total_q, Hq, Ev)"
) -> None:
    """Raise unless ``grad_output`` is an array of ``query``'s library with its dtype and
    the output's ``shape`` (``named``: that shape's axes, for the message)."""
    if grad_output is None:
        raise TypeError(
            "grad_output must be an array of the inputs' library "
            f"({type(query).__module__}.{type(query).__qualname__}), got None"
        )
    try:
        array_namespace({"query": query, "grad_output": grad_output})
    except TypeError:
        kind = f"{type(grad_output).__module__}.{type(grad_output).__qualname__}"
        raise TypeError(
            "grad_output must be an array of the inputs' library "
            f"({type(query).__module__}.{type(query).__qualname__}), got {kind}"
        ) from None
    if grad_output.dtype != query.dtype:
        raise TypeError(
            f"grad_output must have the output's dtype {query.dtype}, got {grad_output.dtype}"
        )
    if tuple(grad_output.shape) != shape:
        raise ValueError(
            f"grad_output has shape {tuple(grad_output.shape)}; it must have the output's "
            f"shape {named} = {shape}"
        )


def check_saved_forward(p: Problem, query: Array, out: Array, lse: Array) -> None:
    """Raise unless ``out`` and ``lse`` are both ``None`` or both arrays of ``query``'s
    library: ``out`` with the output's dtype and shape ``p.out_shape``, ``lse`` a real
    floating array of shape ``p.out_shape[:-1]`` (what the forward returns with
    ``return_lse=True``)."""
    if out is None and lse is None:
        return
    if out is None or lse is None:
        given, missing = ("out", "lse") if lse is None else ("lse", "out")
        raise ValueError(
            f"{given} was given without {missing}: pass both the forward's output and its "
            "log-sum-exp (return_lse=True), or neither"
        )
    kind = f"{type(query).__module__}.{type(query).__qualname__}"
    for name, x in (("out", out), ("lse", lse)):
        try:
            array_namespace({"query": query, name: x})
        except TypeError:
            got = f"{type(x).__module__}.{type(x).__qualname__}"
            raise TypeError(
                f"{name} must be an array of the inputs' library ({kind}), got {got}"
            ) from None
    if out.dtype != query.dtype:
        raise TypeError(f"out must have the output's dtype {query.dtype}, got {out.dtype}")
    if not p.xp.isdtype(lse.dtype, "real floating"):
        raise TypeError(f"lse must be a real floating array, got dtype {lse.dtype}")
    rows = p.out_shape[:-1]
    for name, x, shape, named in (
        ("out", out, p.out_shape, "(..., Hq, L, Ev)"),
        ("lse", lse, rows, "(..., Hq, L)"),
    ):
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; the forward's {name} of this call has "
                f"shape {named} = {shape}"
            )


@names_peer_spellings
def scaled_dot_product_attention_vjp(
    query: Array,
    key: Array,
    value: Array,
    grad_output: Array,
    /,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: Alignment = "top_left",
    scale: float | Array | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    query_lengths: int | Array | None = None,
    key_lengths: int | Array | None = None,
    padding_side: PaddingSide = "right",
    segment_ids: tuple[Array, Array] | None = None,
    sinks: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Array | None = None,
    mask_mod: MaskMod | None = None,
    bias_mod: BiasMod | None = None,
    score_mod: ScoreMod | None = None,
    return_mod_gradients: bool = False,
    implementation: VJPImplementationName = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    layout: Layout = "BHLE",
    out: Array | None = None,
    lse: Array | None = None,
) -> tuple[Array, ...]:
    r"""Gradients of :func:`scaled_dot_product_attention` for an output cotangent.

    Returns ``(dL/dQ, dL/dK, dL/dV[, dL/dBias][, dL/dSinks][, dL/dscale][, dL/dparameters])``
    for ``L = sum(out * grad_output)``: the vector-Jacobian product, on any Array-API library,
    including those without autograd (NumPy, CuPy, array-api-strict, Dask).

    Parameters
    ----------
    query, key, value : array
        As for :func:`scaled_dot_product_attention`.
    grad_output : array, shape (..., Hq, L, Ev)
        Cotangent of the output: exactly the output's shape, same library and dtype.
    mask, bias, is_causal, window, alignment, scale, softcap, enable_gqa
        As for :func:`scaled_dot_product_attention`; ``mask`` has no gradient.
    query_lengths, key_lengths, padding_side, segment_ids
        As for :func:`scaled_dot_product_attention`; they have no gradient, and padded
        queries and excluded keys get gradients of exactly zero.
    sinks
        As for :func:`scaled_dot_product_attention`; its gradient is returned.
    dropout_p, dropout_seed
        As for the forward: the same seed regenerates the same keep mask.
    mask_mod, bias_mod
        As for :func:`scaled_dot_product_attention`; ``bias_mod``'s parameters get
        gradients with ``return_mod_gradients``.
    score_mod
        As for :func:`scaled_dot_product_attention`: the gradients pass through its
        derivative (its ``derivative`` method, or torch's or JAX's autodiff).
    return_mod_gradients : bool, default False
        Also return the gradients of the trainable parameters of ``score_mod`` (the
        temperatures of :func:`sdpa_array.mods.temperature`) and of ``bias_mod`` (ALiBi's
        slopes of :func:`sdpa_array.mods.alibi`, the table of
        :func:`sdpa_array.mods.relative_position_bias`), or of a function of yours with
        ``parameters`` and ``parameter_cotangents`` (see :mod:`sdpa_array.mods`), last.
    implementation : {"auto", "materialized", "blocked", "native", "triton", "dask"}
        Default ``"auto"``. ``"materialized"`` forms the full score matrix once;
        ``"blocked"`` works tile by tile in ``O(block_q * block_k)`` memory per batch
        element, skipping the tiles that causal or window restrictions exclude;
        ``"native"`` differentiates the library's own fused kernel (torch autograd,
        ``jax.vjp``; the forward call is recomputed); ``"triton"`` runs our fused Triton
        backward kernels (CuPy and torch on a GPU); ``"dask"`` builds the matching Dask
        graph. ``"auto"`` chooses as the forward does: the Dask graph for Dask arrays, on a
        GPU the native backward where torch's kernels compute the call exactly, else the
        Triton kernels, blocked when block sizes are given or the score matrix would be
        large.
    block_q, block_k : int, optional
        Block sizes of the blocked implementation (chosen from the shapes by default).
    layout : {"BHLE", "BLHE"}, default "BHLE"
        As for :func:`scaled_dot_product_attention`: with ``"BLHE"``, ``query``, ``key``,
        ``value``, ``grad_output`` and their gradients are ``(..., L, H, E)``.
    out, lse : array, optional
        The forward's output and log-sum-exp for the same arguments (both or neither):
        ``scaled_dot_product_attention(..., return_lse=True)``, shapes ``(..., Hq, L, Ev)``
        (``(..., L, Hq, Ev)`` with ``"BLHE"``) and ``(..., Hq, L)``. Given them, the
        backward takes the probabilities as ``P = exp(Z - lse)`` and
        ``D = rowsum(grad_output * out)`` instead of running the forward pass again (the
        blocked, materialized, Triton and Dask backward kernels; ``"native"`` differentiates
        the library's own kernel, which computes its forward anew).

    Returns
    -------
    grad_query : array
        Same shape, dtype, library and device as ``query``.
    grad_key, grad_value : array
        Same as ``key`` and ``value``; with ``enable_gqa`` summed over each group of query
        heads, and with broadcast batch axes summed back to the input's own shape.
    grad_bias : array
        Only if ``bias`` is given: same shape and dtype as ``bias``, summed over the axes
        along which it was broadcast.
    grad_sinks : array
        Only if ``sinks`` is given (after ``grad_bias``, before ``grad_scale``): the shape
        and dtype of ``sinks``, ``-sum_i p_sink_i (dO_i · O_i)`` over the rows it reaches.
    grad_scale : array
        Only if ``scale`` is an array: 0-d, with the dtype of ``scale``.
    grad_mod_parameters : array
        Only with ``return_mod_gradients=True``, last: one gradient for each of the
        ``parameters`` of ``score_mod``, then of ``bias_mod``, of its shape and dtype.

    Raises
    ------
    TypeError
        As for the forward; also a ``grad_output`` that is not an array of the same
        library, or whose dtype is not the output's, a ``score_mod`` without a
        ``derivative`` method on a library without autodiff, and
        ``return_mod_gradients=True`` without a ``score_mod`` or ``bias_mod`` with
        parameters, or with parameters that are not floating arrays of the inputs' library.
    ValueError
        As for the forward; also a ``grad_output`` whose shape is not the output's, an
        unknown ``implementation``, block sizes for the materialized implementation, only
        one of ``out`` and ``lse``, or either of them not of the forward's shape.

    Notes
    -----
    With ``Z`` the final scores, ``P = softmax(Z)`` and the softmax Jacobian
    ``dp_j/dz_k = p_j (delta_jk - p_k)``:

    .. math::

        dV = P^T dO, \quad dP = dO\, V^T, \quad D_i = \sum_j P_{ij} dP_{ij}
        = (dO \odot O)_i \mathbf{1}, \quad dZ = P \odot (dP - D),

    ``dBias = dZ``, and with ``dS = dZ`` (times ``1 - tanh²`` under a soft-cap, and the
    derivative of ``score_mod`` with one),
    ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q`` and, when ``scale`` is an array,
    ``dscale = Σ dS ⊙ (Q Kᵀ) = Σ Q ⊙ dQ / scale``. Everything runs in at least float32
    and is returned in the inputs' dtypes. Rows with no admissible key, and keys no query
    may attend, get gradients of exactly zero.

    The blocked implementation computes ``P`` tile by tile: from the tile's own softmax when
    a tile holds whole rows, otherwise as ``exp(Z - lse)`` from the blocked forward pass's
    log-sum-exp (FlashAttention-2). :mod:`sdpa_array.reference` has an independent float64
    version that forms the Jacobian explicitly.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention_vjp
    >>> q, k = np.ones((1, 2)), np.ones((3, 2))
    >>> v = np.arange(3.0)[:, None]
    >>> dq, dk, dv = scaled_dot_product_attention_vjp(q, k, v, np.ones((1, 1)))
    >>> dv.round(4)
    array([[0.3333],
           [0.3333],
           [0.3333]])

    With the forward's output and log-sum-exp at hand (a training step keeps them), the
    backward does not compute the forward again:

    >>> from sdpa_array import scaled_dot_product_attention
    >>> out, lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> grads = scaled_dot_product_attention_vjp(q, k, v, np.ones((1, 1)), out=out, lse=lse)
    >>> grads[2].round(4)
    array([[0.3333],
           [0.3333],
           [0.3333]])
    """
    arrays = ("query", "key", "value", "grad_output", "out")
    call = Call.gather(locals(), arrays, others=("return_mod_gradients", "out", "lse"))
    if call.layout == "BLHE":  # computed heads-first on views, the gradients swapped back
        views = swap_heads_and_length(query, key, value, grad_output, out)
        grads = scaled_dot_product_attention_vjp(*views[:4], **call.keywords(out=views[4]))
        return (*swap_heads_and_length(*grads[:3]), *grads[3:])
    p = validate(query, key, value, call.options)
    check_grad_output(p, query, grad_output)
    check_saved_forward(p, query, out, lse)
    check_flag("return_mod_gradients", return_mod_gradients)
    if return_mod_gradients:
        check_mod_gradients(p.xp, score_mod, bias_mod)
        p = dataclasses.replace(p, mod_gradients=True)
    if p.L and p.S and eager_jax([query, key, value, grad_output]):  # compiled whole
        arrays4 = (query, key, value, grad_output)
        done, result = run_jitted(scaled_dot_product_attention_vjp, arrays4, call.keywords())
        if done:
            return result  # type: ignore[no-any-return]
    if lse is not None:  # the kernels read it in the compute dtype
        lse = p.xp.astype(lse, p.compute_dtype, copy=False)
    planned = (call.options, call.implementation, call.blocks, p)
    return run_vjp(query, key, value, grad_output, *planned, out=out, lse=lse)
