"""Tiles planned for a GPU, checked on the CPU: few large launches, no host synchronisation.

:func:`sdpa_array._kernels.tiling.gpu_plans` makes a call plan its tiles as it would for
arrays on a GPU (one tile holds every batch element and head and all keys of its rows).
torch's dispatch mode counts the operations a call runs: on a GPU each is a kernel launch,
and an operation that reads a device value on the host (``.item()``, a boolean index,
``nonzero``) is a host synchronisation.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

import sdpa_array
from sdpa_array._kernels import tiling
from tests.helpers import check_against_oracle, check_vjp_against_oracle

#: aten operations that wait for the device: they read a value or a count on the host.
SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "item", "equal", "is_nonzero")


def count_ops(fn: Any) -> Counter:
    """The aten operations ``fn()`` runs, by name (without overload)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return seen


def call(torch_backend, shape, kv_shape=None, *, vjp=False, **options):
    rng = np.random.default_rng(0)
    q = torch_backend.asarray(rng.standard_normal(shape), "float32")
    kv = q if kv_shape is None else torch_backend.asarray(rng.standard_normal(kv_shape), "float32")
    if vjp:
        g = torch_backend.asarray(rng.standard_normal(shape), "float32")
        return lambda: sdpa_array.scaled_dot_product_attention_vjp(
            q, kv, kv, g, implementation="blocked", **options
        )
    return lambda: sdpa_array.scaled_dot_product_attention(
        q, kv, kv, implementation="blocked", return_lse=True, **options
    )


@pytest.mark.parametrize("vjp", [False, True], ids=["forward", "vjp"])
@pytest.mark.parametrize(
    "options",
    [{}, {"is_causal": True}, {"window": (8, 8)}, {"query_lengths": 200, "key_lengths": 150}],
    ids=["plain", "causal", "window", "lengths"],
)
def test_launches_do_not_grow_with_batch_or_heads(torch_backend, vjp, options):
    """One batched operation covers every batch element and head: the operation count of
    a call is the same for 1 head and for 4 batch elements of 8 heads."""
    with tiling.gpu_plans():
        small = count_ops(call(torch_backend, (1, 1, 256, 16), vjp=vjp, **options))
        large = count_ops(call(torch_backend, (4, 8, 256, 16), vjp=vjp, **options))
    assert sum(large.values()) == sum(small.values()), (small, large)
    if torch_backend.device == "cpu":  # the CPU's own plan loops over them
        on_cpu = count_ops(call(torch_backend, (4, 8, 256, 16), vjp=vjp, **options))
        assert sum(on_cpu.values()) > sum(large.values())


@pytest.mark.parametrize("vjp", [False, True], ids=["forward", "vjp"])
def test_launches_grow_with_query_blocks_only(torch_backend, vjp):
    """Each query block adds the same operations (one tile's); the key length adds none
    (each tile holds all keys of its rows)."""
    with tiling.gpu_plans():
        counts = [
            sum(count_ops(call(torch_backend, (2, 2, n, 8), vjp=vjp, block_q=16)).values())
            for n in (16, 32, 64, 128)
        ]
        long_keys = count_ops(
            call(torch_backend, (2, 2, 32, 8), (2, 2, 512, 8), vjp=vjp, block_q=16)
        )
    # 2 -> 4 -> 8 query blocks: each new block adds the same operations
    assert counts[3] - counts[2] == 2 * (counts[2] - counts[1]) > 0
    assert sum(long_keys.values()) == counts[1]


@pytest.mark.parametrize("vjp", [False, True], ids=["forward", "vjp"])
@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True, "alignment": "bottom_right"},
        {"window": (4, 0), "softcap": 3.0},
        {"sinks": "yes", "dropout_p": 0.2, "dropout_seed": 3},
    ],
    ids=["causal", "window+softcap", "sinks+dropout"],
)
def test_no_host_synchronisation(torch_backend, vjp, options):
    """No operation of a GPU-planned call reads a device value on the host."""
    options = dict(options)
    if options.pop("sinks", None):
        options["sinks"] = torch_backend.asarray(np.zeros(4), "float32")
    with tiling.gpu_plans():
        ops = count_ops(call(torch_backend, (2, 4, 48, 8), (2, 4, 64, 8), vjp=vjp, **options))
    assert not [op for op in ops if op in SYNCING_OPS], ops


@pytest.mark.parametrize(
    "options",
    [{}, {"is_causal": True, "alignment": "bottom_right"}, {"window": (3, 2)}],
    ids=["plain", "causal", "window"],
)
def test_gpu_plans_match_the_oracle(backend, options):
    """The GPU plan computes the same call: forward and VJP against the oracle."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 40, 8), (2, 3, 56, 8), (2, 3, 56, 8)))
    with tiling.gpu_plans():
        check_against_oracle(backend, "float32", q, k, v, implementation="blocked", **options)
        g = rng.standard_normal((2, 3, 40, 8))
        check_vjp_against_oracle(
            backend, "float32", q, k, v, g, implementation="blocked", **options
        )
