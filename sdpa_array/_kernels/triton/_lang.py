"""Triton's modules where they are installed, so that the kernel modules import without it.

The kernel modules take ``triton``, ``tl`` and :func:`jit` from here. Without triton they
still import (the doctest collection imports every module of the package), their kernels
stay plain Python functions, and :func:`~sdpa_array._kernels.triton.plan_triton` refuses
every call before one could run. With ``TRITON_INTERPRET=1`` set before this import,
triton's interpreter runs the same kernels on CPU torch tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["IMPORT_ERROR", "constant", "jit", "tl", "triton"]


def _load() -> tuple[Any, Any, str | None]:
    try:
        return importlib.import_module("triton"), importlib.import_module("triton.language"), None
    except ImportError as exc:  # triton is optional
        return None, None, str(exc)


#: ``triton`` and ``triton.language`` (``None`` when triton is not installed), and the
#: import error's message then.
triton, tl, IMPORT_ERROR = _load()


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` (a kernel is launched as ``kernel[grid](...)``), or ``fn`` unchanged
    when triton is not installed (never launched then)."""
    return fn if triton is None else triton.jit(fn)


def constant(value: float) -> Any:
    """A module-level constant a kernel may read (``tl.constexpr`` where triton exists)."""
    return value if tl is None else tl.constexpr(value)
