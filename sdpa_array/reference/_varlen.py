"""The packed variable-length layout in the oracle: padded to a batch, then unpadded.

Sequence ``n`` of a packed call (queries ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]``, keys
``cu_seqlens_k[n]:cu_seqlens_k[n + 1]``) is written into batch element ``n`` of zero-padded
``(N, Lmax, H, E)`` arrays, the oracle's own forward or VJP runs on them with
``query_lengths``/``key_lengths`` set to the sequences' lengths (so the padding is excluded
and ``"bottom_right"`` aligns each sequence by its own lengths), and the rows of each
sequence are read back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._attention import scaled_dot_product_attention
from ._convert import as_float64, to_numpy
from ._vjp import scaled_dot_product_attention_vjp

__all__ = [
    "pad_packed",
    "scaled_dot_product_attention_varlen",
    "scaled_dot_product_attention_varlen_vjp",
    "unpad_packed",
]


def _offsets(cu_seqlens: Any, total: int, name: str) -> np.ndarray:
    offsets = np.asarray(to_numpy(cu_seqlens), dtype=np.int64).reshape(-1)
    ok = offsets.size >= 1 and offsets[0] == 0 and offsets[-1] == total
    if not ok or np.any(np.diff(offsets) < 0):
        raise ValueError(
            f"{name} must be non-decreasing offsets from 0 to {total}, got {offsets.tolist()}"
        )
    return offsets


def pad_packed(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Packed rows written into a zero-padded batch.

    Parameters
    ----------
    x : numpy.ndarray, shape (total, ...)
        The rows of ``N`` sequences, one after another.
    offsets : numpy.ndarray, shape (N + 1,)
        Where each sequence starts, then the total.

    Returns
    -------
    numpy.ndarray, shape (N, longest, ...)
        Sequence ``n`` in the first rows of batch element ``n``, zeros after them.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.reference import pad_packed
    >>> x = np.arange(5.0)[:, None]  # two sequences of 2 and 3 rows, packed
    >>> pad_packed(x, np.array([0, 2, 5]))[..., 0]
    array([[0., 1., 0.],
           [2., 3., 4.]])
    """
    lengths = np.diff(offsets)
    longest = int(lengths.max(initial=0))
    padded = np.zeros((lengths.size, longest, *x.shape[1:]), dtype=x.dtype)
    for n in range(lengths.size):
        padded[n, : lengths[n]] = x[offsets[n] : offsets[n + 1]]
    return padded


def unpad_packed(x: np.ndarray, offsets: np.ndarray, axis: int = 1) -> np.ndarray:
    """The inverse of :func:`pad_packed`: each batch element's sequence, concatenated.

    Parameters
    ----------
    x : numpy.ndarray, shape (N, ...)
        A padded batch.
    offsets : numpy.ndarray, shape (N + 1,)
        The sequences' offsets (their lengths are the differences).
    axis : int, default 1
        The axis of ``x`` along which the sequences run (the log-sum-exp's is 2).

    Returns
    -------
    numpy.ndarray
        ``x`` without its batch axis, the first ``length`` entries of each batch element
        along ``axis`` concatenated along that axis.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.reference import pad_packed, unpad_packed
    >>> offsets = np.array([0, 2, 5])
    >>> x = np.arange(5.0)[:, None]
    >>> unpad_packed(pad_packed(x, offsets), offsets)[:, 0]
    array([0., 1., 2., 3., 4.])
    """
    lengths = np.diff(offsets)
    parts = [np.take(x[n], np.arange(lengths[n]), axis=axis - 1) for n in range(lengths.size)]
    if not parts:
        shape = list(x.shape[1:])
        shape[axis - 1] = 0
        return np.zeros(shape, dtype=x.dtype)
    return np.concatenate(parts, axis=axis - 1)


