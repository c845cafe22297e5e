"""Running independent query blocks concurrently: the one place that does, NumPy only.

NumPy runs its matrix products on a multi-threaded BLAS, but ``exp``, ``max``, ``sum`` and
``where`` on one core. The blocked implementation's query blocks are independent and NumPy
releases the GIL inside its loops, so a small thread pool runs the element-wise work of
several blocks at once. While the pool runs, BLAS is limited to one thread per call (with
`threadpoolctl <https://github.com/joblib/threadpoolctl>`_, a dependency of this package):
each of our threads then does its own products, instead of every product starting BLAS's
threads on cores that are already busy, which would oversubscribe them (measured: 1 to 9 s
instead of 0.2 s).

The pool is one per process, shared by the calls of every thread, and its threads are kept
between calls: each call hands its blocks to at most the configured number of them and waits.
Threads started for each call would make the C allocator (glibc) serve each new thread from
one of its per-thread arenas, of which it keeps up to eight per CPU, and an arena keeps the
freed memory at its top (up to its trim threshold, which rises to twice the largest array
freed, a score tile's) for the next thread: the memory a process keeps after calls from many
threads would grow with their number (42-54 MiB after 200 calls of 1x4x512x512x64 from 8
threads with the arenas of 8 CPUs, against 11 MiB on the shared pool; tests/test_memory.py).
The pool's threads stay few, whichever threads call. A call made from one of the pool's threads (a
block that calls attention itself) runs its blocks in that thread, one after the other.
:func:`release_pool` ends the pool's threads (the next call starts them again).

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
    "release_pool",
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

    Examples
    --------
    >>> import sdpa_array
    >>> sdpa_array.set_num_threads(2)
    >>> sdpa_array.get_num_threads()
    2
    >>> sdpa_array.set_num_threads(None)  # back to the default
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

    Examples
    --------
    >>> import sdpa_array
    >>> sdpa_array.get_num_threads() >= 1
    True
    >>> sdpa_array.set_num_threads(1)  # run the blocks one after the other
    >>> sdpa_array.get_num_threads()
    1
    >>> sdpa_array.set_num_threads(None)
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
    """``[fn(item) for item in items]``, on the shared thread pool for NumPy when configured.

    The results keep the order of ``items``; every item runs, and the exception of the first
    item (in their order) that raised one is raised here. At most :func:`get_num_threads`
    of the pool's threads take the items, each the next one left. With ``costs`` (one per
    item, in any unit), they take the items in decreasing cost (longest first: the items
    left for the last free thread are the cheapest, so the threads finish close together).
    Called from one of the pool's threads, the items run there, one after the other.
    """
    threads = get_num_threads() if namespace_name(xp) in THREADED_LIBRARIES else 1
    threads = min(threads, len(items))
    if threads <= 1 or getattr(_worker, "active", False):
        return [fn(item) for item in items]
    order: list[int] = list(range(len(items)))
    if costs is not None:
        order = sorted(order, key=lambda i: -costs[i])  # stable: ties keep their order
    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException] = {}
    queue = iter(order)
    taking = threading.Lock()

    def take() -> None:
        while True:
            with taking:
                i = next(queue, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as error:  # raised in the caller's thread below
                errors[i] = error

    with _single_threaded_blas():
        runners = [_pool(threads).submit(take) for _ in range(threads)]
        for runner in runners:
            runner.result()
    if errors:
        raise errors[min(errors)]
    return results


#: The shared pool, its number of threads, and the lock that creates or ends it.
_executor: ThreadPoolExecutor | None = None
_executor_threads = 0
_executor_lock = threading.Lock()
#: ``active`` is set in the pool's threads.
_worker = threading.local()


def _mark_worker() -> None:
    _worker.active = True


def _pool(threads: int) -> ThreadPoolExecutor:
    """The shared pool, with at least ``threads`` threads (a larger one replaces it, whose
    threads end once their work is done)."""
    global _executor, _executor_threads
    with _executor_lock:
        if _executor is None or _executor_threads < threads:
            if _executor is not None:
                _executor.shutdown(wait=False)
            _executor = ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix="sdpa_array", initializer=_mark_worker
            )
            _executor_threads = threads
        return _executor


def release_pool() -> None:
    """End the shared pool's threads once their work is done (the next pooled call starts a
    new pool)."""
    global _executor, _executor_threads
    with _executor_lock:
        executor, _executor, _executor_threads = _executor, None, 0
    if executor is not None:
        executor.shutdown(wait=False)


def _forget_pool_in_child() -> None:
    """In a forked child the pool's threads do not exist: the next call starts new ones."""
    global _executor, _executor_threads, _executor_lock
    _executor, _executor_threads, _executor_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_pool_in_child)


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
