"""Drop-in adapters that run other frameworks' models through this library.

Each submodule imports its framework when it is imported (never by ``import
sdpa_array``):

- :mod:`sdpa_array.integrations.transformers`: an attention function for Hugging Face
  transformers' ``AttentionInterface`` (``register()``, then
  ``attn_implementation="array_attention"``).
"""
