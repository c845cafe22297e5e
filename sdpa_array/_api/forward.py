"""The public forward entry point: validate, choose, run, finish.

It reads the same way as the VJP's (:mod:`sdpa_array._api.vjp`):
:func:`~sdpa_array._problem.problem.validate` checks every argument into a
:class:`~sdpa_array._problem.problem.Problem` before any array work;
:func:`~sdpa_array._plan.dispatch.choose` picks the implementation from the one table;
the kernel runs (the forward through :mod:`sdpa_array._plan.autograd`, which wraps it for torch
and JAX autodiff where needed); :mod:`sdpa_array._kernels.result` casts and packs the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

from .._arrays.typing import (
    Alignment,
    Array,
    BiasMod,
    ImplementationName,
    Layout,
    MaskMod,
    PaddingSide,
    ScoreMod,
)
from .._plan.run import run_forward
from .._problem.peer_keywords import names_peer_spellings
from .._problem.problem import validate
from .call import Call, direct_call
from .jax_eager import eager_jax, run_jitted
from .layout import heads_first_forward

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .keywords import AttentionKeywords

__all__ = ["scaled_dot_product_attention"]


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    return_max_scores: Literal[False] = ...,
    **options: Unpack[AttentionKeywords],
) -> Array: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    return_weights: Literal[True],
    return_lse: Literal[False] = ...,
    return_max_scores: Literal[False] = ...,
    **options: Unpack[AttentionKeywords],
) -> tuple[Array, Array]: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    return_max_scores: Literal[False] = ...,
    **options: Unpack[AttentionKeywords],
) -> tuple[Array, Array]: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    return_weights: Literal[True],
    return_lse: Literal[True],
    return_max_scores: Literal[False] = ...,
    **options: Unpack[AttentionKeywords],
) -> tuple[Array, Array, Array]: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    return_weights: bool = ...,
    return_lse: bool = ...,
    return_max_scores: Literal[True],
    **options: Unpack[AttentionKeywords],
) -> tuple[Array, ...]: ...


@overload
def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    return_weights: bool = ...,
    return_lse: bool = ...,
    return_max_scores: bool = ...,
    **options: Unpack[AttentionKeywords],
) -> Array | tuple[Array, ...]: ...


@names_peer_spellings
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
    padding_side: PaddingSide = "right",
    segment_ids: tuple[Array, Array] | None = None,
    sinks: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Array | None = None,
    mask_mod: MaskMod | None = None,
    bias_mod: BiasMod | None = None,
    score_mod: ScoreMod | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_max_scores: bool = False,
    implementation: ImplementationName = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    layout: Layout = "BHLE",
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
    mask : array of bool, optional
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
    query_lengths, key_lengths : int or array of int, optional
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
    padding_side : {"right", "left"}, default "right"
        Where the lengths' padding sits. ``"left"`` (batched generation's padding): the
        valid tokens are the last ``query_lengths[b]`` queries and ``key_lengths[b]`` keys
        of each row, and causal and window positions count from each row's first valid
        token (query ``i``'s diagonal is key ``i + (S - key_lengths[b]) - (L -
        query_lengths[b])`` top left, ``i + S - L`` bottom right).
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
    dropout_seed : int or array, optional
        Required when ``dropout_p > 0``: the keep mask is :func:`dropout_keep_mask` of this
        seed, the same bits on every library, device, dtype and implementation. A 0-d
        integer array (of the inputs' library, or NumPy) gives the bits of its value: under
        ``jax.jit`` a traced seed (e.g. drawn from a ``jax.random`` key), in torch a 0-d
        tensor on the device, with no host read.
    mask_mod : callable or BlockMask, optional
        A mask function ``mask_mod(batch, head, q_idx, kv_idx) -> boolean array``
        (``True`` = may attend), combined with every other restriction; the arguments are
        integer arrays of the inputs' library and device that broadcast to the shape of the
        scores being computed (``batch``: the flat index of the batch axes before the heads
        axis; ``head``: the query head; ``q_idx``, ``kv_idx``: absolute positions), so a
        function written with their operators and ``array_namespace(q_idx)`` works on every
        library. It is evaluated tile by tile, never as an ``(L, S)`` array per head; the
        blocked path skips the tiles it empties (from a :func:`create_block_mask` result,
        or classifying the function's blocks itself, off a GPU).
        Ready-made ones: :mod:`sdpa_array.mods`.
    bias_mod : callable, optional
        A bias function ``bias_mod(batch, head, q_idx, kv_idx) -> floating array`` with the
        same arguments, added to the scores where ``bias`` is (after ``softcap``, before the
        masks; ``-inf`` excludes), e.g. :func:`sdpa_array.mods.alibi`. Gradients reach the
        trainable arrays it declares as ``parameters`` (the ready-made ALiBi slopes and T5
        tables) on every path, under torch autograd and ``jax.grad``, and from
        :func:`scaled_dot_product_attention_vjp` with ``return_mod_gradients=True``; floating
        arrays it captures without declaring them (torch tensors that require grad, JAX
        tracers) get theirs under torch autograd and ``jax.grad`` on every path, the
        blocked one in ``O(block)`` memory.
    score_mod : callable, optional
        A score function ``score_mod(score, batch, head, q_idx, kv_idx) -> floating array``
        applied element-wise to the scaled scores ``scale · q·k`` (before ``softcap``,
        ``bias`` and ``bias_mod``), with the index arguments of ``mask_mod``; evaluated tile
        by tile. The backward pass multiplies by its derivative with respect to ``score``:
        its ``derivative`` method when it has one (:func:`sdpa_array.mods.score_function`,
        and the ready-made :func:`sdpa_array.mods.tanh_softcap` and
        :func:`sdpa_array.mods.temperature`), else torch's or JAX's autodiff; on other
        libraries a gradient without one is a ``TypeError``. The trainable arrays it declares
        (the temperatures of :func:`sdpa_array.mods.temperature`) get their gradients as
        ``bias_mod``'s do.
    return_weights : bool, default False
        Also return the attention weights ``(..., Hq, L, S)`` (after dropout).
    return_lse : bool, default False
        Also return the log-sum-exp of the final scores ``(..., Hq, L)`` (in the compute
        dtype: float32 for float16/bfloat16 inputs).
    return_max_scores : bool, default False
        Also return the maximum scores ``(..., Hq)``: for each batch element and query
        head, the largest ``scale * q . k`` over its admissible pairs (those no mask,
        restriction or length excludes), before ``score_mod``, ``softcap``, ``bias``,
        ``bias_mod`` and dropout; ``-inf`` for a head with no admissible pair. In the
        compute dtype, as a statistic (never differentiated: torch detaches it, JAX stops
        its gradient), for QK-clip / MuonClip training. Computed inside the kernel at
        ``O(L)`` extra memory (no second pass: the blocked, materialized and Triton
        kernels); torch's and JAX's kernels do not return it (``"native"`` refuses,
        ``"auto"`` runs another kernel).
    implementation : str, default "auto"
        One of "auto", "materialized", "blocked", "native", "triton", "dask".

        Which implementation runs; all give the same results within rounding.

        * ``"materialized"`` forms the full ``(..., L, S)`` score matrix: the simplest path,
          and the fastest for small calls.
        * ``"blocked"`` visits keys in blocks with an online softmax (FlashAttention-style),
          and queries in blocks, so its extra memory is ``O(block_q * block_k)`` per batch
          element; key blocks that causal or window restrictions exclude are skipped. With
          ``return_weights`` it falls back to the materialized path (the weights are the
          score matrix). On a GPU its tiles hold every batch element and head and all
          keys of their rows (about 64 MiB of scores).
        * ``"native"`` hands the call to the library's own fused kernel
          (``torch.nn.functional.scaled_dot_product_attention``; when the log-sum-exp is
          wanted, torch's CPU flash-attention kernel or, on CUDA, its cuDNN, flash or
          memory-efficient kernel; ``jax.nn.dot_product_attention``) where that computes it
          exactly, and raises :class:`~sdpa_array.CannotDelegateError` (a ``ValueError``)
          naming the reason otherwise (e.g. ``softcap``, ``mask_mod``, NumPy arrays). On a
          CUDA device torch's kernels run in the caller's dtype (float32 accumulation, the
          probabilities rounded to that dtype before the product with the values).
        * ``"triton"`` runs the library's own fused kernels, written in Triton, on torch
          tensors or CuPy arrays on a CUDA device: every score term and restriction but
          ``mask_mod``/``bias_mod`` functions, in the inputs' dtype with float32
          accumulation (``pip install sdpa_array[triton]``); it raises
          :class:`~sdpa_array.CannotUseTritonError` (a ``ValueError``) naming the reason
          where it cannot run.
        * ``"dask"`` builds a Dask graph of (query chunk, key chunk) tasks merged by
          a tree of :func:`merge_attention_states` (Dask inputs; see the distributed
          page of the docs).
        * ``"auto"``: the materialized path when ``return_weights`` is asked; the Dask
          graph for Dask arrays. On a GPU: native where torch's kernel computes the call
          without a mask built for it, else the Triton kernels where they apply (CuPy
          arrays: always), else as below. Elsewhere: native when it applies, unless the
          score matrix would be large (over the library's threshold in the dispatch
          table: 1 MiB on NumPy and torch, 8 MiB on JAX, 256 MiB on array-api-strict)
          and the kernel would form it or need a positional mask built for it;
          otherwise blocked when the score matrix would be large, materialized when not.
          Giving ``block_q``/``block_k`` selects blocked. :func:`sdpa_array.explain`
          shows the choice and why.
    block_q, block_k : int, optional
        Query and key block sizes of the blocked implementation. By default they are
        chosen from the shapes and dtype so that one score tile is about 1 MiB (key blocks
        up to 256, the query block filling the rest).
    layout : {"BHLE", "BLHE"}, default "BHLE"
        How ``query``, ``key``, ``value`` and the output hold their axes: ``"BHLE"``
        ``(..., H, L, E)``, or ``"BLHE"`` ``(..., L, H, E)`` (transformers', Flax's and
        FlashAttention's layout), computed on views with the two axes swapped, not on
        transposed copies. ``mask``, ``bias``, the weights and the log-sum-exp keep their
        ``(..., H, L[, S])`` shapes in both.

    Returns
    -------
    out : array, shape (..., Hq, L, Ev)
        The attention output, same dtype, library and device as ``query``.
    weights : array, shape (..., Hq, L, S)
        Only if ``return_weights``.
    lse : array, shape (..., Hq, L)
        Only if ``return_lse``.
    max_scores : array, shape (..., Hq)
        Only if ``return_max_scores``.

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating or mismatched dtypes, a non-boolean
        ``mask``, a non-floating ``bias``, a ``mask_mod``/``bias_mod`` that is not callable
        or returns another library's array or the wrong dtype.
    ValueError
        Shapes that do not fit together, out-of-range ``scale``, ``softcap``, ``window`` or
        ``dropout_p`` (or no ``dropout_seed`` for it),
        unknown ``alignment`` or ``implementation``, block sizes that are not positive
        ints or are given to an implementation other than blocked; a ``mask_mod`` or
        ``bias_mod`` that raises or returns a shape not following its index arrays (each
        tried on one index before any work), a ``BlockMask`` made for other sizes.
    CannotDelegateError
        ``implementation="native"`` for a call no native kernel computes exactly (a
        subclass of ``ValueError``).
    CannotUseTritonError
        ``implementation="triton"`` for a call the Triton kernels cannot compute here (a
        subclass of ``ValueError``).

    Notes
    -----
    A query with no admissible key (all excluded, or ``S == 0``) gets an output row of
    zeros, weights of zeros and a log-sum-exp of ``-inf``, never NaN.

    Examples
    --------
    NumPy arrays in, a NumPy array out (the worked example of the docs' theory page):

    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention
    >>> q = np.array([[1.0, 2.0], [3.0, 4.0]])
    >>> k = np.array([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])
    >>> v = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    >>> scaled_dot_product_attention(q, k, v).round(3)
    array([[0.986, 1.   , 0.   ],
           [1.   , 1.   , 0.   ]])

    torch tensors (CPU or CUDA, under autograd) give a tensor, here the one torch's own
    function gives:

    >>> import torch  # doctest: +SKIP
    >>> q = torch.randn(2, 8, 128, 64, requires_grad=True)  # doctest: +SKIP
    >>> out = scaled_dot_product_attention(q, q, q, is_causal=True)  # doctest: +SKIP
    >>> out.shape  # doctest: +SKIP
    torch.Size([2, 8, 128, 64])
    >>> expected = torch.nn.functional.scaled_dot_product_attention(  # doctest: +SKIP
    ...     q, q, q, is_causal=True
    ... )
    >>> torch.allclose(out, expected, atol=1e-6)  # doctest: +SKIP
    True
    >>> out.sum().backward()  # doctest: +SKIP

    JAX arrays, also under ``jax.jit``:

    >>> import jax  # doctest: +SKIP
    >>> q = jax.random.normal(jax.random.key(0), (2, 8, 128, 64))  # doctest: +SKIP
    >>> attend = jax.jit(lambda q: scaled_dot_product_attention(q, q, q))  # doctest: +SKIP
    >>> attend(q).shape  # doctest: +SKIP
    (2, 8, 128, 64)

    Causal attention over a right-padded batch, ``(batch, heads, L, E)`` = ``(2, 4, 6,
    8)``: the second sequence has 3 tokens, and its padded queries get zeros:

    >>> q = np.random.default_rng(0).standard_normal((2, 4, 6, 8), dtype=np.float32)
    >>> lengths = np.array([6, 3])
    >>> out = scaled_dot_product_attention(
    ...     q, q, q, is_causal=True, query_lengths=lengths, key_lengths=lengths
    ... )
    >>> out.shape, out.dtype, bool(out[1, :, 3:].any())
    ((2, 4, 6, 8), dtype('float32'), False)

    A mask function instead of a mask array (:mod:`sdpa_array.mods`): two documents of 3
    tokens packed in one row, causal within each; the same as the dense mask:

    >>> from sdpa_array import mods
    >>> segments = np.array([0, 0, 0, 1, 1, 1])
    >>> doc_causal = mods.and_masks(mods.causal(), mods.document(segments, segments))
    >>> out = scaled_dot_product_attention(q, q, q, mask_mod=doc_causal)
    >>> mask = (segments[:, None] == segments) & np.tri(6, dtype=bool)
    >>> bool(np.allclose(out, scaled_dot_product_attention(q, q, q, mask=mask), atol=1e-6))
    True

    Decoding with a KV cache (:func:`attention_with_kv_cache`): 6 tokens cached, one new
    token written into the cache and attended with them:

    >>> from sdpa_array import attention_with_kv_cache
    >>> k_cache = np.zeros((2, 4, 16, 8), dtype=np.float32)  # room for 16 tokens
    >>> v_cache = np.zeros((2, 4, 16, 8), dtype=np.float32)
    >>> k_cache[:, :, :6], v_cache[:, :, :6] = q, q
    >>> new = np.random.default_rng(1).standard_normal((2, 4, 1, 8), dtype=np.float32)
    >>> out, k_cache, v_cache = attention_with_kv_cache(
    ...     new, k_cache, v_cache, cache_lengths=[6, 6], new_key=new, new_value=new
    ... )
    >>> full = scaled_dot_product_attention(new, k_cache[:, :, :7], v_cache[:, :, :7])
    >>> bool(np.allclose(out, full, atol=1e-6))
    True
    """
    arguments = locals()
    run = direct_call(arguments)  # every option but three at its default, a call kept
    if run is not None:
        return run(query, key, value)
    call = Call.gather(arguments, ("query", "key", "value"))
    if call.layout == "BLHE":  # computed heads-first on views, the output swapped back
        again = call.keywords()
        return heads_first_forward(scaled_dot_product_attention, query, key, value, again)
    problem = None
    if eager_jax([query, key, value]):  # compiled whole, once per setup (after the checks)
        problem = validate(query, key, value, call.options)
        if problem.L and problem.S:
            arrays = (query, key, value)
            done, result = run_jitted(scaled_dot_product_attention, arrays, call.keywords())
            if done:
                return result
    planned = (call.options, call.outputs, call.implementation, call.blocks)
    return run_forward(query, key, value, *planned, problem)
