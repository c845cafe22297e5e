"""Validation of the packed variable-length layout: ``(total, heads, features)`` arrays and
the cumulative sequence offsets ``cu_seqlens_q`` / ``cu_seqlens_k``.

Sequence ``n`` holds queries ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` and keys
``cu_seqlens_k[n]:cu_seqlens_k[n + 1]`` (FlashAttention's and torch's ``varlen_attn``
convention). Everything is checked here, before any array work: the offsets must be
readable on the host (the call is split into its sequences by them), one-dimensional
integers starting at 0, non-decreasing and ending at the arrays' totals.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace, host_values, is_array_api_obj

__all__ = ["Packed", "check_packed"]


@dataclass(frozen=True)
class Packed:
    """The sequences of a packed call.

    Attributes
    ----------
    query_offsets, key_offsets : numpy.ndarray
        ``(N + 1,)`` int64 offsets of the ``N`` sequences' queries and keys.
    """

    query_offsets: np.ndarray
    key_offsets: np.ndarray

    @property
    def count(self) -> int:
        """The number of sequences ``N``."""
        return int(self.query_offsets.shape[0]) - 1

    def rows(self, n: int) -> slice:
        """Sequence ``n``'s queries."""
        return slice(int(self.query_offsets[n]), int(self.query_offsets[n + 1]))

    def keys(self, n: int) -> slice:
        """Sequence ``n``'s keys."""
        return slice(int(self.key_offsets[n]), int(self.key_offsets[n + 1]))


def _offsets(name: str, value: Any, total: int, total_name: str) -> np.ndarray:
    """``value`` as validated int64 host offsets ending at ``total``."""
    if isinstance(value, list | tuple):
        if not all(
            isinstance(v, numbers.Integral | np.integer) and not isinstance(v, bool | np.bool_)
            for v in value
        ):
            raise TypeError(f"{name} must hold integers, got {value!r}")
        host: np.ndarray | None = np.asarray(value, dtype=np.int64).reshape(len(value))
    elif isinstance(value, np.ndarray) or is_array_api_obj(value):
        if not _integral(name, value):
            raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
        host = host_values(value)
        if host is None:
            raise TypeError(
                f"{name} must be known on the host (a list, a NumPy array or a concrete "
                "array): the packed layout is split into its sequences by these offsets "
                "before any work, so they cannot be lazy (Dask) or traced (pass them to "
                "jax.jit as NumPy arrays or static arguments)"
            )
    else:
        raise TypeError(
            f"{name} must be a one-dimensional integer array or a list of ints, got "
            f"{type(value).__name__}"
        )
    host = np.asarray(host)
    if host.ndim != 1 or host.shape[0] < 1:
        raise ValueError(
            f"{name} must be one-dimensional with N + 1 >= 1 entries (N sequences), got shape "
            f"{tuple(host.shape)}"
        )
    host = host.astype(np.int64)
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(host[0])}")
    steps = np.diff(host)
    if steps.size and steps.min() < 0:
        at = int(np.argmin(steps))
        raise ValueError(
            f"{name} must be non-decreasing, got {int(host[at])} then {int(host[at + 1])} at "
            f"entries {at} and {at + 1}"
        )
    if host[-1] != total:
        raise ValueError(f"{name} must end at the {total_name} ({total}), got {int(host[-1])}")
    return host


def _integral(name: str, x: Any) -> bool:
    """Whether the array ``x`` (of any library) has an integer dtype."""
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "iu"
    return bool(array_namespace({name: x}).isdtype(x.dtype, "integral"))


def _check_max(name: str, value: Any, lengths: np.ndarray, side: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    longest = int(lengths.max(initial=0))
    if int(value) < longest:
        raise ValueError(
            f"{name}={int(value)} is shorter than the longest {side} sequence ({longest})"
        )


def check_packed(
    query: Any,
    key: Any,
    value: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
) -> Packed:
    """Validate a packed call's layout and offsets.

    ``query`` is ``(total_q, Hq, E)``, ``key`` ``(total_k, Hkv, E)`` and ``value``
    ``(total_k, Hkv, Ev)``; ``cu_seqlens_k=None`` takes the query offsets (then
    ``total_k == total_q``). ``max_seqlen_q``/``max_seqlen_k``, where given, must be at least
    the longest sequence.

    Raises
    ------
    TypeError
        Offsets that are not integers or cannot be read on the host; ``max_seqlen_*`` not
        an int.
    ValueError
        Arrays that are not three-dimensional or whose totals differ, offsets that are not
        one-dimensional, do not start at 0, decrease, do not end at the totals or count
        different sequences; a ``max_seqlen_*`` shorter than the longest sequence.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not is_array_api_obj(x):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != 3:
            raise ValueError(
                f"the packed layout needs {name} of shape (total, heads, features), got "
                f"{tuple(x.shape)}"
            )
    if key.shape[0] != value.shape[0]:
        raise ValueError(
            f"key and value must hold the same number of tokens, got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )
    total_q, total_k = int(query.shape[0]), int(key.shape[0])
    q_offsets = _offsets("cu_seqlens_q", cu_seqlens_q, total_q, "query total")
    if cu_seqlens_k is None:
        if total_k != total_q:
            raise ValueError(
                f"cu_seqlens_k is needed when key and query hold different numbers of tokens "
                f"({total_k} and {total_q})"
            )
        k_offsets = q_offsets
    else:
        k_offsets = _offsets("cu_seqlens_k", cu_seqlens_k, total_k, "key total")
    if k_offsets.shape != q_offsets.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must count the same sequences, got "
            f"{q_offsets.shape[0] - 1} and {k_offsets.shape[0] - 1}"
        )
    _check_max("max_seqlen_q", max_seqlen_q, np.diff(q_offsets), "query")
    _check_max("max_seqlen_k", max_seqlen_k, np.diff(k_offsets), "key")
    return Packed(q_offsets, k_offsets)
