"""Checking packed variable-length results against the oracle.

A packed call (:func:`sdpa_array.scaled_dot_product_attention_varlen`) is, sequence by
sequence, the padded call with lengths; the checks here pad the packed inputs (float64 host
copies) into that call, take the oracle's values and bounds for it
(:func:`~sdpa_array.testing.assertions.forward_oracle_and_bounds`,
:func:`~sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds`: the bounds of the padded
problem, whose rows hold the same sequences) and read back each sequence's rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference
from .._arrays.compat import array_namespace
from .._arrays.typing import Array
from .assertions import assert_array_like, assert_close, assert_within, forward_oracle_and_bounds
from .bounds import compute_dtype, dtype_name, scale_is_array
from .vjp_bounds import vjp_oracle_and_bounds

__all__ = ["assert_varlen_close_to_oracle", "assert_varlen_vjp_close_to_oracle"]


def _padded_heads_first(
    arrays: tuple[Array, ...], offsets: tuple[np.ndarray, ...]
) -> list[np.ndarray]:
    """Each packed ``(total, H, X)`` array as float64 ``(N, H, longest, X)``."""
    out = []
    for x, o in zip(arrays, offsets, strict=True):
        padded = reference.pad_packed(reference.to_numpy(x).astype(np.float64), o)
        out.append(np.swapaxes(padded, 1, 2))
    return out


def _offsets(cu_q: Any, cu_k: Any) -> tuple[np.ndarray, np.ndarray]:
    q = np.asarray(reference.to_numpy(cu_q), dtype=np.int64).reshape(-1)
    k = q if cu_k is None else np.asarray(reference.to_numpy(cu_k), dtype=np.int64).reshape(-1)
    return q, k


def _lengths(options: dict[str, Any], cq: np.ndarray, ck: np.ndarray) -> dict[str, Any]:
    drop = ("max_seqlen_q", "max_seqlen_k", "implementation", "block_q", "block_k")
    kept = {n: v for n, v in options.items() if n not in drop}
    return {**kept, "query_lengths": np.diff(cq), "key_lengths": np.diff(ck)}


def assert_varlen_close_to_oracle(
    result: Array | tuple[Array, ...],
    query: Array,
    key: Array,
    value: Array,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any = None,
    /,
    *,
    return_lse: bool = False,
    return_max_scores: bool = False,
    fused: bool = False,
    **options: Any,
) -> None:
    """Check a result of :func:`sdpa_array.scaled_dot_product_attention_varlen`.

    Each returned array must have the query's library, array type and device, the promised
    shape and dtype (``lse`` and ``max_scores`` in the compute dtype), and lie within the
    bound that :func:`~sdpa_array.testing.assert_close_to_oracle` derives for the same
    sequences padded to a batch with lengths.

    Parameters
    ----------
    result : array or tuple of arrays
        ``out`` ``(total_q, Hq, Ev)``, then ``lse`` ``(Hq, total_q)`` and ``max_scores``
        ``(N, Hq)`` where requested.
    query, key, value, cu_seqlens_q, cu_seqlens_k
        The call's arrays and offsets.
    return_lse, return_max_scores, fused
        What the call was asked for, and whether a fused kernel in the inputs' dtype ran.
    **options
        The call's other keyword arguments.

    Raises
    ------
    AssertionError
        Naming the output and what differs.

    Examples
    --------
    Two sequences of 2 and 3 tokens packed into 5 rows, 2 heads of width 4:

    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention_varlen
    >>> from sdpa_array.testing import assert_varlen_close_to_oracle
    >>> x = np.random.default_rng(0).standard_normal((5, 2, 4), dtype=np.float32)
    >>> offsets = np.array([0, 2, 5])
    >>> out = scaled_dot_product_attention_varlen(x, x, x, offsets, is_causal=True)
    >>> assert_varlen_close_to_oracle(out, x, x, x, offsets, is_causal=True)
    """
    parts = result if isinstance(result, tuple) else (result,)
    expected = 1 + return_lse + return_max_scores
    assert len(parts) == expected, f"{len(parts)} arrays returned, {expected} asked for"
    cq, ck = _offsets(cu_seqlens_q, cu_seqlens_k)
    q64, k64, v64 = _padded_heads_first((query, key, value), (cq, ck, ck))
    dtype = dtype_name(query)
    oracle = forward_oracle_and_bounds(
        dtype, q64, k64, v64, fused=fused, **_lengths(options, cq, ck)
    )
    xp = array_namespace({"query": query})
    compute = query.dtype if compute_dtype(dtype) == dtype else xp.float32
    ref_out, out_bound = oracle["out"]
    checks = [("out", reference.unpad_packed(np.swapaxes(ref_out, 1, 2), cq), out_bound)]
    if return_lse:
        ref_lse, lse_bound = oracle["lse"]
        checks.append(("lse", reference.unpad_packed(ref_lse, cq, axis=2), lse_bound))
    if return_max_scores:
        checks.append(("max_scores", *oracle["max_scores"]))
    for (name, ref, bound), got in zip(checks, parts, strict=True):
        like_dtype = query.dtype if name == "out" else compute
        assert_array_like(got, query, shape=ref.shape, dtype=like_dtype)
        assert_close(got, ref, bound, name)


def assert_varlen_vjp_close_to_oracle(
    grads: tuple[Array, ...],
    query: Array,
    key: Array,
    value: Array,
    grad_output: Array,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any = None,
    /,
    *,
    fused: bool = False,
    **options: Any,
) -> None:
    """Check gradients of the packed call against the oracle.

    Each gradient must have its input's library, array type, shape, dtype and device, and
    every entry must lie within the bound of
    :func:`~sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds` for the same sequences
    padded to a batch with lengths.

    Parameters
    ----------
    grads : tuple of arrays
        ``(dq, dk, dv[, dsinks][, dscale])``, as
        :func:`sdpa_array.scaled_dot_product_attention_varlen_vjp` (or autodiff) returned
        them.
    query, key, value, grad_output : array
        The call's arrays and the output's cotangent ``(total_q, Hq, Ev)``.
    cu_seqlens_q, cu_seqlens_k
        The call's offsets.
    fused : bool, default False
        Whether the backward ran a fused kernel in the inputs' dtype.
    **options
        The call's other keyword arguments.

    Raises
    ------
    AssertionError
        Naming the gradient and what differs.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention_varlen_vjp
    >>> from sdpa_array.testing import assert_varlen_vjp_close_to_oracle
    >>> x = np.random.default_rng(0).standard_normal((5, 2, 4), dtype=np.float32)
    >>> offsets = np.array([0, 2, 5])
    >>> g = np.ones_like(x)
    >>> grads = scaled_dot_product_attention_varlen_vjp(x, x, x, g, offsets, is_causal=True)
    >>> assert_varlen_vjp_close_to_oracle(grads, x, x, x, g, offsets, is_causal=True)
    """
    cq, ck = _offsets(cu_seqlens_q, cu_seqlens_k)
    q64, k64, v64, g64 = _padded_heads_first((query, key, value, grad_output), (cq, ck, ck, cq))
    sinks = options.get("sinks")
    checked = _lengths(options, cq, ck)
    if sinks is not None:
        checked["sinks"] = reference.to_numpy(sinks).astype(np.float64)
    expected, bounds = vjp_oracle_and_bounds(
        dtype_name(query), q64, k64, v64, g64, base2=fused, rounded_operands=fused, **checked
    )
    for i, o in ((0, cq), (1, ck), (2, ck)):
        expected[i] = reference.unpad_packed(np.swapaxes(expected[i], 1, 2), o)
        bounds[i] = reference.unpad_packed(np.swapaxes(bounds[i], 1, 2), o)
    named = {"dq": query, "dk": key, "dv": value, "dsinks": sinks}
    scale = options.get("scale")
    named["dscale"] = scale if scale_is_array(scale) else None
    inputs = {n: x for n, x in named.items() if x is not None}
    assert len(grads) == len(inputs), f"{len(grads)} gradients for {len(inputs)} inputs"
    for (name, x), g, e, b in zip(inputs.items(), grads, expected, bounds, strict=True):
        assert_array_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(g, e, b, name)
