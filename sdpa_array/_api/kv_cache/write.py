"""Writing the new tokens into the caches: in place where the library allows, else a copy.

:func:`write_tokens` writes ``new_key``/``new_value`` at token positions ``cache_lengths[b]
...`` of each sequence (through the block table for a paged cache). Libraries whose arrays
are immutable (JAX) build the new array natively (:data:`_FUNCTIONAL_WRITERS`); where the
positions are known on the device only, the update is a ``where`` over the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..._arrays.typing import Array
from ..._plan.kv_call import CacheCall

__all__ = ["write_tokens"]


def _jax_set(cache: Array, pages: Any, rows: Any, values: Array) -> Array:
    """``cache`` with ``cache[pages[n], :, rows[n], :] = values[n]``, as a new JAX array."""
    return cache.at[pages, :, rows, :].set(values)


#: Libraries whose arrays are immutable: the update builds the new array natively.
_FUNCTIONAL_WRITERS: dict[str, Callable[[Array, Any, Any, Array], Array]] = {"jax": _jax_set}

#: How to copy an array before writing into the copy, where ``xp.asarray(x, copy=True)``
#: does not fit (torch: ``clone`` keeps the autograd graph and warns about nothing).
_COPIERS: dict[str, Callable[[Array], Array]] = {"torch": lambda x: x.clone()}

#: Libraries whose arrays take an assignment through integer index arrays on their device,
#: ``cache[pages, :, rows, :] = values``, without reading the indices on the host.
_INDEXED_WRITES = frozenset({"torch", "cupy"})

#: Libraries whose ``x[...] = y`` would rebind the caller's object rather than write memory.
_NOT_IN_PLACE = frozenset({"dask"})


def _targets(c: CacheCall) -> tuple[Any, Any]:
    """Page index and row of every new token, ``(B * L,)`` each, sequence-major.

    Host NumPy arrays where lengths and block table are known, else arrays of the library.
    """
    xp, L, ps = c.xp, c.L, c.page_size
    lengths, table = c.host_lengths, c.host_table
    if lengths is not None and table is not None:
        t = np.asarray(lengths, dtype=np.int64)[:, None] + np.arange(L)
        pages = np.take_along_axis(table, t // ps, axis=1)
        return pages.reshape(-1), (t % ps).reshape(-1)
    dev = c.device
    n: Array = xp.asarray(lengths, device=dev) if lengths is not None else c.lengths
    t = xp.reshape(n, (c.B, 1)) + xp.reshape(xp.arange(L, dtype=n.dtype, device=dev), (1, L))
    if not c.paged:  # sequence b is page b (built on the device: nothing copied there)
        pages = xp.broadcast_to(
            xp.reshape(xp.arange(c.B, dtype=t.dtype, device=dev), (c.B, 1)), t.shape
        )
    else:
        on_device = xp.asarray(table, device=dev) if table is not None else c.table
        pages = xp.stack([xp.take(on_device[b, :], t[b, :] // ps, axis=0) for b in range(c.B)])
    return xp.reshape(pages, (-1,)), xp.reshape(t % ps, (-1,))


def _in_place(c: CacheCall, cache: Array, new: Array) -> bool:
    """Whether ``cache`` may be written into: writable, and no autograd graph involved."""
    if c.library in _NOT_IN_PLACE:
        return False
    if getattr(cache, "requires_grad", False) or getattr(new, "requires_grad", False):
        return False
    flags = getattr(cache, "flags", None)
    return flags is None or bool(getattr(flags, "writeable", True))


def _writable(c: CacheCall, cache: Array, new: Array) -> Array:
    """``cache`` itself where it may be written into (:func:`_in_place`), else a copy."""
    if _in_place(c, cache, new):
        return cache
    copy = _COPIERS.get(c.library)
    return copy(cache) if copy is not None else c.xp.asarray(cache, copy=True)


def _token_rows(c: CacheCall, new: Array) -> Array:
    """The new tokens ``(B, Hkv, L, E)`` as ``(B * L, Hkv, E)``, sequence-major like the
    targets of :func:`_targets`."""
    xp = c.xp
    return xp.reshape(xp.permute_dims(new, (0, 2, 1, 3)), (c.B * c.L, *new.shape[1:2], -1))


def _write_contiguous(c: CacheCall, lengths: tuple[int, ...], cache: Array, new: Array) -> Array:
    """A contiguous cache with lengths known on the host: one slice assignment where every
    sequence has the same length (a batch decoding in step), else one per sequence."""
    cache = _writable(c, cache, new)
    L, first = c.L, lengths[0]
    if all(n == first for n in lengths):
        cache[:, :, first : first + L, :] = new
        return cache
    for b, n in enumerate(lengths):
        cache[b, :, n : n + L, :] = new[b, ...]
    return cache


def _write_one(c: CacheCall, cache: Array, new: Array) -> Array:
    xp, L = c.xp, c.L
    writer = _FUNCTIONAL_WRITERS.get(c.library)
    lengths = c.host_lengths
    if writer is None and not c.paged and lengths is not None:
        return _write_contiguous(c, lengths, cache, new)
    pages, rows = _targets(c)
    if writer is not None:
        return writer(cache, pages, rows, _token_rows(c, new))
    if not isinstance(pages, np.ndarray):  # positions known on the device only
        if c.library in _INDEXED_WRITES:
            cache = _writable(c, cache, new)
            cache[pages, :, rows, :] = _token_rows(c, new)
            return cache
        grid_p = xp.reshape(xp.arange(cache.shape[0], device=c.device), (-1, 1, 1, 1))
        grid_r = xp.reshape(xp.arange(c.page_size, device=c.device), (1, 1, -1, 1))
        for n in range(c.B * L):
            b, i = divmod(n, L)
            at = (grid_p == pages[n]) & (grid_r == rows[n])
            cache = xp.where(at, xp.expand_dims(new[b, :, i : i + 1, :], axis=0), cache)
        return cache
    cache = _writable(c, cache, new)
    for b in range(c.B):  # runs of consecutive rows within one page
        i = 0
        while i < L:
            n = b * L + i
            page, row = int(pages[n]), int(rows[n])
            run = min(L - i, c.page_size - row)
            cache[page, :, row : row + run, :] = new[b, :, i : i + run, :]
            i += run
    return cache


def write_tokens(c: CacheCall) -> tuple[Array, Array]:
    """The caches holding the new tokens (see Returns in the public docstring)."""
    if c.new_key is None or c.new_tokens == 0 or c.B == 0:
        return c.key_cache, c.value_cache
    return _write_one(c, c.key_cache, c.new_key), _write_one(c, c.value_cache, c.new_value)
