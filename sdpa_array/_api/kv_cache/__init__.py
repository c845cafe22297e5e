"""Decoding attention over a KV cache, contiguous or paged: write, attend, merge.

:func:`attention_with_kv_cache` (:mod:`.api`) is the public face. It checks every argument
first (:mod:`.args`), writes the new tokens into the caches (:mod:`.write`), then attends:
through the Triton decoding kernel where it applies (:mod:`.decode`), else chunk by chunk
(:mod:`.chunks`): each sequence's attended tokens are cut into chunks, every chunk is
attended with :func:`~sdpa_array.scaled_dot_product_attention` on that chunk's keys only,
on NumPy's thread pool, and each sequence's chunks are merged with
:func:`~sdpa_array.merge_attention_states` (split-K "flash-decoding").

Everything but the Triton kernel is Array-API code; the only per-library choices are how
the new tokens are written (:mod:`.write`) and how a small integer array is read on the host
(:mod:`.args`).
"""

from .api import attention_with_kv_cache
from .chunks import CHUNK_BYTES, CHUNK_MAX_TOKENS

__all__ = ["CHUNK_BYTES", "CHUNK_MAX_TOKENS", "attention_with_kv_cache"]
