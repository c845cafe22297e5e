"""GPU history: forward and VJP on torch CUDA and CuPy (and JAX's forward), as TFLOP/s
and ratios.

Every parameter combination is skipped (``NotImplementedError`` in ``setup``) where its
library or GPU is absent, so the suite runs unchanged on a CPU-only machine. On a GPU::

    SDPA_BENCH_PROFILE=gpu asv run --python=same --bench gpu --set-commit-hash $(git rev-parse HEAD)

Each combination measures, interleaved in one run, our call, the peer (torch's
``scaled_dot_product_attention`` on the same memory: its forward, or its autograd backward
for the VJP) and, for the forward, the GEMM-bound limit (the two bare products of the same
shapes in the same library). The three ``track_*`` benchmarks report from that one
measurement: TFLOP/s (``4·B·H·L·S·E`` per forward, half when causal, 2.5 times that for a
backward), the ratio to torch's time and the fraction of the GEMM-bound limit.
``SDPA_BENCH_GPU_BACKENDS`` (comma-separated backend ids) replaces the GPU backends, e.g.
with ``torch`` to try the suite on a CPU; ``SDPA_BENCH_GPU_DTYPES`` and
``SDPA_BENCH_GPU_SHAPES`` and ``SDPA_BENCH_GPU_IMPLEMENTATIONS`` narrow the dtypes, shapes and
implementations the same way.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from sdpa_array import (
    CannotDelegateError,
    CannotUseTritonError,
    scaled_dot_product_attention,
    scaled_dot_product_attention_vjp,
)

from .common import (
    PROFILE,
    Shape,
    backend_for,
    interleaved_times,
    make_inputs,
    torch_sdpa_peer,
    two_products,
)

GPU_BACKENDS = os.environ.get("SDPA_BENCH_GPU_BACKENDS", "torch:cuda,cupy").split(",")
GPU_IMPLEMENTATIONS = ["auto", "native", "triton", "blocked", "materialized"]
VJP_IMPLEMENTATIONS = ["auto", "native", "triton", "blocked"]
GPU_DTYPES = ["float16", "bfloat16", "float32"] if PROFILE == "gpu" else ["float16"]
GPU_SHAPES = (
    [
        "4x16x1024x64",
        "4x16x1024x128",
        "4x16x4096x64",
        "4x16x4096x128",
        "4x16x4096x128-causal",
        "1x16x16384x128",
        "1x16x16384x128-causal",
    ]
    if PROFILE == "gpu"
    else ["4x16x1024x64"]
)
# SDPA_BENCH_GPU_DTYPES / _SHAPES / _IMPLEMENTATIONS (comma-separated) narrow the grid for a
# short device session.
if os.environ.get("SDPA_BENCH_GPU_DTYPES"):
    GPU_DTYPES = os.environ["SDPA_BENCH_GPU_DTYPES"].split(",")
if os.environ.get("SDPA_BENCH_GPU_SHAPES"):
    GPU_SHAPES = os.environ["SDPA_BENCH_GPU_SHAPES"].split(",")
if os.environ.get("SDPA_BENCH_GPU_IMPLEMENTATIONS"):
    _chosen = os.environ["SDPA_BENCH_GPU_IMPLEMENTATIONS"].split(",")
    GPU_IMPLEMENTATIONS = [i for i in GPU_IMPLEMENTATIONS if i in _chosen]
    VJP_IMPLEMENTATIONS = [i for i in VJP_IMPLEMENTATIONS if i in _chosen]
ROUNDS = 5
REPS = 10
#: Largest score matrix (bytes) the materialized path may form in these benchmarks.
MAX_SCORE_BYTES = 8 * 2**30


def _queued(fn: Any) -> Any:
    """``REPS`` calls of ``fn`` queued back to back; the last result (its first array, for
    a tuple of gradients) is what the caller synchronises."""

    def run() -> Any:
        for _ in range(REPS - 1):
            fn()
        result = fn()
        return result[0] if isinstance(result, tuple) else result

    return run


def _interleaved_medians(backend: Any, candidates: dict[str, Any]) -> dict[str, float]:
    """Seconds per call of each candidate: warmed up (compilation, autotuning, caches),
    then :data:`ROUNDS` interleaved rounds of :data:`REPS` queued calls, the median. A
    call the library refuses skips the combination (``NotImplementedError``)."""
    try:
        for fn in candidates.values():
            backend.synchronize(_queued(fn)())
    except (CannotDelegateError, CannotUseTritonError) as exc:
        raise NotImplementedError(str(exc)) from exc
    queued = {name: _queued(fn) for name, fn in candidates.items()}
    rounds = interleaved_times(queued, backend.synchronize, ROUNDS, warmup=0)
    return {name: statistics.median(times) / REPS for name, times in rounds.items()}


@functools.cache
def _measure(direction: str, backend_id: str, impl: str, dtype: str, shape_text: str) -> dict:
    """Interleaved medians of ours, the peer and (forward) the two bare products."""
    backend = backend_for(backend_id, dtype)
    shape = Shape.parse(shape_text)
    if impl == "materialized" and shape.score_bytes(dtype) > MAX_SCORE_BYTES:
        raise NotImplementedError("the materialized path would form too large a matrix")
    q, k, v = make_inputs(backend, shape.dims, dtype)
    causal = shape.causal
    if direction == "forward":

        def ours() -> Any:
            return scaled_dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

        peer = functools.partial(torch_sdpa_peer(backend), q, k, v, is_causal=causal)
        candidates = {"ours": ours, "peer": peer, "bare": lambda: two_products(q, k, v)}
    else:
        g = make_inputs(backend, shape.dims, dtype)[0]

        def ours() -> Any:
            return scaled_dot_product_attention_vjp(
                q, k, v, g, is_causal=causal, implementation=impl
            )

        candidates = {"ours": ours, "peer": _torch_backward(backend, q, k, v, g, causal)}
    medians = _interleaved_medians(backend, candidates)
    return {"flops": shape.flops * (2.5 if direction == "vjp" else 1.0), **medians}


def _torch_backward(backend: Any, q: Any, k: Any, v: Any, g: Any, causal: bool) -> Any:
    """torch's autograd backward of its own SDPA on the same memory (the graph kept)."""
    import torch

    as_torch = torch.from_dlpack
    leaves = [as_torch(x).detach().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    grad = as_torch(g)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


#: JAX's GPU backends (``SDPA_BENCH_JAX_GPU_BACKENDS`` replaces them, e.g. with ``jax`` to
#: try the rows on a CPU, where the peer is JAX's XLA path instead of cuDNN).
JAX_GPU_BACKENDS = os.environ.get("SDPA_BENCH_JAX_GPU_BACKENDS", "jax:cuda").split(",")
JAX_IMPLEMENTATIONS = [
    i for i in ["auto", "native", "materialized", "blocked"] if i in GPU_IMPLEMENTATIONS
]


@functools.cache
def _measure_jax(backend_id: str, impl: str, dtype: str, shape_text: str) -> dict:
    """Issue 29's figures: our call under ``jax.jit``, JAX's cuDNN attention (the peer;
    XLA's off a GPU), the two bare products under ``jit`` (the GEMM bound) and our call
    without ``jit`` (eager), interleaved."""
    backend = backend_for(backend_id, dtype)
    import jax

    # backend_for pins the highest matmul precision for exact tests; time at JAX's default,
    # as a user runs (and as the cuDNN peer computes)
    jax.config.update("jax_default_matmul_precision", None)
    shape = Shape.parse(shape_text)
    if impl == "materialized" and shape.score_bytes(dtype) > MAX_SCORE_BYTES:
        raise NotImplementedError("the materialized path would form too large a matrix")
    q, k, v = make_inputs(backend, shape.dims, dtype)
    causal = shape.causal
    jnp = jax.numpy
    peer_impl = "cudnn" if q.device.platform == "gpu" else None
    qt, kt, vt = (jnp.swapaxes(x, -3, -2) for x in (q, k, v))
    ours = jax.jit(
        lambda a, b, c: scaled_dot_product_attention(a, b, c, is_causal=causal, implementation=impl)
    )
    peer = jax.jit(
        lambda a, b, c: jax.nn.dot_product_attention(
            a, b, c, is_causal=causal, implementation=peer_impl
        )
    )
    bare = jax.jit(lambda a, b, c: (a @ jnp.swapaxes(b, -1, -2)) @ c)
    candidates = {
        "ours": lambda: ours(q, k, v),
        "peer": lambda: peer(qt, kt, vt),
        "bare": lambda: bare(q, k, v),
        "eager": lambda: scaled_dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl
        ),
    }
    return {"flops": shape.flops, **_interleaved_medians(backend, candidates)}


