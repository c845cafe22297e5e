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
from ..._plan import cache
from ..._plan.decode import DecodePlan, direct_key
from ..._plan.kv_call import CacheCall
from ..forward import scaled_dot_product_attention
from ..layout import check_layout, swap_heads_and_length
from .args import check_call
from .chunks import single_call

__all__ = ["gather", "keep", "result", "run_kept"]

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


def run_kept(arguments: Mapping[str, Any]) -> tuple[Any, tuple[Array, ...] | None]:
    """``(key, result)`` of the cache function's ``arguments``: the key of a plain call
    (:func:`~sdpa_array._plan.decode.direct_key`, ``None`` for another) and, where a call
    of that key was planned as one forward call over the cache's tokens, that call's
    result (the output and the caches, which a plain call does not write); else ``None``."""
    key = direct_key(arguments)
    kept = cache.decode_direct(key)
    if kept is None:
        return key, None
    lo, n, keywords = kept
    key_cache, value_cache = arguments["key_cache"], arguments["value_cache"]
    keys, values = key_cache[:, :, lo:n, :], value_cache[:, :, lo:n, :]
    out = scaled_dot_product_attention(arguments["query"], keys, values, **keywords)
    return key, (out, key_cache, value_cache)


def keep(key: Any, plan: DecodePlan, caches: tuple[Array, Array]) -> None:
    """Keep a plain call's one forward call (its span and keywords) for its ``key``, where
    the plan is one forward call with no mask or bias and the output alone asked for."""
    c = plan.call
    if key is None or plan.span is None or c.mask is not None or c.bias is not None:
        return
    if c.return_lse or c.return_max_scores:
        return
    cache.keep_decode_direct(key, plan.span, single_call(plan, caches)[3])
