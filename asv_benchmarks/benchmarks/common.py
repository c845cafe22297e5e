"""Inputs, candidates and profiles shared by the benchmarks.

Backends come from the same registry as the tests (:mod:`sdpa_array.testing.backends`);
timing, flop counts and the peers (torch's native kernel on the same memory, the naive three
steps, the two matrix products alone) come from :mod:`sdpa_array.lab.cli.bench`, which also
backs ``python -m sdpa_array bench``, so the suite and the command line measure alike.
Every ``setup`` gets its backend from :func:`backend_for`, which applies the backend's
precision settings (:meth:`~sdpa_array.testing.backends.Backend.configure`) before any
array is made.

A parameter combination that cannot run here (library or device absent, dtype unsupported,
a native kernel that does not apply, a peer that cannot share the backend's memory, a
materialized score matrix too large for this machine) raises ``NotImplementedError`` in
``setup``, which asv records as skipped.

Profiles (environment variable ``SDPA_BENCH_PROFILE``):

* ``quick`` (default): float32, B=1, H=8, L=S=512, E=64 with and without ``is_causal``;
  the long calls have L=S=4096. The whole suite takes about 4.5 minutes on 2 cores.
* ``full``: float32 and float16, L=S=1024 and 4096 (the issue's reference shape; the
  backward: 2048 and 4096), the long calls L=S=8192 and 32768.
* ``gpu``: ``quick`` for these benchmarks, and every shape and dtype of the GPU history
  (:mod:`benchmarks.gpu`; ``quick`` runs only its smallest float16 shape there).

Matrix products run at full float32 precision (no TF32) unless ``SDPA_BENCH_ALLOW_TF32=1``.
"""

from __future__ import annotations

import importlib
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sdpa_array import CannotDelegateError, scaled_dot_product_attention

try:
    from sdpa_array.lab.cli.bench import (
        attention_flops,
        interleaved_times,
        make_inputs,
        naive_attention,
        peak_rss_growth,
        torch_sdpa_peer,
        two_products,
    )
except ImportError:  # revisions before the command line moved into the lab
    from sdpa_array._cli.bench import (  # type: ignore[no-redef]
        attention_flops,
        interleaved_times,
        make_inputs,
        naive_attention,
        peak_rss_growth,  # noqa: F401 (imported by the other benchmark modules)
        torch_sdpa_peer,
        two_products,
    )
from sdpa_array.testing.backends import BACKENDS, Backend, get_backend

# Import the installed array libraries once here: asv's forkserver imports this module
# before forking a process per benchmark, so no benchmark pays for the imports.
for _backend in BACKENDS:
    if _backend.is_installed():
        importlib.import_module(_backend.module)

PROFILE = os.environ.get("SDPA_BENCH_PROFILE", "quick")
if PROFILE not in ("quick", "full", "gpu"):
    raise ValueError(f"SDPA_BENCH_PROFILE must be 'quick', 'full' or 'gpu', got {PROFILE!r}")
FULL = PROFILE == "full"

#: Every registered backend but read-only NumPy, which times the same code as ``numpy``.
BACKEND_IDS = [b.id for b in BACKENDS if b.id != "numpy:readonly"]
DTYPES = ["float32", "float16"] if FULL else ["float32"]
OURS = ["auto", "materialized", "blocked", "native"]
PEERS = ["torch-sdpa", "naive"]
IMPLEMENTATIONS = OURS + PEERS
SHAPES = (
    ["1x8x1024x64", "1x8x1024x64-causal", "1x8x4096x64", "1x8x4096x64-causal"]
    if FULL
    else ["1x8x512x64", "1x8x512x64-causal"]
)
#: Lengths of the one-head long calls whose memory is tracked: long enough that one score
#: matrix (64 MiB at 4096 in float32) stands out of the process's resident memory.
LONG_LENGTHS = [8192, 32768] if FULL else [4096]

#: Largest score matrix (bytes) a path that forms it may allocate in the benchmarks.
MAX_SCORE_BYTES = 4 * 2**30

#: Timed rounds inside ``track_*`` benchmarks (median).
TRACK_ROUNDS = 5 if FULL else 1


