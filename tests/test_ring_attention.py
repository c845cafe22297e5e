"""Context parallelism (:mod:`sdpa_array.distributed`): ring attention against the oracle.

torch runs in groups of 2 and 4 gloo processes spawned by the test (loopback only), JAX in a
subprocess with 4 host devices (``--xla_force_host_platform_device_count=4``); each group
runs every case, saves each participant's rows of the output, log-sum-exp and gradients,
and the test joins them (:func:`~sdpa_array.distributed.unshard_sequence`) and checks them
against the float64 oracle within its bounds.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sdpa_array.distributed import (
    reorder_for_sharding,
    restore_order,
    ring_schedule,
    shard_sequence,
    unshard_sequence,
)
from sdpa_array.testing import Backend, assert_close_to_oracle, assert_vjp_close_to_oracle

ROOT = Path(__file__).resolve().parents[1]

#: ``(sharding, is_causal, dtype, heads of the query, heads of key/value, window, extras)``:
#: both shardings, causal and not, in float32 and float64, with GQA, and one case of each
#: without GQA and with a window; then sinks (of shape ``(Hq,)`` or ``(B, Hq)``) with query
#: and key lengths counted over the whole sequence, causal in both shardings and not
#: causal with zigzag (whose two chunks sit apart).
CASES = [
    (sharding, causal, dtype, 4, 2, None, "")
    for sharding in ("contiguous", "zigzag")
    for causal in (False, True)
    for dtype in ("float32", "float64")
] + [
    ("zigzag", True, "float64", 2, 2, None, ""),
    ("contiguous", True, "float64", 4, 2, (5, 1), ""),
    ("contiguous", True, "float64", 4, 2, None, "sinks lengths"),
    ("zigzag", True, "float32", 4, 2, None, "batch-sinks lengths"),
    ("zigzag", False, "float64", 4, 2, None, "sinks lengths"),
]

#: Per-participant sequence length of every case (zigzag: two chunks of 2).
N = 4
E = 8

#: Seconds a group of participants may take before the test fails (a hang is a failure).
DEADLINE = 150


def _inputs(case: tuple[Any, ...], world_size: int, seed: int) -> dict[str, np.ndarray]:
    _, _, dtype, hq, hkv, _, extras = case
    rng = np.random.default_rng(seed)
    L = N * world_size
    shapes = {"q": (2, hq, L, E), "k": (2, hkv, L, E), "v": (2, hkv, L, E), "g": (2, hq, L, E)}
    arrays = {name: rng.standard_normal(s).astype(dtype) for name, s in shapes.items()}
    if "sinks" in extras:
        shape = (2, hq) if "batch-sinks" in extras else (hq,)
        arrays["sinks"] = rng.standard_normal(shape).astype(dtype)
    if "lengths" in extras:  # padding rows in the last participants' slices, an empty key row
        arrays["query_lengths"] = np.array([L - 3, L // 2 - 1])
        arrays["key_lengths"] = np.array([L - 1, L // 2 + 1])
    return arrays


#: The inputs beyond query, key and value that a case passes as options.
EXTRAS = ("sinks", "query_lengths", "key_lengths")


def _options(case: tuple[Any, ...]) -> dict[str, Any]:
    _, causal, _, hq, hkv, window, _ = case
    return {"is_causal": causal, "window": window, "enable_gqa": hq != hkv}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the participants ------------------------------------------------------------------


def _torch_participant(rank: int, world_size: int, port: int, path: str) -> None:
    """One gloo rank: every case forward and backward, then the mismatched calls."""
    import torch
    import torch.distributed as dist

    from sdpa_array.distributed import RingStats, ring_attention

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    with open(path, "rb") as f:
        work = pickle.load(f)
    results: list[Any] = []
    for case, arrays in work:
        sharding = case[0]

        def mine(a: np.ndarray, axis: int = -2, sharding: str = sharding) -> Any:
            x = shard_sequence(torch.from_numpy(a), rank, world_size, sharding=sharding, axis=axis)
            return x.clone().requires_grad_(True)

        q, k, v = mine(arrays["q"]), mine(arrays["k"]), mine(arrays["v"])
        extra = {n: torch.from_numpy(arrays[n]) for n in EXTRAS if n in arrays}
        if "sinks" in extra:  # replicated: every rank holds the whole array
            extra["sinks"].requires_grad_(True)
        stats = RingStats()
        out, lse = ring_attention(
            q, k, v, sharding=sharding, return_lse=True, stats=stats, **_options(case), **extra
        )
        out.backward(
            shard_sequence(torch.from_numpy(arrays["g"]), rank, world_size, sharding=sharding)
        )
        got = [t.detach().numpy() for t in (out, lse, q.grad, k.grad, v.grad)]
        if "sinks" in extra:  # this rank's part of the sinks' gradient
            got.append(extra["sinks"].grad.numpy())
        results.append((got, stats))
    errors = []
    q = torch.zeros(1, 2, 4 if rank else 6, E)  # one participant's slice is longer
    errors.append(_error_of(lambda: ring_attention(q, q[..., :4, :], q[..., :4, :])))
    q = torch.zeros(1, 2, 4, E, dtype=torch.float64 if rank else torch.float32)
    errors.append(_error_of(lambda: ring_attention(q, q, q)))
    q = torch.zeros(1, 2, 4, E)  # one participant's option fails its checks
    errors.append(_error_of(lambda: ring_attention(q, q, q, softcap=-1.0 if rank else None)))
    with open(f"{path}.{rank}", "wb") as f:
        pickle.dump((results, errors), f)
    dist.destroy_process_group()


def _error_of(call: Any) -> str:
    try:
        call()
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def _jax_participants(path: str) -> None:
    """Every case inside ``shard_map`` over 4 (and 2) host devices, under ``jit``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as Spec

    from sdpa_array.distributed import ring_attention

    jax.config.update("jax_enable_x64", True)
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map
    with open(path, "rb") as f:
        work = pickle.load(f)
    results = []
    for world_size, case, arrays in work:
        sharding = case[0]
        mesh = Mesh(np.array(jax.devices()[:world_size]), ("sp",))
        rows, lse_rows = Spec(None, None, "sp", None), Spec(None, None, "sp")

        names = [n for n in EXTRAS if n in arrays]  # replicated over the mesh

        def body(q: Any, k: Any, v: Any, *extra: Any, case: Any = case, names: Any = names) -> Any:
            return ring_attention(
                q, k, v, axis_name="sp", sharding=case[0], return_lse=True, **_options(case),
                **dict(zip(names, extra, strict=True)),
            )  # fmt: skip

        specs = (rows,) * 3 + (Spec(),) * len(names)
        ring = shard_map(body, mesh=mesh, in_specs=specs, out_specs=(rows, lse_rows))

        def order(a: Any, axis: int = -2, n: int = world_size, s: str = sharding) -> Any:
            return reorder_for_sharding(a, n, sharding=s, axis=axis)

        def loss(
            q: Any, k: Any, v: Any, g: Any, *extra: Any, ring: Any = ring, order: Any = order
        ) -> Any:
            return jnp.sum(ring(order(q), order(k), order(v), *extra)[0] * order(g))

        q, k, v, g = (jnp.asarray(arrays[n]) for n in "qkvg")
        extra = [jnp.asarray(arrays[n]) for n in names]
        out, lse = jax.jit(ring)(order(q), order(k), order(v), *extra)
        argnums = (0, 1, 2, 4) if "sinks" in names else (0, 1, 2)
        grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, g, *extra)
        full = [
            restore_order(out, world_size, sharding=sharding),
            restore_order(lse, world_size, sharding=sharding, axis=-1),
            *grads,
        ]
        results.append([np.asarray(a) for a in full])
    with open(f"{path}.out", "wb") as f:
        pickle.dump(results, f)


