"""The packed variable-length VJP: the gradients of
:func:`~sdpa_array._api.varlen.forward.scaled_dot_product_attention_varlen`, sequence by
sequence (:mod:`.sequences`), joined into the packed layout; the sinks' and an array
``scale``'s gradients are summed over the sequences."""

from __future__ import annotations

from typing import Any

from ..._arrays.compat import array_namespace
from ..._arrays.typing import Alignment, Array, BiasMod, MaskMod, ScoreMod
from ..._plan.run import run_vjp, zero_gradients
from ..._problem.options import Options
from ..._problem.packed import check_packed
from ..._problem.peer_keywords import names_peer_spellings
from ..._problem.problem import Inputs
from ..jax_eager import eager_jax, run_jitted
from ..layout import swap_heads_and_length
from ..vjp import check_cotangent
from .one_call import one_vjp, segments_call
from .sequences import keywords_of, sequences, static_offsets

__all__ = ["scaled_dot_product_attention_varlen_vjp"]


@names_peer_spellings
def scaled_dot_product_attention_varlen_vjp(
    query: Array,
    key: Array,
    value: Array,
    grad_output: Array,
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
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Array, ...]:
    """Gradients of :func:`scaled_dot_product_attention_varlen` for an output cotangent.

    Returns ``(dL/dQ, dL/dK, dL/dV[, dL/dSinks][, dL/dscale])`` for ``L = sum(out *
    grad_output)``, on any Array-API library, as
    :func:`scaled_dot_product_attention_vjp` does for the padded call.

    Parameters
    ----------
    query, key, value
        As for :func:`scaled_dot_product_attention_varlen`.
    grad_output : array, shape (total_q, Hq, Ev)
        Cotangent of the output: the output's shape, library and dtype.
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As for :func:`scaled_dot_product_attention_varlen`.
    is_causal, window, alignment, scale, softcap, enable_gqa, sinks, dropout_p, dropout_seed
        As for the forward (the same seed regenerates the same keep mask).
    mask_mod, bias_mod
        As for the forward; they have no gradient.
    score_mod
        As for the forward: the gradients pass through its derivative.
    implementation, block_q, block_k
        As for :func:`scaled_dot_product_attention_vjp`, for every sequence.

    Returns
    -------
    grad_query, grad_key, grad_value : array
        The shapes, dtypes, library and device of ``query``, ``key``, ``value``; keys of a
        sequence no query reaches get zeros.
    grad_sinks : array
        Only if ``sinks`` is given: its shape and dtype, summed over the sequences.
    grad_scale : array
        Only if ``scale`` is an array: 0-d, its dtype, summed over the sequences.

    Raises
    ------
    TypeError, ValueError
        As for the forward; also a ``grad_output`` that is not an array of the inputs'
        library with the output's dtype and shape.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention_varlen_vjp
    >>> q = np.ones((3, 1, 2))
    >>> v = np.arange(3.0).reshape(3, 1, 1)
    >>> dq, dk, dv = scaled_dot_product_attention_varlen_vjp(q, q, v, np.ones((3, 1, 1)), [0, 1, 3])
    >>> dv[:, 0, 0]  # the first sequence's one key takes its query's whole cotangent
    array([1., 1., 1.])
    """
    packed = check_packed(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = Options.gather(locals())
    first = sequences(query, key, value, packed, options, limit=1)[0]  # the options checked
    p = first.problem
    check_cotangent(query, grad_output, (int(query.shape[0]), p.heads_q, p.Ev))
    if not packed.count:  # no sequence: every gradient is zero
        x = Inputs.of(first.query, first.key, first.value, first.options, p)
        empty = zero_gradients(p, x)
        return (*swap_heads_and_length(*empty[:3]), *empty[3:])
    if eager_jax([query, key, value, grad_output]):  # compiled whole
        keywords = {**keywords_of(options), "implementation": implementation}
        keywords.update(block_q=block_q, block_k=block_k)
        done, result = run_jitted(
            scaled_dot_product_attention_varlen_vjp,
            (query, key, value, grad_output),
            static_offsets(keywords, packed),
        )
        if done:
            return result  # type: ignore[no-any-return]
    one = segments_call(query, packed, options, implementation, False)
    if one is not None:  # the sequences as segment ids of one call
        arrays = (query, key, value, grad_output)
        return one_vjp(arrays, one, implementation, (block_q, block_k))
    # the sinks' and the scale's gradients are sums over the sequences: each sequence
    # computes its share in float32 at least, and the sum is rounded once
    summed: list[Any] = [sinks, scale if p.scale_is_array else None]
    dtypes = [x.dtype for x in summed if x is not None]
    wide = {"sinks": _widened(sinks)}
    if p.scale_is_array:
        wide["scale"] = _widened(scale)
    calls = sequences(query, key, value, packed, options.replace(**wide))
    cotangents = [
        swap_heads_and_length(grad_output[packed.rows(n), ...])[0] for n in range(packed.count)
    ]
    blocks = (block_q, block_k)
    grads = [
        run_vjp(s.query, s.key, s.value, g, s.options, implementation, blocks, s.problem)
        for s, g in zip(calls, cotangents, strict=True)
    ]
    return _join(query, grads, dtypes)


def _widened(x: Array | None) -> Array | None:
    """``x`` in float32 at least (float64 stays float64)."""
    if x is None:
        return None
    xp = array_namespace({"x": x})
    return xp.astype(x, xp.float64 if x.dtype == xp.float64 else xp.float32)


def _join(query: Array, grads: list[tuple[Array, ...]], dtypes: list[Any]) -> tuple[Array, ...]:
    """The sequences' gradients in the packed layout: the query, key and value gradients
    concatenated, the others (sinks, scale: computed in float32 at least) summed and cast
    to ``dtypes``, theirs."""
    xp = array_namespace({"query": query})
    joined: list[Array] = []
    for i in range(3):
        parts = [swap_heads_and_length(g[i])[0] for g in grads]
        joined.append(parts[0] if len(parts) == 1 else xp.concat(parts, axis=0))
    for i, dtype in zip(range(3, len(grads[0])), dtypes, strict=True):
        parts = [g[i] for g in grads]
        stacked = xp.stack(parts)
        # keepdims: NumPy's 0-d sums would be scalars, not arrays
        total = xp.sum(stacked, axis=0, keepdims=True)
        joined.append(xp.reshape(xp.astype(total, dtype), tuple(parts[0].shape)))
    return tuple(joined)
