"""Decoding attention over a KV cache, contiguous or paged: check, plan, write, attend.

:func:`attention_with_kv_cache` (:mod:`.api`) is the public face. It checks every argument
first (:mod:`.args`), asks the planner which kernel attends the call
(:func:`~sdpa_array._plan.decode.plan_decode`: the Triton decoding kernel, one call of
:func:`~sdpa_array.scaled_dot_product_attention` over a slice of a contiguous cache, or
split-KV chunks), writes the new tokens into the caches (:mod:`.write`), then runs the
plan's choice: the decoding kernel through the planner, the other two here (:mod:`.chunks`:
each chunk attended with :func:`~sdpa_array.scaled_dot_product_attention` on that chunk's
keys only, on NumPy's thread pool, and each sequence's chunks merged with
:func:`~sdpa_array.merge_attention_states`, split-K "flash-decoding").
:func:`~sdpa_array._api.explain_cache.explain_kv_cache` reports the plan without running it.

Everything but the Triton kernel is Array-API code; the only per-library choices are how
the new tokens are written (:mod:`.write`) and how a small integer array is read on the host
(:mod:`.args`).
"""

from .api import attention_with_kv_cache
from .chunks import CHUNK_BYTES, CHUNK_MAX_TOKENS

__all__ = ["CHUNK_BYTES", "CHUNK_MAX_TOKENS", "attention_with_kv_cache"]
