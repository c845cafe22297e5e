"""The cache function's arguments gathered once, and its result shaped, for
:func:`~sdpa_array._api.kv_cache.api.attention_with_kv_cache` and
:func:`~sdpa_array._api.explain_cache.explain_kv_cache` alike.

A ``"BLHE"`` call is checked and run heads first on views of the caller's arrays; its output
is swapped back and the caller's caches are returned where the tokens were written into them
in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._arrays.typing import Array
from ..._plan.kv_call import CacheCall
from ..layout import check_layout, swap_heads_and_length
from .args import check_call

__all__ = ["gather", "result"]

#: The cache function's array arguments, in the order they are swapped for ``"BLHE"``.
ARRAYS = ("query", "key_cache", "value_cache", "new_key", "new_value")


def gather(arguments: Mapping[str, Any]) -> tuple[CacheCall, tuple[Array, Array] | None]:
    """The checked call of the cache function's ``arguments`` (its ``locals()``), heads
    first, and for a ``"BLHE"`` call the caller's two caches (``None`` otherwise)."""
    arrays = tuple(arguments[name] for name in ARRAYS)
    layout = arguments["layout"]
    check_layout(layout, dict(zip(ARRAYS, arrays, strict=True)))
    given = None
    if layout == "BLHE":  # computed heads first on views
        given = (arrays[1], arrays[2])
        arrays = swap_heads_and_length(*arrays)
    call = check_call(
        *arrays[:3],
        cache_lengths=arguments["cache_lengths"],
        new_key=arrays[3],
        new_value=arrays[4],
        block_table=arguments["block_table"],
        num_splits=arguments["num_splits"],
        options=arguments["options"],
        cache_leftpad=arguments["cache_leftpad"],
    )
    return call, given


def result(
    c: CacheCall,
    given: tuple[Array, Array] | None,
    found: tuple[Array | None, Array | None, Array | None],
    caches: tuple[Array, Array],
) -> tuple[Array, ...]:
    """The public result: the output, the log-sum-exp and maximum scores where asked for
    (of ``found``), then the caches holding the new tokens; for a ``"BLHE"`` call the
    output swapped back and the caller's caches ``given`` where the views were written in
    place."""
    out, lse, max_scores = found
    extras = [lse] if c.return_lse else []
    if c.return_max_scores:
        extras.append(max_scores)
    if given is None:
        return (out, *extras, *caches)
    views = (c.key_cache, c.value_cache)
    returned = [
        mine if got is view else swap_heads_and_length(got)[0]
        for got, view, mine in zip(caches, views, given, strict=True)
    ]
    return (swap_heads_and_length(out)[0], *extras, *returned)