# --- checks against the oracle ----------------------------------------------------------


def _check(
    backend: Backend, case: tuple[Any, ...], arrays: dict[str, np.ndarray], full: list[Any]
) -> None:
    """The joined output, log-sum-exp and gradients of one case against the oracle."""
    dtype = case[2]
    q, k, v, g = (backend.asarray(arrays[n], dtype) for n in "qkvg")
    out, lse, *grads = (backend.asarray(a, str(a.dtype)) for a in full)
    options = _options(case)
    if "sinks" in arrays:
        options["sinks"] = backend.asarray(arrays["sinks"], dtype)
    for name in ("query_lengths", "key_lengths"):
        if name in arrays:
            options[name] = arrays[name]
    assert_close_to_oracle((out, lse), q, k, v, return_lse=True, **options)
    assert_vjp_close_to_oracle(tuple(grads), q, k, v, g, **options)


def _run_torch_group(world_size: int, tmp_path: Path) -> tuple[list[Any], list[Any]]:
    import torch.multiprocessing as mp

    work = [(case, _inputs(case, world_size, seed)) for seed, case in enumerate(CASES)]
    path = str(tmp_path / f"work{world_size}")
    with open(path, "wb") as f:
        pickle.dump(work, f)
    context = mp.start_processes(
        _torch_participant, args=(world_size, _free_port(), path), nprocs=world_size,
        join=False, start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + DEADLINE
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world_size} participants did not finish in {DEADLINE} s")
    per_rank = []
    for rank in range(world_size):
        with open(f"{path}.{rank}", "rb") as f:
            per_rank.append(pickle.load(f))
    return work, per_rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_ring_matches_oracle(
    torch_cpu_backend: Backend, world_size: int, tmp_path: Path
) -> None:
    work, per_rank = _run_torch_group(world_size, tmp_path)
    for i, (case, arrays) in enumerate(work):
        sharding = case[0]
        parts = [[r[0][i][0][j] for r in per_rank] for j in range(5)]
        full = [
            unshard_sequence(p, sharding=sharding, axis=-1 if j == 1 else -2)
            for j, p in enumerate(parts)
        ]
        if "sinks" in arrays:  # the ranks' parts of a replicated parameter's gradient add up
            full.append(sum(r[0][i][0][5] for r in per_rank))
        _check(torch_cpu_backend, case, arrays, full)
        # the pairs each participant computed are the schedule's, and what it sent
        kv_bytes = (arrays["k"].nbytes + arrays["v"].nbytes) // world_size
        for rank, (results, _) in enumerate(per_rank):
            stats = results[i][1]
            plan = ring_schedule(
                rank, world_size, N, sharding=sharding, is_causal=case[1], window=case[5]
            )
            if "lengths" not in case[6]:  # lengths split zigzag's chunks without a band
                assert stats.pairs == [len(step) for step in plan]
            assert stats.bytes_sent == (world_size - 1) * kv_bytes
            assert stats.backward_bytes_sent == (2 * world_size - 1) * kv_bytes
    # a participant whose slices differ raises on every participant, and none hangs
    for _, errors in per_rank:
        assert len(errors) == 3
        assert all(e.startswith("ValueError: ring_attention:") for e in errors), errors
        assert "differ" in errors[0]
        assert "(1, 2, 6, 8)" in errors[0]
        assert "differ" in errors[1]
        assert "float64" in errors[1]
        assert "rank 1" in errors[2]
        assert "softcap" in errors[2]


