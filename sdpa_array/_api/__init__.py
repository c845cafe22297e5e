"""The public entries: the forward (:mod:`.forward`), the VJP (:mod:`.vjp`),
:func:`~sdpa_array.explain` (:mod:`.explain`) and KV-cache decoding (:mod:`.kv_cache`),
which calls the forward."""
