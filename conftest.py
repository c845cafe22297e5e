"""Collection settings for the doctests of the package (``--doctest-modules sdpa_array``).

``sdpa_array/_api/torch_module.py`` defines a torch module and imports torch, which is
optional: where torch is not installed, its doctests are not collected.
"""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    collect_ignore.append("sdpa_array/_api/torch_module.py")
