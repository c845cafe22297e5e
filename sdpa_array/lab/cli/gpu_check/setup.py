"""What a run of ``gpu-check`` tests and measures: the GPU's setup and the CPU rehearsal's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

#: The repository root of a checkout (``tests/`` beside the package), where pytest runs.
ROOT = Path(__file__).resolve().parents[4]

#: Libraries whose versions the report gives (distribution names).
DISTRIBUTIONS = (
    "numpy",
    "torch",
    "triton",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "cupy",
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda12-plugin",
    "array-api-compat",
    "array-api-strict",
    "pytest",
    "pytest-xdist",
    "hypothesis",
)


@dataclasses.dataclass(frozen=True)
class PytestRun:
    """One pytest run: its backends (those installed here), files and extra arguments."""

    name: str
    backends: tuple[str, ...]
    files: tuple[str, ...]
    budget: float
    interpret_triton: bool = False
    extra: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run measures and tests: the GPU's, or the CPU rehearsal's tiny version."""

    rehearsal: bool
    torch_backend: str
    cupy_backend: str | None
    jax_backend: str
    shapes: tuple[str, ...]
    dtypes: tuple[str, ...]
    decode_shape: str
    profile_shape: str
    rounds: int
    reps: int
    selections: tuple[PytestRun, ...]
    figures_budget: float
    profile_budget: float
    workers: int


#: Files of the GPU test selections.
GPU_TEST_FILES = (
    "tests/test_attention.py",
    "tests/test_autograd.py",
    "tests/test_native.py",
    "tests/test_dispatch_gpu.py",
    "tests/test_gpu_plan.py",
    "tests/test_kv_cache.py",
    "tests/test_vjp_saved_forward.py",
    "tests/test_accuracy_vs_torch.py",
    "tests/test_causal_window.py",
    "tests/test_gqa.py",
)
TRITON_TEST_FILES = (
    "tests/test_triton.py",
    "tests/test_triton_dispatch.py",
    "tests/test_triton_decode.py",
)
JAX_TEST_FILES = (
    "tests/test_attention.py",
    "tests/test_autograd.py",
    "tests/test_native.py",
    "tests/test_jax_eager.py",
    "tests/test_vjp_saved_forward.py",
)

GPU_SETUP = Setup(
    rehearsal=False,
    torch_backend="torch:cuda",
    cupy_backend="cupy",
    jax_backend="jax:cuda",
    shapes=("4x16x4096x128-causal", "1x16x16384x128-causal"),
    dtypes=("float16", "bfloat16"),
    decode_shape="1x32x8x32768x128",
    profile_shape="1x8x2048x64",
    rounds=10,
    reps=3,
    selections=(
        PytestRun("tests-torch-cuda", ("torch:cuda", "cupy"), GPU_TEST_FILES, 70),
        PytestRun("tests-triton", ("torch:cuda",), TRITON_TEST_FILES, 30),
        PytestRun("tests-jax-cuda", ("jax:cuda",), JAX_TEST_FILES, 35),
    ),
    figures_budget=120,
    profile_budget=20,
    workers=4,
)

CPU_SETUP = Setup(
    rehearsal=True,
    torch_backend="torch",
    cupy_backend="cupy",
    jax_backend="jax",
    shapes=("1x2x64x16-causal",),
    dtypes=("float32",),
    decode_shape="1x4x2x256x16",
    profile_shape="1x2x64x16",
    rounds=3,
    reps=1,
    selections=(
        PytestRun(
            "tests-torch",
            ("torch",),
            ("tests/test_vjp_saved_forward.py",),
            60,
            extra=("-k", "plain"),
        ),
        PytestRun(
            "tests-triton",
            ("torch",),
            ("tests/test_triton_dispatch.py",),
            60,
            interpret_triton=True,
            extra=("-k", "not bfloat16"),
        ),
        PytestRun(
            "tests-jax",
            ("jax",),
            ("tests/test_vjp_saved_forward.py",),
            60,
            extra=("-k", "plain and float32"),
        ),
    ),
    figures_budget=75,
    profile_budget=30,
    workers=0,
)
