"""A checked call of :func:`~sdpa_array.attention_with_kv_cache`: what the decoding planner
(:mod:`.decode`) and the kernels it chooses read.

The public face checks every argument into a :class:`CacheCall` (its checks live with it,
in ``sdpa_array._api.kv_cache.args``); nothing is computed yet. The record is kept here,
below the face, so that the planner can take it as the forward's planner takes a
:class:`~sdpa_array._problem.problem.Problem`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import namespace_name
from .._arrays.typing import Array
from .._problem.problem import Problem

__all__ = ["PER_CALL", "CacheCall"]


@dataclass(frozen=True)
class CacheCall:
    """A checked call: the arrays, the cache layout and the options, nothing computed yet.

    A contiguous cache is described as a paged one with one page per sequence: page ``b``
    holds sequence ``b``, ``page_size`` is ``S_max`` and the block table is ``[[0], [1],
    ...]``, so that every token position maps to ``(page, row)`` the same way.

    Attributes
    ----------
    lengths : tuple of int, or array
        ``cache_lengths`` read on the host, or the caller's array where it cannot be read.
    starts : tuple of int, array or None
        ``cache_leftpad`` read on the host, or the caller's array; ``None``: every
        sequence starts at token 0.
    table : numpy.ndarray or array
        The block table ``(B, max_pages)``, on the host where it could be read.
    mask, bias : array or None
        The caller's terms with leading axes added up to 4 (``(B|1, Hq|1, L|1, T|1)``).
    passed : dict
        ``scale``, ``softcap``, ``enable_gqa`` and ``implementation`` as the caller gave
        them: what every forward call that attends the cache is given.
    problem : Problem
        The query's checks (scale, softcap, dtype and device resolved) on a stand-in for
        the keys with no token.
    signature : tuple or None
        What the call's checks and the static part of its plan depend on, besides the
        values of the lengths, starts and block table (:func:`.decode.call_signature`);
        ``None`` where that is more than a signature (an array among the options, arrays
        of a library whose checks are not kept).
    """

    xp: ModuleType
    device: Any
    query: Array
    key_cache: Array
    value_cache: Array
    new_key: Array | None
    new_value: Array | None
    paged: bool
    page_size: int
    capacity: int
    lengths: tuple[int, ...] | Array
    starts: tuple[int, ...] | Array | None
    table: np.ndarray | Array
    num_splits: int | None
    mask: Array | None
    bias: Array | None
    is_causal: bool
    window: tuple[int | None, int | None] | None
    passed: dict[str, Any]
    return_lse: bool
    return_max_scores: bool
    problem: Problem
    implementation: str
    signature: tuple[Any, ...] | None = None

    @property
    def B(self) -> int:
        return int(self.query.shape[0])

    @property
    def L(self) -> int:
        return int(self.query.shape[2])

    @property
    def new_tokens(self) -> int:
        """Tokens written before attending: ``L`` with ``new_key``, else 0."""
        return self.L if self.new_key is not None else 0

    @property
    def host_lengths(self) -> tuple[int, ...] | None:
        return self.lengths if isinstance(self.lengths, tuple) else None

    @property
    def host_table(self) -> np.ndarray | None:
        return self.table if isinstance(self.table, np.ndarray) else None

    @property
    def library(self) -> str:
        return namespace_name(self.xp)

    def setup(self) -> dict[str, Any]:
        """The fields that the call's :attr:`signature` determines: all but
        :data:`PER_CALL` (the arrays and the integer arguments' values)."""
        return {name: getattr(self, name) for name in _SETUP}


#: The fields of a :class:`CacheCall` that differ between calls of one signature: the
#: arrays, the lengths, starts and block table, and what the block table's width decides
#: (the capacity, the window bounded by it, the terms checked against it).
PER_CALL = frozenset(
    {
        "query",
        "key_cache",
        "value_cache",
        "new_key",
        "new_value",
        "lengths",
        "starts",
        "table",
        "capacity",
        "window",
        "mask",
        "bias",
    }
)

_SETUP = tuple(name for name in CacheCall.__dataclass_fields__ if name not in PER_CALL)
