"""Collection settings for the doctests of the package (``--doctest-modules sdpa_array``).

Modules that import an optional framework at their top are not collected where it is not
installed: ``sdpa_array/_api/torch_module.py`` (torch), the integrations (their
examples need torch and transformers, or JAX and Flax) and context parallelism's torch and
JAX rings.
"""

import importlib.util

NEEDS = {
    "sdpa_array/_api/torch_module.py": ("torch",),
    "sdpa_array/integrations/transformers.py": ("torch", "transformers"),
    "sdpa_array/integrations/_transformers_masks.py": ("torch", "transformers"),
    "sdpa_array/integrations/flax.py": ("jax", "flax"),
    "sdpa_array/distributed/_torch.py": ("torch",),
    "sdpa_array/distributed/_jax.py": ("jax",),
}

collect_ignore = [
    path
    for path, modules in NEEDS.items()
    if any(importlib.util.find_spec(m) is None for m in modules)
]