def _padded(
    query: Any, key: Any, value: Any, cu_seqlens_q: Any, cu_seqlens_k: Any
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], dict[str, Any]]:
    q, k, v = (as_float64(a) for a in (query, key, value))
    cq = _offsets(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    ck = cq if cu_seqlens_k is None else _offsets(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    lengths = {"query_lengths": np.diff(cq), "key_lengths": np.diff(ck)}
    return cq, ck, [pad_packed(q, cq), pad_packed(k, ck), pad_packed(v, ck)], lengths


def scaled_dot_product_attention_varlen(
    query: Any,
    key: Any,
    value: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any = None,
    /,
    *,
    return_lse: bool = False,
    return_max_scores: bool = False,
    **options: Any,
) -> Any:
    """Reference attention over sequences packed along the first axis.

    Parameters
    ----------
    query, key, value : array_like
        ``(total_q, Hq, E)``, ``(total_k, Hkv, E)``, ``(total_k, Hkv, Ev)``.
    cu_seqlens_q, cu_seqlens_k : array_like
        Offsets of the ``N`` sequences (``cu_seqlens_k`` defaults to ``cu_seqlens_q``).
    return_lse, return_max_scores : bool, default False
        Also return the log-sum-exp ``(Hq, total_q)`` and the maximum scores ``(N, Hq)``.
    **options
        The options of :func:`scaled_dot_product_attention` that apply (``is_causal``,
        ``window``, ``alignment``, ``scale``, ``softcap``, ``enable_gqa``, ``sinks``,
        dropout, ``mask_mod``, ``bias_mod``): per sequence, sequence ``n`` being batch
        element ``n``.

    Returns
    -------
    out : numpy.ndarray, shape (total_q, Hq, Ev)
        The output, float64.
    lse : numpy.ndarray, shape (Hq, total_q)
        Only if ``return_lse``.
    max_scores : numpy.ndarray, shape (N, Hq)
        Only if ``return_max_scores``.

    Examples
    --------
    Two sequences of 2 and 3 tokens packed into 5 rows, 2 heads of width 4; the first
    sequence's rows are those of a call on it alone:

    >>> import numpy as np
    >>> from sdpa_array import reference
    >>> x = np.random.default_rng(0).standard_normal((5, 2, 4))
    >>> offsets = np.array([0, 2, 5])
    >>> out = reference.scaled_dot_product_attention_varlen(x, x, x, offsets, is_causal=True)
    >>> out.shape
    (5, 2, 4)
    >>> first = reference.scaled_dot_product_attention(
    ...     x[:2], x[:2], x[:2], is_causal=True, layout="BLHE"
    ... )
    >>> bool(np.allclose(out[:2], first))
    True
    """
    cq, _ck, (q, k, v), lengths = _padded(query, key, value, cu_seqlens_q, cu_seqlens_k)
    out, lse, best = scaled_dot_product_attention(
        q, k, v, layout="BLHE", return_lse=True, return_max_scores=True, **lengths, **options
    )
    result = [unpad_packed(out, cq)]
    if return_lse:
        result.append(unpad_packed(lse, cq, axis=2))
    if return_max_scores:
        result.append(best)
    return tuple(result) if len(result) > 1 else result[0]


def scaled_dot_product_attention_varlen_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any = None,
    /,
    **options: Any,
) -> tuple[np.ndarray, ...]:
    """Reference gradients of :func:`scaled_dot_product_attention_varlen`.

    Parameters
    ----------
    query, key, value : array_like
        As in :func:`scaled_dot_product_attention_varlen`.
    grad_output : array_like, shape (total_q, Hq, Ev)
        Cotangent of the output.
    cu_seqlens_q, cu_seqlens_k : array_like
        As in :func:`scaled_dot_product_attention_varlen`.
    **options
        As in :func:`scaled_dot_product_attention_varlen` (``return_*`` aside).

    Returns
    -------
    tuple of numpy.ndarray
        ``(grad_query, grad_key, grad_value[, grad_sinks][, grad_scale])``, float64: the
        first three in the packed layout, the others summed over the sequences.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import reference
    >>> x = np.random.default_rng(0).standard_normal((5, 2, 4))
    >>> offsets = np.array([0, 2, 5])
    >>> dq, dk, dv = reference.scaled_dot_product_attention_varlen_vjp(
    ...     x, x, x, np.ones_like(x), offsets, is_causal=True
    ... )
    >>> dq.shape, dk.shape, dv.shape
    ((5, 2, 4), (5, 2, 4), (5, 2, 4))
    """
    cq, ck, (q, k, v), lengths = _padded(query, key, value, cu_seqlens_q, cu_seqlens_k)
    g = pad_packed(as_float64(grad_output), cq)
    grads = scaled_dot_product_attention_vjp(q, k, v, g, layout="BLHE", **lengths, **options)
    dq, dk, dv = unpad_packed(grads[0], cq), unpad_packed(grads[1], ck), unpad_packed(grads[2], ck)
    return (dq, dk, dv, *grads[3:])