#: The JAX cases (each compiles anew): over 4 devices both shardings, causal and not, each
#: in one dtype (both dtypes in all), the cases without GQA and with a window, and with sinks
#: and lengths; two over 2.
JAX_WORK = [(4, CASES[i]) for i in (0, 3, 5, 6, 8, 9, 10, 11)] + [(2, CASES[7]), (2, CASES[12])]


def test_jax_ring_matches_oracle(jax_backend: Backend, tmp_path: Path) -> None:
    work = [(n, case, _inputs(case, n, seed)) for seed, (n, case) in enumerate(JAX_WORK)]
    path = str(tmp_path / "work")
    with open(path, "wb") as f:
        pickle.dump(work, f)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = f"from tests.test_ring_attention import _jax_participants; _jax_participants({path!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=DEADLINE,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    with open(f"{path}.out", "rb") as f:
        results = pickle.load(f)
    for (_, case, arrays), full in zip(work, results, strict=True):
        _check(jax_backend, case, arrays, full)


# --- the schedule, the helpers and the errors ---------------------------------------------


def _causal_entries(positions_q: range, positions_k: range) -> int:
    return sum(1 for i in positions_q for j in positions_k if j <= i)


@pytest.mark.parametrize("world_size", [2, 4])
def test_causal_contiguous_skips_masked_pairs(world_size: int) -> None:
    for rank in range(world_size):
        plan = ring_schedule(rank, world_size, 8, is_causal=True)
        sources = [pair.source for step in plan for pair in step]
        assert sources == list(range(rank, -1, -1))  # only the slices at or before its own
        assert sum(p.entries for step in plan for p in step) == _causal_entries(
            range(rank * 8, rank * 8 + 8), range(0, rank * 8 + 8)
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_causal_zigzag_balances_work(world_size: int) -> None:
    L = 8 * world_size
    total = 0
    for rank in range(world_size):
        plan = ring_schedule(rank, world_size, 8, sharding="zigzag", is_causal=True)
        pairs = [p for step in plan for p in step]
        assert len(pairs) == 2 * world_size + 1
        entries = sum(p.entries for p in pairs)
        assert entries == (2 * world_size - 1) * 16 + 4 * 5  # the same on every participant
        for p in pairs:  # each pair's entries at its absolute positions
            assert p.entries == _causal_entries(p.query_positions, p.key_positions)
        total += entries
    assert total == L * (L + 1) // 2


@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_shard_and_unshard_are_inverse(sharding: str) -> None:
    x = np.arange(2 * 3 * 16 * 2).reshape(2, 3, 16, 2)
    slices = [shard_sequence(x, r, 4, sharding=sharding) for r in range(4)]
    assert all(s.shape == (2, 3, 4, 2) for s in slices)
    np.testing.assert_array_equal(unshard_sequence(slices, sharding=sharding), x)
    ordered = reorder_for_sharding(x, 4, sharding=sharding)
    np.testing.assert_array_equal(restore_order(ordered, 4, sharding=sharding), x)
    if sharding == "zigzag":  # chunks r and 2P - 1 - r, in that order
        np.testing.assert_array_equal(slices[1][..., :2, :], x[..., 2:4, :])
        np.testing.assert_array_equal(slices[1][..., 2:, :], x[..., 12:14, :])


def test_shard_errors() -> None:
    x = np.zeros((2, 10, 3))
    with pytest.raises(ValueError, match="does not divide into 8 chunks"):
        shard_sequence(x, 0, 4, sharding="zigzag")
    with pytest.raises(ValueError, match="sharding must be one of"):
        shard_sequence(x, 0, 2, sharding="striped")
    with pytest.raises(ValueError, match="rank must be in"):
        shard_sequence(x, 2, 2)


def test_unsupported_options_are_named(torch_cpu_backend: Backend) -> None:
    from sdpa_array.distributed import ring_attention

    q = torch_cpu_backend.asarray(np.zeros((1, 2, 4, 8)), "float32")
    with pytest.raises(ValueError, match="does not support mask"):
        ring_attention(q, q, q, mask=q > 0)
    with pytest.raises(ValueError, match="does not support segment_ids"):
        ring_attention(q, q, q, segment_ids=(q[0, 0, :, 0], q[0, 0, :, 0]))
    with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
        ring_attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match=r"torch\.distributed initialised"):
        ring_attention(q, q, q)


def test_jax_needs_shard_map(jax_backend: Backend) -> None:
    from sdpa_array.distributed import ring_attention

    q = jax_backend.asarray(np.zeros((1, 2, 4, 8)), "float32")
    with pytest.raises(ValueError, match="needs axis_name"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="inside shard_map"):
        ring_attention(q, q, q, axis_name="sp")
