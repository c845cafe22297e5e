"""Releasing the memory the library keeps between calls: :func:`release_memory`."""

from __future__ import annotations

import ctypes
import sys

from .._plan.run import release_kept
from .jax_eager import clear_compiled

__all__ = ["release_memory"]


def release_memory() -> None:
    """Release what the library keeps between calls.

    Drops the scratch buffers of the NumPy products, the kept plans of repeated calls and
    of causal and window tilings, and the compiled programs of eager JAX calls; ends the
    threads of the NumPy block pool (:func:`set_num_threads`); then, where the C library is
    glibc, returns the free memory of its heaps to the system (``malloc_trim(0)``). Later
    calls work as before: they plan, compile and start the pool's threads again.

    What is kept is bounded whatever the number of threads that call: a few scratch
    buffers of at most 4 MiB per dtype, a few hundred plans, the pool's threads (at most
    :func:`get_num_threads` of them, and their C heaps). This function is for a process
    that is done with attention for a while, or that measures its own memory.

    Examples
    --------
    >>> import numpy as np
    >>> import sdpa_array
    >>> q = np.ones((1, 2, 8, 4), dtype=np.float32)
    >>> out = sdpa_array.scaled_dot_product_attention(q, q, q, implementation="blocked")
    >>> sdpa_array.release_memory()
    >>> again = sdpa_array.scaled_dot_product_attention(q, q, q, implementation="blocked")
    >>> bool(np.array_equal(out, again))
    True
    """
    release_kept()
    clear_compiled()
    _trim_c_heap()


def _trim_c_heap() -> None:
    """``malloc_trim(0)`` where the process runs on glibc: the free pages of every heap and
    the free top of the main one go back to the system. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols the process has loaded
    except (AttributeError, OSError):  # another C library (musl has no malloc_trim)
        return
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
