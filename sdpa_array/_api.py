"""The public entry points, forward and VJP: validate, choose, run, finish.

Both read the same way: :func:`~sdpa_array._problem.validate` checks every argument into a
:class:`~sdpa_array._problem.Problem` before any array work;
:func:`~sdpa_array._dispatch.choose` picks the implementation from the one table;
the kernel runs (the forward through :mod:`sdpa_array._autograd`, which wraps it for torch
and JAX autodiff where needed); :mod:`sdpa_array._result` casts and packs the result.
"""

from __future__ import annotations

from typing import Literal, overload

from . import _autograd
from ._compat import array_namespace
from ._dispatch import choose
from ._kernels.native import Request
from ._problem import Inputs, Problem, check_flag, validate
from ._result import empty_result, finalize, finish_gradients, zero_gradients
from ._typing import Alignment, Array, ImplementationName, VJPImplementationName

__all__ = ["scaled_dot_product_attention", "scaled_dot_product_attention_vjp"]


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    mask: Array | None = ...,
    bias: Array | None = ...,
    is_causal: bool = ...,
    window: tuple[int | None, int | None] | None = ...,
    alignment: Alignment = ...,
    scale: float | Array | None = ...,
    softcap: float | None = ...,
    enable_gqa: bool = ...,
    query_lengths: int | Array | None = ...,
    key_lengths: int | Array | None = ...,
    segment_ids: tuple[Array, Array] | None = ...,
    sinks: Array | None = ...,
    dropout_p: float = ...,
    dropout_seed: int | None = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    implementation: ImplementationName = ...,
    block_q: int | None = ...,
    block_k: int | None = ...,
) -> Array: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    mask: Array | None = ...,
    bias: Array | None = ...,
    is_causal: bool = ...,
    window: tuple[int | None, int | None] | None = ...,
    alignment: Alignment = ...,
    scale: float | Array | None = ...,
    softcap: float | None = ...,
    enable_gqa: bool = ...,
    query_lengths: int | Array | None = ...,
    key_lengths: int | Array | None = ...,
    segment_ids: tuple[Array, Array] | None = ...,
    sinks: Array | None = ...,
    dropout_p: float = ...,
    dropout_seed: int | None = ...,
    return_weights: Literal[True],
    return_lse: Literal[False] = ...,
    implementation: ImplementationName = ...,
    block_q: int | None = ...,
    block_k: int | None = ...,
) -> tuple[Array, Array]: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    mask: Array | None = ...,
    bias: Array | None = ...,
    is_causal: bool = ...,
    window: tuple[int | None, int | None] | None = ...,
    alignment: Alignment = ...,
    scale: float | Array | None = ...,
    softcap: float | None = ...,
    enable_gqa: bool = ...,
    query_lengths: int | Array | None = ...,
    key_lengths: int | Array | None = ...,
    segment_ids: tuple[Array, Array] | None = ...,
    sinks: Array | None = ...,
    dropout_p: float = ...,
    dropout_seed: int | None = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    implementation: ImplementationName = ...,
    block_q: int | None = ...,
    block_k: int | None = ...,
) -> tuple[Array, Array]: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    mask: Array | None = ...,
    bias: Array | None = ...,
    is_causal: bool = ...,
    window: tuple[int | None, int | None] | None = ...,
    alignment: Alignment = ...,
    scale: float | Array | None = ...,
    softcap: float | None = ...,
    enable_gqa: bool = ...,
    query_lengths: int | Array | None = ...,
    key_lengths: int | Array | None = ...,
    segment_ids: tuple[Array, Array] | None = ...,
    sinks: Array | None = ...,
    dropout_p: float = ...,
    dropout_seed: int | None = ...,
    return_weights: Literal[True],
    return_lse: Literal[True],
    implementation: ImplementationName = ...,
    block_q: int | None = ...,
    block_k: int | None = ...,
) -> tuple[Array, Array, Array]: ...


