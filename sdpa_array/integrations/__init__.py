"""Drop-in adapters that run other frameworks' models through this library.

Each submodule is imported on its own (never by ``import sdpa_array``); the transformers
adapter imports torch:

- :mod:`sdpa_array.integrations.transformers`: an attention function for Hugging Face
  transformers' ``AttentionInterface`` (``register()``, then
  ``attn_implementation="array_attention"``).
- :mod:`sdpa_array.integrations.flax`: ``attention_fn`` for Flax's attention layers
  (``nnx.MultiHeadAttention(..., attention_fn=attention_fn)`` and linen's).
"""
