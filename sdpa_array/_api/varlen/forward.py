"""The packed variable-length forward: ``(total, heads, features)`` with sequence offsets.

:func:`scaled_dot_product_attention_varlen` (like its VJP, :mod:`.vjp`) splits the packed
arrays into their sequences by ``cu_seqlens_q``/``cu_seqlens_k`` (host offsets, checked by
:func:`~sdpa_array._problem.packed.check_packed`), runs each sequence as one heads-first call
of the library (every sequence validated before any runs; then planned and run by
:mod:`sdpa_array._plan.run`: the same planner, kernels and autograd wrappers as any call)
and joins the results, or (self-attention without mod functions or dropout, off a GPU)
runs the packed tokens as one call with the sequences as segment ids (:mod:`.one_call`).
The work is that of the sequences themselves (the sum of their squared lengths), and no
``(total, total)`` array is formed. Sequence ``n`` is batch
element ``n`` of the padded call (:mod:`.sequences`).
"""

from __future__ import annotations

from typing import Any

from ..._arrays.compat import array_namespace, device
from ..._arrays.typing import Alignment, Array, BiasMod, MaskMod, ScoreMod
from ..._plan.run import run_forward
from ..._problem.options import Options
from ..._problem.outputs import Outputs
from ..._problem.packed import check_packed
from ..._problem.peer_keywords import names_peer_spellings
from ..._problem.problem import Problem
from ..jax_eager import eager_jax, run_jitted
from ..layout import swap_heads_and_length
from .one_call import one_forward, segments_call
from .sequences import keywords_of, sequences, static_offsets

__all__ = ["scaled_dot_product_attention_varlen"]