def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
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
    segment_ids: tuple[Array, Array] | None = None,
    sinks: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    implementation: ImplementationName = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
) -> Array | tuple[Array, ...]:
    r"""Scaled dot-product attention on any Array-API array library.

    Computes ``softmax(softcap(Q Kᵀ · scale) + bias, masked) · V`` row by row, in at least
    float32, and returns an array of the inputs' library, dtype and device.

    Parameters
    ----------
    query : array, shape (..., Hq, L, E) or (..., L, E)
        Queries. Leading axes broadcast against those of ``key`` and ``value``.
    key : array, shape (..., Hkv, S, E) or (..., S, E)
        Keys; same dtype and library as ``query``.
    value : array, shape (..., Hkv, S, Ev) or (..., S, Ev)
        Values; ``Ev`` may differ from ``E``.
    mask : boolean array, optional
        Broadcastable to ``(..., Hq, L, S)``. ``True`` means the query **may attend** to the
        key (the polarity of torch, JAX and ONNX).
    bias : floating array, optional
        Added to the scores; broadcastable to ``(..., Hq, L, S)``. ``-inf`` excludes a key.
        May be combined with ``mask``.
    is_causal : bool, default False
        Query ``i`` may attend key ``j`` only if ``j`` is at or before its diagonal.
    window : (int or None, int or None), optional
        ``(left, right)``: query ``i`` may attend only keys ``diag(i) - left ... diag(i) +
        right``; ``None`` leaves a side unbounded. Combines with every other restriction.
    alignment : {"top_left", "bottom_right"}, default "top_left"
        Where query ``i``'s diagonal sits when ``L != S``: key ``i`` (torch and JAX
        ``is_causal``) or key ``i + S - L`` (FlashAttention, KV-cache decoding).
    scale : float or 0-d array, optional
        Positive finite multiplier of ``Q Kᵀ``; default ``1 / sqrt(E)``. A real number
        (Python or NumPy scalar), or a floating 0-d array of the inputs' library: then
        gradients reach it (a learnable temperature under torch autograd or ``jax.grad``)
        and :func:`scaled_dot_product_attention_vjp` returns ``grad_scale``. An array's
        value is checked where it can be read; on lazy Dask arrays and JAX tracers it is
        not, and a value that is not positive and finite is used as given.
    softcap : float, optional
        If given (> 0), scaled scores become ``softcap * tanh(scores / softcap)`` before the
        bias and the masks are applied.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` must be a multiple of ``Hkv`` and query head ``h``
        uses key/value head ``h // (Hq // Hkv)``.
    query_lengths, key_lengths : int or integer array, optional
        Valid queries and keys per sequence, broadcastable to the batch shape without the
        heads axis (the axes before axis -3; a scalar applies to every sequence): an int, a
        NumPy array, or an array of the inputs' library. Query ``i >= query_lengths[b]``
        is padding (its output row is zero, its log-sum-exp ``-inf``, and it contributes
        nothing to any gradient); key ``j >= key_lengths[b]`` is excluded for every query
        of sequence ``b``. With ``alignment="bottom_right"``, query ``i``'s diagonal is key
        ``i + key_lengths[b] - query_lengths[b]`` (FlashAttention's varlen and KV-cache
        rule). Values outside ``[0, L]`` / ``[0, S]`` are a ``ValueError`` where they can
        be read; on lazy Dask arrays and JAX tracers they are clipped instead. Where the
        values are on the host (ints, NumPy, CPU arrays) the blocked path skips the tiles
        they exclude.
    segment_ids : (array, array), optional
        ``(query_segments, key_segments)``: integer arrays broadcastable to
        ``batch + (L,)`` and ``batch + (S,)`` (``batch`` without the heads axis). Query
        ``i`` may attend key ``j`` only if their ids are equal (several documents packed
        into one row); combines with every other restriction. Host-readable ids let the
        blocked path skip the tiles between documents.
    sinks : floating array, optional
        One logit per query head, broadcastable to ``(..., Hq)`` (gpt-oss): each row's
        softmax gets a term whose value is zero, ``p_j = exp(z_j) / (exp(sink) + sum_k
        exp(z_k))``, so the weights sum to less than 1. Not scaled, soft-capped or masked;
        the log-sum-exp includes it, and a row with no admissible key has zero output and
        log-sum-exp ``sink``. Differentiable.
    dropout_p : float, default 0.0
        Drop each weight with this probability (in ``[0, 1)``) and divide the kept ones by
        ``1 - dropout_p``; the log-sum-exp is unaffected.
    dropout_seed : int, optional
        Required when ``dropout_p > 0``: the keep mask is :func:`dropout_keep_mask` of this
        seed, the same bits on every library, device, dtype and implementation.
    return_weights : bool, default False
        Also return the attention weights ``(..., Hq, L, S)`` (after dropout).
    return_lse : bool, default False
        Also return the log-sum-exp of the final scores ``(..., Hq, L)`` (in the compute
        dtype: float32 for float16/bfloat16 inputs).
    implementation : {"auto", "materialized", "blocked", "native", "dask"}, default "auto"
        Which implementation runs; all give the same results within rounding.

        * ``"materialized"`` forms the full ``(..., L, S)`` score matrix: the simplest path,
          and the fastest for small calls.
        * ``"blocked"`` visits keys in blocks with an online softmax (FlashAttention-style),
          and queries in blocks, so its extra memory is ``O(block_q * block_k)`` per batch
          element; key blocks that causal or window restrictions exclude are skipped. With
          ``return_weights`` it falls back to the materialized path (the weights are the
          score matrix).
        * ``"native"`` hands the call to the library's own fused kernel
          (``torch.nn.functional.scaled_dot_product_attention``, torch's CPU
          flash-attention kernel when the log-sum-exp is wanted, or
          ``jax.nn.dot_product_attention``) where that computes it exactly, and raises
          :class:`~sdpa_array.CannotDelegateError` (a ``ValueError``) naming the
          reason otherwise (e.g. ``softcap``, NumPy arrays).
        * ``"dask"`` builds a Dask graph of (query chunk, key chunk) tasks merged by
          a tree of :func:`merge_attention_states` (Dask inputs; see the distributed
          page of the docs).
        * ``"auto"``: the materialized path when ``return_weights`` is asked; the Dask
          graph for Dask arrays; otherwise native when it applies, unless the score
          matrix would be large (over the library's threshold in the dispatch table:
          1 MiB on NumPy and torch, 8 MiB on JAX, 256 MiB on array-api-strict) and the
          kernel would form it or need a positional mask built for it; otherwise
          blocked when the score matrix would be large, materialized when not. Giving
          ``block_q``/``block_k`` selects blocked.
    block_q, block_k : int, optional
        Query and key block sizes of the blocked implementation. By default they are
        chosen from the shapes and dtype so that one score tile is about 1 MiB (key blocks
        up to 1024, the query block filling the rest).

    Returns
    -------
    out : array, shape (..., Hq, L, Ev)
        The attention output, same dtype, library and device as ``query``.
    weights : array, shape (..., Hq, L, S)
        Only if ``return_weights``.
    lse : array, shape (..., Hq, L)
        Only if ``return_lse``.

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating or mismatched dtypes, a non-boolean
        ``mask``, a non-floating ``bias``.
    ValueError
        Shapes that do not fit together, out-of-range ``scale``, ``softcap``, ``window`` or
        ``dropout_p`` (or no ``dropout_seed`` for it),
        unknown ``alignment`` or ``implementation``, block sizes that are not positive
        ints or are given to an implementation other than blocked.
    CannotDelegateError
        ``implementation="native"`` for a call no native kernel computes exactly (a
        subclass of ``ValueError``).

    Notes
    -----
    A query with no admissible key (all excluded, or ``S == 0``) gets an output row of
    zeros, weights of zeros and a log-sum-exp of ``-inf``, never NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention
    >>> q = np.array([[1.0, 2.0], [3.0, 4.0]])
    >>> k = np.array([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])
    >>> v = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    >>> scaled_dot_product_attention(q, k, v).round(3)
    array([[0.986, 1.   , 0.   ],
           [1.   , 1.   , 0.   ]])
    """
    p = validate(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        window=window,
        alignment=alignment,
        scale=scale,
        softcap=softcap,
        enable_gqa=enable_gqa,
        query_lengths=query_lengths,
        key_lengths=key_lengths,
        segment_ids=segment_ids,
        sinks=sinks,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    check_flag("return_weights", return_weights)
    check_flag("return_lse", return_lse)
    x = Inputs(query, key, value, mask, bias, p.scale if p.scale_is_array else None, sinks)
    request = Request(x, return_weights, return_lse)
    choice = choose(p, implementation, (block_q, block_k), request=request)
    if p.S == 0 or p.L == 0:
        result = empty_result(p)
    else:
        result = _autograd.forward(
            choice, p, x, return_weights=return_weights, return_lse=return_lse
        )
    return finalize(p, result, return_weights=return_weights, return_lse=return_lse)


def _check_grad_output(p: Problem, query: Array, grad_output: Array) -> None:
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
    if tuple(grad_output.shape) != p.out_shape:
        raise ValueError(
            f"grad_output has shape {tuple(grad_output.shape)}; it must have the output's "
            f"shape (..., Hq, L, Ev) = {p.out_shape}"
        )


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
    segment_ids: tuple[Array, Array] | None = None,
    sinks: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    implementation: VJPImplementationName = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Array, ...]:
    r"""Gradients of :func:`scaled_dot_product_attention` for an output cotangent.

    Returns ``(dL/dQ, dL/dK, dL/dV[, dL/dBias][, dL/dSinks][, dL/dscale])`` for
    ``L = sum(out * grad_output)``: the vector-Jacobian product, on any Array-API library,
    including those without autograd (NumPy, CuPy, array-api-strict, Dask).

    Parameters
    ----------
    query, key, value : array
        As for :func:`scaled_dot_product_attention`.
    grad_output : array, shape (..., Hq, L, Ev)
        Cotangent of the output: exactly the output's shape, same library and dtype.
    mask, bias, is_causal, window, alignment, scale, softcap, enable_gqa, sinks
        As for :func:`scaled_dot_product_attention`; ``mask`` has no gradient.
    dropout_p, dropout_seed
        As for the forward: the same seed regenerates the same keep mask.
    query_lengths, key_lengths, segment_ids
        As for :func:`scaled_dot_product_attention`; they have no gradient, and padded
        queries and excluded keys get gradients of exactly zero.
    implementation : {"auto", "materialized", "blocked", "dask"}, default "auto"
        ``"materialized"`` forms the full score matrix once; ``"blocked"`` works tile by
        tile in ``O(block_q * block_k)`` memory per batch element, skipping the tiles that
        causal or window restrictions exclude; ``"dask"`` builds the matching Dask graph.
        ``"auto"`` chooses as the forward does: the Dask graph for Dask arrays, blocked
        when block sizes are given or the score matrix would be large.
    block_q, block_k : int, optional
        Block sizes of the blocked implementation (chosen from the shapes by default).

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

    Raises
    ------
    TypeError
        As for the forward; also a ``grad_output`` that is not an array of the same
        library, or whose dtype is not the output's.
    ValueError
        As for the forward; also a ``grad_output`` whose shape is not the output's, an
        unknown ``implementation``, or block sizes for the materialized implementation.

    Notes
    -----
    With ``Z`` the final scores, ``P = softmax(Z)`` and the softmax Jacobian
    ``dp_j/dz_k = p_j (delta_jk - p_k)``:

    .. math::

        dV = P^T dO, \quad dP = dO\, V^T, \quad D_i = \sum_j P_{ij} dP_{ij}
        = (dO \odot O)_i \mathbf{1}, \quad dZ = P \odot (dP - D),

    ``dBias = dZ``, and with ``dS = dZ`` (times ``1 - tanh²`` under a soft-cap),
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
    """
    p = validate(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        window=window,
        alignment=alignment,
        scale=scale,
        softcap=softcap,
        enable_gqa=enable_gqa,
        query_lengths=query_lengths,
        key_lengths=key_lengths,
        segment_ids=segment_ids,
        sinks=sinks,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    _check_grad_output(p, query, grad_output)
    choice = choose(p, implementation, (block_q, block_k))
    x = Inputs(query, key, value, mask, bias, p.scale if p.scale_is_array else None, sinks)
    if p.L == 0 or p.S == 0:  # nothing reaches the output: every gradient is zero
        return zero_gradients(p, x)
    return finish_gradients(p, x, choice.backward(p, x, grad_output))
