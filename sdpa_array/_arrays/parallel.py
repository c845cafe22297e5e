"""Running independent query blocks concurrently: the one place that does, NumPy only.

NumPy runs its matrix products on a multi-threaded BLAS, but ``exp``, ``max``, ``sum`` and
``where`` on one core. The blocked implementation's query blocks are independent and NumPy
releases the GIL inside its loops, so a small thread pool runs the element-wise work of
several blocks at once. While the pool runs, BLAS is limited to one thread per call (with
`threadpoolctl <https://github.com/joblib/threadpoolctl>`_, a dependency of this package):
each of our threads then does its own products, instead of every product starting BLAS's
threads on cores that are already busy, which would oversubscribe them (docs/performance.md
has the measurements).

Other libraries parallelise (torch, JAX on CPU), defer (Dask) or queue on a device (CuPy,
CUDA) by themselves, so for them blocks always run one after the other here.

Configuration, in order of precedence:

1. :func:`set_num_threads` (``None`` restores the default);
2. the environment variable ``SDPA_ARRAY_NUM_THREADS`` (read at each call);
3. the default: the number of CPUs this process may use, at most
   :data:`DEFAULT_MAX_THREADS`.

``1`` disables the pool.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

from threadpoolctl import ThreadpoolController

from .compat import namespace_name

__all__ = [
    "DEFAULT_MAX_THREADS",
    "ENV_VAR",
    "get_num_threads",
    "map_blocks",
    "set_num_threads",
]

T = TypeVar("T")
R = TypeVar("R")

#: Upper bound of the default pool size.
DEFAULT_MAX_THREADS = 4

#: Namespaces (as :func:`namespace_name` spells them) whose element-wise work runs on one
#: core and releases the GIL, so that concurrent blocks help.
THREADED_LIBRARIES = frozenset({"numpy"})

#: Environment variable that sets the number of threads.
ENV_VAR = "SDPA_ARRAY_NUM_THREADS"

_override: int | None = None


def set_num_threads(n: int | None) -> None:
    """Set the number of threads for NumPy blocks (``1`` = sequential, ``None`` = default).

    Parameters
    ----------
    n
        Threads for the blocked path on NumPy arrays, process-wide; takes precedence over
        ``SDPA_ARRAY_NUM_THREADS``. ``None`` restores the default (that variable if set,
        else the number of CPUs this process may use, at most 4).

    Raises
    ------
    ValueError
        If ``n`` is not a positive int or None.
    """
    global _override
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"number of threads must be a positive int or None, got {n!r}")
    _override = n


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def get_num_threads() -> int:
    """Threads the NumPy blocked path uses now.

    :func:`set_num_threads`'s value if set, else ``SDPA_ARRAY_NUM_THREADS``, else the number
    of CPUs this process may use, at most 4.

    Returns
    -------
    int
        The pool size; ``1`` means the blocks run one after the other.

    Raises
    ------
    ValueError
        If ``SDPA_ARRAY_NUM_THREADS`` is set to something other than a positive integer.
    """
    if _override is not None:
        return _override
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{ENV_VAR} must be a positive integer, got {raw!r}")
        return value
    return max(1, min(_cpus(), DEFAULT_MAX_THREADS))


def map_blocks(
    xp: ModuleType,
    fn: Callable[[T], R],
    items: Sequence[T],
    costs: Sequence[float] | None = None,
) -> list[R]:
    """``[fn(item) for item in items]``, on a thread pool for NumPy when configured.

    The results keep the order of ``items``; an exception in any ``fn`` is raised here.
    With ``costs`` (one per item, in any unit), the pool takes the items in decreasing cost
    (longest first: the items left for the last free thread are the cheapest, so the
    threads finish close together).
    """
    threads = get_num_threads() if namespace_name(xp) in THREADED_LIBRARIES else 1
    threads = min(threads, len(items))
    if threads <= 1:
        return [fn(item) for item in items]
    order: list[int] = list(range(len(items)))
    if costs is not None:
        order = sorted(order, key=lambda i: -costs[i])  # stable: ties keep their order
    with (
        _single_threaded_blas(),
        ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sdpa_array") as pool,
    ):
        futures = {i: pool.submit(fn, items[i]) for i in order}
        return [futures[i].result() for i in range(len(items))]


# Created at the first pooled call: building it inspects the loaded native libraries.
_controller: ThreadpoolController | None = None
# Calls running a pool now, and the BLAS limits the first of them found (restored by the
# last): concurrent calls share one limit instead of each restoring what the one before it
# set.
_lock = threading.Lock()
_holders = 0
_originals: list[tuple[Any, int]] = []


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """Limit BLAS to one thread per call while any pool runs (process-wide).

    The first of the concurrent calls records each BLAS library's thread count and sets it
    to 1; the last one to end restores the recorded counts, except in a library whose count
    the caller changed meanwhile (it is no longer 1): the caller's setting stays.
    """
    global _controller, _holders
    with _lock:
        if _holders == 0:
            if _controller is None:
                _controller = ThreadpoolController()
            libraries = _controller.select(user_api="blas").lib_controllers
            _originals[:] = [(lib, lib.num_threads) for lib in libraries]
            for lib, _ in _originals:
                lib.set_num_threads(1)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                for lib, threads in _originals:
                    if lib.num_threads == 1:
                        lib.set_num_threads(threads)
                _originals.clear()
