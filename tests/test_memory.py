"""Memory the library keeps between calls: bounded whatever the number of threads that call,
and released by :func:`sdpa_array.release_memory`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import sdpa_array
from sdpa_array._api.jax_eager import _compiled
from sdpa_array._arrays import parallel, products
from sdpa_array._kernels import tiling
from sdpa_array._plan import cache

# Calls from user threads on the NumPy pool, in a fresh process: the growth of its resident
# memory (after gc.collect()) in MiB, printed last. glibc keeps up to eight heaps ("arenas")
# per CPU; MALLOC_ARENA_MAX=64 gives this process the arenas of an 8-CPU machine.
_SCENARIO = textwrap.dedent(
    """
    import gc, os, sys, threading
    import numpy as np
    import sdpa_array

    threads, calls = int(sys.argv[1]), int(sys.argv[2])
    sdpa_array.set_num_threads(4)
    page = os.sysconf("SC_PAGE_SIZE")

    def resident():
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 512, 64), dtype=np.float32) for _ in range(3))

    def call():
        return sdpa_array.scaled_dot_product_attention(q, k, v, implementation="blocked")

    shape = call().shape
    before = resident()
    same = []

    def work():
        for _ in range(-(-calls // threads)):
            same.append(call().shape == shape)

    started = [threading.Thread(target=work) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    assert all(same) and len(same) >= calls
    workers = [t for t in threading.enumerate() if t.name.startswith("sdpa_array")]
    assert len(workers) <= 4, len(workers)
    print(resident() - before)
    """
)


def _growth(threads: int, calls: int) -> float:
    env = {**os.environ, "MALLOC_ARENA_MAX": "64", "PYTHONPATH": os.getcwd()}
    run = subprocess.run(
        [sys.executable, "-c", _SCENARIO, str(threads), str(calls)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout.split()[-1])


@pytest.mark.slow
def test_memory_kept_after_calls_from_eight_threads_is_bounded():
    """200 blocked calls from 8 threads on the NumPy pool keep at most 32 MiB more than
    before them (threads started per call left 40-54 MiB in glibc's arenas)."""
    growth = _growth(8, 200)
    assert growth <= 32, f"{growth:.1f} MiB kept"


@pytest.mark.slow
def test_calls_from_sixty_four_threads_share_the_pool():
    """Calls from 64 threads at once run on the pool's 4 threads and leave at most 4 of
    them (threads started per call put 256 threads into
    OpenBLAS at once, which aborted the process)."""
    _growth(64, 128)


def test_release_memory_drops_what_the_library_keeps():
    """After calls that keep scratch buffers, plans and the pool's threads,
    :func:`sdpa_array.release_memory` leaves none of them; a later call gives the same
    result."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 300, 64)).astype(np.float32) * 40 for _ in range(3))
    previous = parallel._override
    parallel.set_num_threads(2)
    try:
        want = sdpa_array.scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation="blocked", block_q=64, block_k=64
        )
        assert products._kept.get(np.dtype(np.float32))  # the large scores took scratch
        assert parallel._executor is not None
        assert tiling._band_plan.cache_info().currsize > 0
        sdpa_array.release_memory()
        assert not products._kept
        assert parallel._executor is None
        assert tiling._band_plan.cache_info().currsize == 0
        assert not cache._entries
        assert not cache._direct
        assert _compiled.cache_info().currsize == 0
        again = sdpa_array.scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation="blocked", block_q=64, block_k=64
        )
        np.testing.assert_array_equal(again, want)
    finally:
        parallel._override = previous
