"""The public cache function: check, plan, write the new tokens, run the plan (see the
package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._arrays.typing import Array, Layout
from ..._plan.decode import DecodePlan, plan_decode, run_decode_kernel
from .call import gather, keep, result, run_kept
from .chunks import attend_chunks, attend_single
from .write import write_tokens

__all__ = ["attention_with_kv_cache"]


def attention_with_kv_cache(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    /,
    *,
    cache_lengths: Array | list[int],
    cache_leftpad: Array | list[int] | None = None,
    new_key: Array | None = None,
    new_value: Array | None = None,
    block_table: Array | list[list[int]] | None = None,
    num_splits: int | None = None,
    layout: Layout = "BHLE",
    **options: Any,
) -> tuple[Array, ...]:
    r"""Attention of a few new queries over a KV cache (decoding), contiguous or paged.

    Optionally writes ``new_key``/``new_value`` into the caches first, then attends each
    sequence's query to the tokens of its cache, without ever gathering a copy of the whole
    cache: the attended tokens are split into chunks, each chunk's partial attention is
    computed on that chunk's keys alone and the parts are merged by their log-sum-exps.

    Parameters
    ----------
    query : array, shape (B, Hq, L, E)
        ``L`` new queries per sequence (usually 1).
    key_cache : array
        Contiguous: ``(B, Hkv, S_max, E)``. Paged (``block_table`` given):
        ``(num_pages, Hkv, page_size, E)``. Same library and dtype as ``query``.
    value_cache : array
        ``(B, Hkv, S_max, Ev)`` or ``(num_pages, Hkv, page_size, Ev)``.
    cache_lengths : array or list of int, shape (B,)
        Tokens already in each sequence's cache: an integer array of the inputs' library, a
        NumPy array or a list of ints.
    cache_leftpad : array or list of int, shape (B,), optional
        Where each sequence's tokens start (FlashAttention's ``cache_leftpad``): a batch
        padded on the left, as batched generation fills a cache, attends tokens
        ``[cache_leftpad[b], n_b)`` only (``n_b`` the attended tokens below); the slots
        before are never read. Positions stay the cache's: the diagonals do not move. 0
        for every sequence by default; each at most ``n_b``. Same kinds as
        ``cache_lengths``.
    new_key, new_value : array, shape (B, Hkv, L, E) and (B, Hkv, L, Ev), optional
        Both or neither. Written at token positions ``cache_lengths[b] ...
        cache_lengths[b] + L - 1`` before attending; the query then attends tokens
        ``[0, cache_lengths[b] + L)``. Without them the cache already holds the query's
        tokens and the query attends tokens ``[0, cache_lengths[b])``.
    block_table : array or list of lists of int, shape (B, max_pages), optional
        Makes the cache paged: sequence ``b``'s token ``t`` lives in page
        ``block_table[b, t // page_size]`` at row ``t % page_size``. Only the entries a
        sequence uses are read.
    num_splits : int, optional
        Into how many chunks the longest attended range is split (see Notes); by default
        chosen from its length. Chunks are whole pages, so fewer may result.
    layout : {"BHLE", "BLHE"}, default "BHLE"
        With ``"BLHE"``, ``query``, ``new_key``, ``new_value``, the output and the caches
        hold the length axis before the heads axis: ``(B, L, Hq, E)``, caches ``(B, S_max,
        Hkv, E)`` or, paged, ``(num_pages, page_size, Hkv, E)`` (FlashAttention's and
        vLLM's paged layout), computed on views with the two axes swapped, the caches
        written through them. ``mask``, ``bias``, the log-sum-exp and the maximum scores
        keep their shapes.
    **options
        ``mask``, ``bias``, ``is_causal``, ``window``, ``scale``, ``softcap``,
        ``enable_gqa``, ``return_lse``, ``return_max_scores``: as in
        :func:`scaled_dot_product_attention`.
        ``implementation``: ``"auto"`` (default), ``"triton"``, ``"native"``, ``"blocked"``
        or ``"materialized"``. ``"triton"`` decodes through the Triton decoding kernel
        (see Notes) and raises :class:`CannotUseTritonError` before any work where the
        Triton kernels cannot run; the others are what every chunk's call runs.
        ``mask`` and ``bias`` are indexed by token position: broadcastable to
        ``(B, Hq, L, T)`` with ``T = S_max`` (contiguous) or ``max_pages * page_size``
        (paged). The alignment is always bottom-right over the attended tokens: with
        ``n_b`` of them, query ``i``'s diagonal is token ``n_b - L + i``, so
        ``is_causal=True`` is the usual decoding rule and ``window=(left, right)`` counts
        from that diagonal (``alignment="bottom_right"`` is accepted, nothing else).

    Returns
    -------
    out : array, shape (B, Hq, L, Ev)
        Same library, dtype and device as ``query``.
    lse : array, shape (B, Hq, L)
        Only with ``return_lse=True``; in the compute dtype (float32 for 16-bit inputs).
    max_scores : array, shape (B, Hq)
        Only with ``return_max_scores=True``: the largest ``scale * q . k`` over the tokens
        each head attends (the largest of the chunks'); in the compute dtype.
    key_cache, value_cache : array
        The caches holding the new tokens, unchanged elsewhere. Written in place, and the
        caller's own arrays returned, for NumPy (writable arrays), CuPy, array-api-strict and
        torch (when neither the cache nor the new tokens require grad). New arrays for JAX
        (``.at[].set``), Dask, read-only NumPy arrays and torch under autograd. Where the
        lengths or the block table cannot be read on the host (lazy Dask arrays, torch
        tensors while a CUDA graph is captured), torch and CuPy write through the indices
        on the device; other libraries update with a ``where`` over the cache. Without new
        tokens the caller's arrays are returned as they are.

    Raises
    ------
    TypeError
        Arrays of different libraries, non-floating or different dtypes, a non-boolean
        ``mask``, non-integer ``cache_lengths`` or ``block_table``, a ``num_splits`` that is
        not an int, an unknown option (``return_weights`` included).
    ValueError
        Shapes that do not fit together, ``new_key`` without ``new_value`` (or the reverse),
        a cache too small for ``cache_lengths + L`` or negative lengths, a ``block_table``
        entry outside ``[0, num_pages)`` among the pages a sequence uses, a ``num_splits``
        below 1, out-of-range options; all before any work. Values that cannot be read
        (lazy Dask arrays, JAX tracers) are not checked; a block table entry outside the
        pages is then clipped to the nearest page, whose tokens the lengths exclude.

    Notes
    -----
    *Chunks.* Sequence ``b`` attends the tokens ``[lo_b, hi_b)`` that some query may attend
    (``[0, n_b)``, narrowed by ``window`` and ``is_causal``). The chunk length is ``ceil(n /
    num_splits)`` tokens, rounded up to whole pages for a paged cache, with ``n`` the
    longest such range over the batch. By default ``num_splits = ceil(n / target)`` with
    ``target = min(CHUNK_MAX_TOKENS, CHUNK_BYTES // token_bytes)``, ``token_bytes = Hkv * (E
    + Ev) * itemsize``, ``CHUNK_BYTES`` = 8 MiB and ``CHUNK_MAX_TOKENS`` = 8192: chunks of
    1024 tokens for ``Hkv = 8``, ``E = Ev = 128`` in float32, so that a single query over a
    32k-token cache is split 32 ways (at least 4 ways for any head size) and keeps every
    thread of NumPy's pool busy. Chunks start at multiples of the chunk length and are cut
    to ``[lo_b, hi_b)``; chunks outside it are never read or computed. A paged chunk is
    gathered page by page (consecutive pages as one view) and attended with its pages as a
    batch axis; a partly filled page is attended on its filled rows only, so cache slots
    beyond the lengths are never read, whatever they hold. Where the lengths cannot be read
    on the host, every chunk of ``[0, T)`` is computed, the lengths enter the mask, and
    values beyond them are zeroed first.

    *Triton decoding.* On a CUDA device (``"auto"``), or when asked for by name, torch
    tensors and CuPy arrays are attended by one launch of a split-KV kernel: one program per
    (sequence, key/value head, split) holds the ``G * L`` query rows of that head, reads its
    split's tokens through the block table and writes a partial output and log-sum-exp,
    which one merge combines (FlashAttention's and FlashInfer's flash-decoding). The splits
    are whole key blocks of 64 tokens, ``num_splits`` of them where given, else about 512
    programs in all. The kernel takes ``is_causal``, ``window``, ``scale`` (a number),
    ``softcap`` and GQA; a dense ``mask`` or ``bias``, more than 64 query rows per
    key/value head, a 0-d array ``scale`` or tensors that require grad are attended chunk
    by chunk as above. Lengths and block table given as device arrays are read on the host
    (checked, and the splits fitted to the longest sequence), except while a torch CUDA
    graph is captured: then they stay on the device, unchecked, the splits cover the
    cache's capacity, and the call copies nothing from the host, so a decoding step
    (writing the new tokens included) can be captured and replayed.

    *Accuracy.* Each chunk is a call of the main function (within its derived error
    bound); merging ``n`` parts adds the error of an attention over ``n`` keys whose
    scores are the parts' log-sum-exps (see :func:`merge_attention_states` and
    ``tests/test_kv_cache.py``).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import attention_with_kv_cache
    >>> k_cache = np.zeros((1, 1, 4, 2))  # B=1, Hkv=1, S_max=4, E=2
    >>> v_cache = np.zeros((1, 1, 4, 1))
    >>> k_cache[0, 0, :2] = [[1.0, 0.0], [0.0, 1.0]]  # two tokens already cached
    >>> v_cache[0, 0, :2] = [[1.0], [2.0]]
    >>> q = np.array([[[[1.0, 1.0]]]])  # one new query
    >>> out, k_new, v_new = attention_with_kv_cache(
    ...     q, k_cache, v_cache, cache_lengths=[2],
    ...     new_key=np.array([[[[1.0, 1.0]]]]), new_value=np.array([[[[6.0]]]]),
    ...     is_causal=True)
    >>> k_new is k_cache, v_cache[0, 0, :, 0]  # written in place: token 2 is the new one
    (True, array([1., 2., 6., 0.]))
    >>> out.round(4)
    array([[[[3.7657]]]])

    The same tokens in a paged cache of pages of 2 tokens, stored out of order:

    >>> pages_k = np.zeros((3, 1, 2, 2))
    >>> pages_v = np.zeros((3, 1, 2, 1))
    >>> pages_k[2], pages_k[0] = k_cache[0, :, :2], k_cache[0, :, 2:]
    >>> pages_v[2], pages_v[0] = v_cache[0, :, :2], v_cache[0, :, 2:]
    >>> out_paged, _, _ = attention_with_kv_cache(
    ...     q, pages_k, pages_v, cache_lengths=[3], block_table=[[2, 0]], is_causal=True)
    >>> bool(np.allclose(out_paged, out))
    True
    """
    arguments = locals()
    key, done = run_kept(arguments)  # a plain call planned before: its forward call at once
    if done is not None:
        return done
    c, given = gather(arguments)  # heads first: "BLHE" arrays as views
    plan = plan_decode(c)  # raises CannotUseTritonError before any work
    caches = write_tokens(c)
    keep(key, plan, caches)
    found = RUNS[plan.choice.name](plan, caches)
    return result(c, given, found, caches)


#: How each of the planner's choices runs (:data:`~sdpa_array._plan.decode.DECODE_KERNELS`),
#: over the caches holding the new tokens: output, log-sum-exp and maximum scores (each
#: ``None`` where not computed).
RUNS: dict[str, Callable[[DecodePlan, tuple[Array, Array]], tuple[Array, ...]]] = {
    "triton": run_decode_kernel,
    "single": attend_single,
    "split": attend_chunks,
}