@dataclass(frozen=True)
class Shape:
    """``BxHxLxE[-causal]`` with ``S = L``."""

    B: int
    H: int
    L: int
    E: int
    causal: bool

    @classmethod
    def parse(cls, text: str) -> Shape:
        dims, _, flag = text.partition("-")
        B, H, L, E = (int(n) for n in dims.split("x"))
        return cls(B, H, L, E, flag == "causal")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return self.B, self.H, self.L, self.E

    @property
    def flops(self) -> float:
        return attention_flops(self.B, self.H, self.L, self.L, self.E, self.E, self.causal)

    def score_bytes(self, dtype: str) -> int:
        itemsize = 8 if dtype == "float64" else 4
        return self.B * self.H * self.L * self.L * itemsize


def backend_for(backend_id: str, dtype: str) -> Backend:
    """The registered backend, configured (precision pinned), or ``NotImplementedError``.

    Calls :meth:`Backend.configure` (JAX float64 and highest matmul precision, torch without
    TF32), which every benchmark's ``setup`` needs before it makes arrays: looking a backend
    up or checking that it is available changes no setting.
    """
    backend = get_backend(backend_id)
    if not backend.is_available():
        raise NotImplementedError(f"{backend_id} is not installed or has no device here")
    if dtype not in backend.dtypes:
        raise NotImplementedError(f"{backend_id} has no {dtype}")
    backend.configure()  # JAX float64, highest matmul precision, no TF32
    backend.namespace()  # imports the library
    if os.environ.get("SDPA_BENCH_ALLOW_TF32") == "1" and backend.library == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    return backend


def candidate(backend: Backend, implementation: str, q: Any, k: Any, v: Any, causal: bool):
    """A zero-argument callable computing the attention the named way."""
    if implementation in OURS:
        return lambda: scaled_dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )
    if implementation == "naive":
        return lambda: naive_attention(q, k, v, is_causal=causal)
    if implementation == "torch-sdpa":
        peer = torch_sdpa_peer(backend)
        return lambda: peer(q, k, v, is_causal=causal)
    raise ValueError(f"unknown implementation {implementation!r}")


def forms_scores(implementation: str) -> bool:
    return implementation in ("materialized", "naive")


@dataclass
class Case:
    """Inputs on the device and the callable to time, built and warmed up."""

    backend: Backend
    shape: Shape
    run: Callable[[], Any]

    def __call__(self) -> Any:
        out = self.run()
        self.backend.synchronize(out)
        return out

    def median_seconds(self, rounds: int = TRACK_ROUNDS) -> float:
        return statistics.median(
            interleaved_times({"x": self.run}, self.backend.synchronize, rounds, warmup=0)["x"]
        )


def make_case(backend_id: str, dtype: str, implementation: str, shape_text: str) -> Case:
    """Build the case or raise ``NotImplementedError`` (asv's 'skipped')."""
    backend = backend_for(backend_id, dtype)
    shape = Shape.parse(shape_text)
    if forms_scores(implementation) and shape.score_bytes(dtype) > MAX_SCORE_BYTES:
        raise NotImplementedError(f"{implementation} would form {shape.score_bytes(dtype)} bytes")
    q, k, v = make_inputs(backend, shape.dims, dtype)
    run = candidate(backend, implementation, q, k, v, shape.causal)
    case = Case(backend, shape, run)
    try:
        case()  # warm-up: imports, kernels, JIT caches, thread pools
    except CannotDelegateError as exc:
        raise NotImplementedError(str(exc)) from exc
    return case


def products_case(backend_id: str, dtype: str, shape_text: str) -> Case:
    """The two matrix products of the attention's shapes, alone (the GEMM bound)."""
    backend = backend_for(backend_id, dtype)
    shape = Shape.parse(shape_text)
    if shape.score_bytes(dtype) > MAX_SCORE_BYTES:
        raise NotImplementedError("the products would form a too large matrix")
    q, k, v = make_inputs(backend, shape.dims, dtype)
    case = Case(backend, shape, lambda: two_products(q, k, v))
    case()
    return case
