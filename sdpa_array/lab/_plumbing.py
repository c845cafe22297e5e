"""What every experiment does the same way: pick the backend, draw, copy back to the host.

Private: the experiments import these helpers; nothing else should.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays.compat import array_namespace
from ..reference import to_numpy
from ..testing.backends import Backend, get_backend

__all__ = ["configured", "host", "namespace_of", "normal"]


def configured(backend: Backend | str) -> Backend:
    """The backend, configured for exact float64 work (:meth:`Backend.configure`)."""
    b = get_backend(backend) if isinstance(backend, str) else backend
    b.configure()
    return b


def namespace_of(**arrays: Any) -> Any:
    """The Array-API namespace the named arrays share (names appear in its errors)."""
    return array_namespace(arrays)


def normal(backend: Backend, rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> Any:
    """Standard normal draws made by NumPy, copied onto the backend's device."""
    return backend.asarray(rng.standard_normal(shape), dtype)


def host(x: Any) -> np.ndarray:
    """A float64 NumPy copy of a backend array (computes Dask, copies from GPUs)."""
    return to_numpy(x).astype(np.float64)
