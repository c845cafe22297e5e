"""Updates in place where the array allows it: the one place that decides.

NumPy, CuPy, array-api-strict and torch (outside autograd) update an array in place, which
saves a temporary per tile; JAX and Dask arrays are immutable, and their ``x -= y`` already
rebinds. A torch tensor that takes part in autograd must not be changed in place (the
values saved for its backward pass would change), nor can a tensor combined with one that a
``torch.func`` transform wraps (under ``vmap`` the other operand may hold more elements than
it shows), and a read-only NumPy array cannot be.
The kernels call :func:`add`, :func:`subtract` and :func:`multiply` on arrays they created
themselves.
"""

from __future__ import annotations

import sys

from .._typing import Array

__all__ = ["add", "multiply", "subtract"]


def _functorch_wrapped(a: Array) -> bool:
    """Whether ``a`` is a tensor wrapped by a ``torch.func`` transform (``vmap``, ``grad``)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(a, torch.Tensor):
        return False
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(a))


def _in_place(x: Array, y: Array) -> bool:
    """Whether ``x`` may take the result of ``x op y``: its shape holds it and it is writable."""
    xs, ys = tuple(x.shape), tuple(getattr(y, "shape", ()))
    if len(ys) > len(xs) or any(b not in (1, a) for a, b in zip(xs[::-1], ys[::-1], strict=False)):
        return False
    if getattr(x, "requires_grad", False) or getattr(y, "requires_grad", False):
        return False
    if _functorch_wrapped(x) or _functorch_wrapped(y):
        return False
    flags = getattr(x, "flags", None)
    return flags is None or bool(getattr(flags, "writeable", True))


def add(x: Array, y: Array) -> Array:
    """``x + y``, written into ``x`` where that is allowed; use the returned array."""
    if _in_place(x, y):
        x += y
        return x
    return x + y


def subtract(x: Array, y: Array) -> Array:
    """``x - y``, written into ``x`` where that is allowed; use the returned array."""
    if _in_place(x, y):
        x -= y
        return x
    return x - y


def multiply(x: Array, y: Array) -> Array:
    """``x * y``, written into ``x`` where that is allowed; use the returned array."""
    if _in_place(x, y):
        x *= y
        return x
    return x * y
