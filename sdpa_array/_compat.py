"""The only module that imports :mod:`array_api_compat`.

Everything else in the package asks this module for an array's namespace and device, so the
dependency is visible in one place.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import array_api_compat
from array_api_compat import device, is_array_api_obj, is_jax_namespace, is_torch_namespace

__all__ = [
    "array_namespace",
    "device",
    "is_array_api_obj",
    "is_jax_namespace",
    "is_torch_namespace",
    "namespace_name",
]


def array_namespace(named: dict[str, Any]) -> ModuleType:
    """Return the one Array-API namespace shared by the named arrays.

    Parameters
    ----------
    named : dict of str to array or None
        Argument name to value; ``None`` values are ignored.

    Raises
    ------
    TypeError
        If a value is not an array, or the arrays come from different libraries. The message
        names the arguments and their types.
    """
    present = {k: v for k, v in named.items() if v is not None}
    for name, value in present.items():
        if not is_array_api_obj(value):
            raise TypeError(
                f"{name} must be an array (NumPy, CuPy, torch, JAX, Dask or array-api-strict), "
                f"got {type(value).__module__}.{type(value).__qualname__}"
            )
    try:
        return array_api_compat.array_namespace(*present.values())
    except TypeError as exc:
        kinds = ", ".join(
            f"{k}: {type(v).__module__}.{type(v).__qualname__}" for k, v in present.items()
        )
        raise TypeError(
            f"query, key, value, mask and bias must come from one array library; got {kinds}"
        ) from exc


def namespace_name(xp: ModuleType) -> str:
    """Short library name of a namespace, for messages (``'numpy'``, ``'torch'``...)."""
    name = xp.__name__.removeprefix("array_api_compat.")
    return name.split(".")[0]
