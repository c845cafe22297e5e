"""The registry of array backends; the same names as :mod:`sdpa_array.testing.backends`."""

from .testing.backends import (
    BACKENDS,
    Backend,
    BackendUnavailable,
    available_backends,
    get_backend,
)

__all__ = ["BACKENDS", "Backend", "BackendUnavailable", "available_backends", "get_backend"]