def _measured(*key: str) -> dict:
    """:func:`_measure`, once per asv run: asv runs each ``track_*`` benchmark in a process
    of its own, forked from one server process, so the measurement is kept in a file named
    by that server's pid (the three tracks of a combination then read one measurement)."""
    folder = Path(tempfile.gettempdir()) / f"sdpa_array_gpu_bench_{os.getppid()}"
    path = folder / ("-".join(key).replace(":", "_").replace("/", "_") + ".json")
    if path.exists():
        kept = json.loads(path.read_text())
    else:
        try:
            kept = _measure_jax(*key[1:]) if key[0] == "jax" else _measure(*key)
        except NotImplementedError as exc:
            kept = {"skipped": str(exc)}
        folder.mkdir(exist_ok=True)
        path.write_text(json.dumps(kept))
    if "skipped" in kept:
        raise NotImplementedError(kept["skipped"])
    return kept


class _Tracks:
    direction = "forward"

    def setup(self, backend_id: str, impl: str, dtype: str, shape_text: str) -> None:
        self.m = _measured(self.direction, backend_id, impl, dtype, shape_text)

    def track_tflops(self, *params: str) -> float:
        return self.m["flops"] / self.m["ours"] / 1e12

    def track_ratio_vs_torch_sdpa(self, *params: str) -> float:
        return self.m["peer"] / self.m["ours"]