@names_peer_spellings
def scaled_dot_product_attention_varlen(
    query: Array,
    key: Array,
    value: Array,
    /,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: Alignment = "top_left",
    scale: float | Array | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: Array | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Array | None = None,
    mask_mod: MaskMod | None = None,
    bias_mod: BiasMod | None = None,
    score_mod: ScoreMod | None = None,
    return_lse: bool = False,
    return_max_scores: bool = False,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
) -> Any:
    """Attention over sequences packed along one axis, without padding.

    FlashAttention's ``flash_attn_varlen_func`` and torch's ``varlen_attn`` layout: the
    ``N`` sequences of a batch are concatenated, sequence ``n`` holding queries
    ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` and keys ``cu_seqlens_k[n]:cu_seqlens_k[n + 1]``,
    and each attends only within itself. The result equals, sequence by sequence,
    :func:`scaled_dot_product_attention` on the same call padded to a batch of ``N`` with
    ``query_lengths``/``key_lengths`` (sequence ``n`` is its batch element ``n``: the same
    dropout bits, and ``batch = n`` for mask and bias functions), but costs only the
    sequences' own work (the sum of their squared lengths): each sequence runs as one call,
    planned and computed like any other.

    Parameters
    ----------
    query : array, shape (total_q, Hq, E)
        The queries of every sequence, one after another.
    key : array, shape (total_k, Hkv, E)
        The keys (``Hkv == Hq``, or dividing it with ``enable_gqa``).
    value : array, shape (total_k, Hkv, Ev)
        The values.
    cu_seqlens_q : array or list of int, shape (N + 1,)
        Cumulative query offsets: integers starting at 0, non-decreasing, ending at
        ``total_q``. Read on the host (a NumPy array, a list, or an array of the inputs'
        library: on a GPU, reading it waits for the device once); not a lazy Dask array
        or a JAX tracer (under ``jax.jit`` pass NumPy offsets). Empty sequences are allowed.
    cu_seqlens_k : array or list of int, shape (N + 1,), optional
        Cumulative key offsets (default: ``cu_seqlens_q``, for ``total_k == total_q``).
    max_seqlen_q, max_seqlen_k : int, optional
        The longest query and key sequence (FlashAttention's arguments): checked to be at
        least the longest, else unused.
    is_causal, window, alignment
        Per sequence, as for :func:`scaled_dot_product_attention` with lengths: positions
        count from each sequence's start and ``"bottom_right"`` puts query ``i``'s diagonal
        at key ``i + S_n - L_n`` (FlashAttention's varlen rule).
    scale, softcap, enable_gqa, sinks, dropout_p, dropout_seed
        As for :func:`scaled_dot_product_attention` (``sinks``: one per query head).
    mask_mod, bias_mod : callable, optional
        Functions of ``(batch, head, q_idx, kv_idx)`` with ``batch`` the sequence index and
        the positions counted within the sequence (a :class:`~sdpa_array.BlockMask` is made
        for one size and is refused: pass its function).
    score_mod : callable, optional
        A function of ``(score, batch, head, q_idx, kv_idx)``, the indices as for
        ``mask_mod``; its gradient as in :func:`scaled_dot_product_attention`.
    return_lse : bool, default False
        Also return the log-sum-exp of each query's scores, shape ``(Hq, total_q)`` (as
        FlashAttention's varlen functions), in the compute dtype.
    return_max_scores : bool, default False
        Also return the maximum scores of each sequence and query head, shape ``(N, Hq)``
        (see :func:`scaled_dot_product_attention`).
    implementation, block_q, block_k
        As for :func:`scaled_dot_product_attention`, for every sequence.

    Returns
    -------
    out : array, shape (total_q, Hq, Ev)
        Same dtype, library and device as ``query``.
    lse : array, shape (Hq, total_q)
        Only if ``return_lse``.
    max_scores : array, shape (N, Hq)
        Only if ``return_max_scores``.

    Raises
    ------
    TypeError
        As for :func:`scaled_dot_product_attention`; offsets that are not integers or
        cannot be read on the host; a ``BlockMask``.
    ValueError
        As for :func:`scaled_dot_product_attention`; arrays that are not
        ``(total, heads, features)`` or whose key and value totals differ; offsets that are
        not one-dimensional, do not start at 0, decrease, do not end at the totals or count
        different sequences; ``max_seqlen_*`` shorter than the longest sequence.

    Notes
    -----
    Off a GPU, a call whose sequences attend their own tokens (equal offsets) with no mask,
    bias or score function and no dropout, for ``implementation="auto"`` or ``"blocked"``
    and without the maximum scores, is one call of the library on the packed tokens with
    the sequences as segment ids, which visits the sequences' own tiles only. Otherwise
    each sequence is one call of the library, so ``N`` calls are planned and launched: on
    a GPU, many short sequences cost ``N`` launches. Under ``jax.jit`` the offsets are
    static (a new set of offsets compiles a new program), as eager JAX calls are compiled
    per set.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention_varlen
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((5, 2, 4))  # two sequences: 2 and 3 tokens, 2 heads
    >>> out = scaled_dot_product_attention_varlen(q, q, q, [0, 2, 5], is_causal=True)
    >>> out.shape
    (5, 2, 4)
    >>> bool(np.allclose(out[0], q[0]))  # the first token attends only itself
    True
    """
    packed = check_packed(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = Options.gather(locals())
    outputs = Outputs.of(False, return_lse, return_max_scores)
    if packed.count and eager_jax([query, key, value]):  # compiled whole, per set of offsets
        keywords = {
            **keywords_of(options),
            "return_lse": return_lse,
            "return_max_scores": return_max_scores,
            "implementation": implementation,
            "block_q": block_q,
            "block_k": block_k,
        }
        done, result = run_jitted(
            scaled_dot_product_attention_varlen,
            (query, key, value),
            static_offsets(keywords, packed),
        )
        if done:
            return result
    one = segments_call(query, packed, options, implementation, return_max_scores)
    if one is not None:  # the sequences as segment ids of one call
        return one_forward((query, key, value), one, outputs, implementation, (block_q, block_k))
    calls = sequences(query, key, value, packed, options)
    results = [
        run_forward(
            s.query,
            s.key,
            s.value,
            s.options,
            outputs,
            implementation,
            (block_q, block_k),
            s.problem,
        )
        for s in calls[: packed.count]
    ]
    return _join_forward(query, value, calls[0].problem, outputs, results)


def _join_forward(
    query: Array, value: Array, problem: Problem, outputs: Outputs, results: list[Any]
) -> Any:
    """The sequences' results joined into the packed layout (``problem``: the first
    sequence's, for the dtypes)."""
    xp = array_namespace({"query": query})
    parts = [r if isinstance(r, tuple) else (r,) for r in results]
    heads = int(query.shape[1])
    if not parts:  # no sequence: empty results
        dev = device(query)
        compute = problem.compute_dtype
        empty: tuple[Array, ...] = (
            xp.zeros((0, heads, int(value.shape[2])), dtype=query.dtype, device=dev),
        )
        if outputs.lse:
            empty += (xp.zeros((heads, 0), dtype=compute, device=dev),)
        if outputs.max_scores:
            empty += (xp.zeros((0, heads), dtype=compute, device=dev),)
        return empty if len(empty) > 1 else empty[0]
    outs = [swap_heads_and_length(p[0])[0] for p in parts]
    joined = [outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)]
    if outputs.lse:
        lses = [p[1] for p in parts]
        joined.append(lses[0] if len(lses) == 1 else xp.concat(lses, axis=1))
    if outputs.max_scores:
        joined.append(xp.stack([p[-1] for p in parts], axis=0))
    return tuple(joined) if len(joined) > 1 else joined[0]