class GPUForward(_Tracks):
    """Forward calls on a GPU."""

    params = (GPU_BACKENDS, GPU_IMPLEMENTATIONS, GPU_DTYPES, GPU_SHAPES)
    param_names: ClassVar[list[str]] = ["backend", "implementation", "dtype", "shape"]
    timeout = 600

    def track_gemm_bound_fraction(self, *params: str) -> float:
        return self.m["bare"] / self.m["ours"]


class GPUVJP(_Tracks):
    """``scaled_dot_product_attention_vjp`` on a GPU, against torch's autograd backward."""

    direction = "vjp"
    params = (GPU_BACKENDS, VJP_IMPLEMENTATIONS, GPU_DTYPES, GPU_SHAPES)
    param_names: ClassVar[list[str]] = ["backend", "implementation", "dtype", "shape"]
    timeout = 600


class JAXGPUForward:
    """Forward calls of JAX arrays on a GPU under ``jax.jit``, against JAX's cuDNN
    attention (issue 29: ``auto`` at least 0.9 of it, eager within 2x of jitted, the
    generic paths at least half of the GEMM bound)."""

    params = (JAX_GPU_BACKENDS, JAX_IMPLEMENTATIONS, GPU_DTYPES, GPU_SHAPES)
    param_names: ClassVar[list[str]] = ["backend", "implementation", "dtype", "shape"]
    timeout = 600

    def setup(self, backend_id: str, impl: str, dtype: str, shape_text: str) -> None:
        self.m = _measured("jax", backend_id, impl, dtype, shape_text)

    def track_tflops(self, *params: str) -> float:
        return self.m["flops"] / self.m["ours"] / 1e12

    def track_ratio_vs_jax_cudnn(self, *params: str) -> float:
        return self.m["peer"] / self.m["ours"]

    def track_gemm_bound_fraction(self, *params: str) -> float:
        return self.m["bare"] / self.m["ours"]

    def track_eager_over_jit(self, *params: str) -> float:
        return self.m["eager"] / self.m["ours"]


#: Decoding shapes: ``B x Hq x Hkv x tokens x E``, paged in pages of 256 tokens.
DECODE_SHAPES = ["1x32x8x32768x128", "4x32x8x8192x128"] if PROFILE == "gpu" else ["1x8x2x1024x64"]


@functools.cache
def _measure_decode(backend_id: str, dtype: str, shape_text: str) -> dict:
    """One decoding step (``attention_with_kv_cache``, paged) interleaved with a
    device-to-device copy of as many bytes as it reads: the bandwidth limit of the call."""
    import numpy as np

    from sdpa_array import attention_with_kv_cache

    backend = backend_for(backend_id, dtype)
    B, Hq, Hkv, n, E = (int(x) for x in shape_text.split("x"))
    page = 256
    pages = B * -(-n // page)
    rng = np.random.default_rng(0)
    q = backend.asarray(rng.standard_normal((B, Hq, 1, E)), dtype)
    kc, vc = (backend.asarray(rng.standard_normal((pages, Hkv, page, E)), dtype) for _ in "kv")
    table = backend.asarray(rng.permutation(pages).reshape(B, -1).astype(np.int32))
    buffer = backend.asarray(np.zeros(2 * B * Hkv * n * E), dtype)
    target = backend.asarray(np.zeros(2 * B * Hkv * n * E), dtype)
    xp = backend.namespace()
    read_bytes = 2 * B * Hkv * n * E * int(xp.finfo(q.dtype).bits) // 8

    def ours() -> Any:
        return attention_with_kv_cache(
            q, kc, vc, cache_lengths=[n] * B, block_table=table, enable_gqa=True
        )[0]

    def copy() -> Any:
        if backend.library == "torch":
            return target.copy_(buffer)
        target[...] = buffer
        return target

    candidates = {"ours": ours, "copy": copy}
    for fn in candidates.values():
        backend.synchronize(_queued(fn)())
    queued = {name: _queued(fn) for name, fn in candidates.items()}
    rounds = interleaved_times(queued, backend.synchronize, ROUNDS, warmup=0)
    medians = {name: statistics.median(times) / REPS for name, times in rounds.items()}
    return {"bytes": read_bytes, **medians}


class GPUDecode:
    """One decoding step on a paged cache against the device-to-device copy bandwidth
    measured in the same run (issue 24's decode target: 0.7 of it)."""

    params = (GPU_BACKENDS, ["float16"], DECODE_SHAPES)
    param_names: ClassVar[list[str]] = ["backend", "dtype", "shape"]
    timeout = 600

    def setup(self, backend_id: str, dtype: str, shape_text: str) -> None:
        try:
            self.m = _measure_decode(backend_id, dtype, shape_text)
        except (CannotUseTritonError, CannotDelegateError) as exc:
            raise NotImplementedError(str(exc)) from exc

    def track_bandwidth_fraction(self, *params: str) -> float:
        copy_bandwidth = 2 * self.m["bytes"] / self.m["copy"]  # read and written
        return self.m["bytes"] / self.m["ours"] / copy_bandwidth

    def track_milliseconds(self, *params: str) -> float:
        return self.m["ours"] * 1e3
