"""Backend selection for the test suite, driven by :mod:`sdpa_array.testing.backends`.

Choose backends with ``pytest --backend numpy,torch`` (or the ``SDPA_BACKENDS`` environment
variable, which the nox sessions set); the default is every registered backend, and those whose
library or device is absent are skipped with a reason that names what is missing. That is the
only reason a backend test is skipped.

A test asks for the backends it applies to by the name of its fixture (see
:data:`BACKEND_FIXTURES`): ``backend`` is every selected backend, ``torch_backend`` only those
holding torch tensors, ``native_backend`` only those whose library has a native kernel, and so
on; each ``<name>_dtype`` fixture is the matching ``(backend, dtype name)`` pairs. A selected
backend that a fixture leaves out generates no test; a test that no selected backend applies
to is deselected, not skipped.

A feature's tests across every path ask for ``path_case``: one per selected backend, dtype,
path of :data:`tests.paths.PATHS` and case of the module's ``PATH_CASES`` that the path
computes (:mod:`tests.paths`).

Slow tests carry the ``slow`` mark; the default nox sessions deselect them and
``nox -s tests-slow`` runs them on every CPU backend. ``@pytest.mark.slow_on(*libraries)``,
on a test or on one of its parameters, marks ``slow`` only its cases on those libraries'
backends: mostly ``SHAPE_COMPILING_LIBRARIES`` (JAX), where every new shape is compiled,
for cases whose shapes are their own (the others share ``Q``, ``KV``... of
``tests/helpers.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import hypothesis
import pytest

from sdpa_array.testing.backends import BACKENDS, Backend, get_backend
from tests.libraries import (
    AUTOGRAD_LIBRARIES,
    NATIVE_LIBRARIES,
    SHAPE_COMPILING_LIBRARIES,
    native_dtype,
    native_lse,
    native_lse_device,
)
from tests.paths import PathCase, path_cases

# JAX takes 75% of a GPU's memory when it first touches it; the test workers share one GPU
# (each would start with the rest held: CUDA, cuBLAS and CuPy ran out of memory).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

hypothesis.settings.register_profile(
    "ci",
    deadline=None,
    max_examples=60,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
hypothesis.settings.register_profile(
    "dev",
    deadline=None,
    max_examples=25,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@dataclass(frozen=True)
class BackendFixture:
    """Which selected backends (and dtypes, for the ``_dtype`` variant) a fixture holds."""

    backends: Callable[[Backend], bool]
    dtypes: Callable[[Backend, str], bool] = lambda b, dtype: True


#: Fixture name -> the backends it holds. Each also exists as ``<name>_dtype``.
BACKEND_FIXTURES: dict[str, BackendFixture] = {
    # every selected backend
    "backend": BackendFixture(lambda b: True),
    # the backends of one library, for tests of that library's own features
    "torch_backend": BackendFixture(lambda b: b.library == "torch"),
    "numpy_backend": BackendFixture(lambda b: b.library == "numpy"),
    "torch_cpu_backend": BackendFixture(lambda b: b.library == "torch" and b.device == "cpu"),
    "jax_backend": BackendFixture(lambda b: b.library == "jax"),
    "autograd_backend": BackendFixture(lambda b: b.library in AUTOGRAD_LIBRARIES),
    "dask_backend": BackendFixture(lambda b: b.library == "dask"),
    # eager arrays, whose values can be read (every library but Dask)
    "eager_backend": BackendFixture(lambda b: b.library != "dask"),
    # eager arrays whose values the host reads without waiting for a device (not on a GPU)
    "host_backend": BackendFixture(lambda b: b.library != "dask" and b.device != "cuda"),
    # arrays on a GPU (torch CUDA, CuPy)
    "gpu_backend": BackendFixture(lambda b: b.device == "cuda"),
    # arrays torch shares memory with (NumPy and torch), for comparisons with torch
    "torch_interop_backend": BackendFixture(lambda b: b.library in ("numpy", "torch")),
    # backends whose arrays are not NumPy's, for mixing libraries
    "non_numpy_backend": BackendFixture(lambda b: b.library != "numpy"),
    "float64_backend": BackendFixture(lambda b: "float64" in b.dtypes),
    # libraries that compile every new shape
    "shape_compiling_backend": BackendFixture(lambda b: b.library in SHAPE_COMPILING_LIBRARIES),
    # implementation="native": the dtype variant holds the dtypes that must delegate
    "native_backend": BackendFixture(lambda b: b.library in NATIVE_LIBRARIES, native_dtype),
    "non_native_backend": BackendFixture(lambda b: b.library not in NATIVE_LIBRARIES),
    # native kernels that return the log-sum-exp (and so the weights) on this device
    "native_lse_backend": BackendFixture(native_lse_device, native_lse),
    # dtypes in which native kernels refuse every call
    "native_refused_backend": BackendFixture(
        lambda b: b.library in NATIVE_LIBRARIES,
        lambda b, dtype: b.library in NATIVE_LIBRARIES and not native_dtype(b, dtype),
    ),
}

#: Mark of the placeholder item of a test that no selected backend applies to; it is
#: deselected before the run.
NOT_GENERATED = "not_generated"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="store",
        default=None,
        help="comma-separated backend ids to test (default: $SDPA_BACKENDS or all): "
        + ", ".join(b.id for b in BACKENDS),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{NOT_GENERATED}: no selected backend applies (deselected, never run)"
    )


def selected_backends(config: pytest.Config) -> list[Backend]:
    raw = config.getoption("--backend") or os.environ.get("SDPA_BACKENDS") or "all"
    if raw == "all":
        return list(BACKENDS)
    return [get_backend(name.strip()) for name in raw.split(",") if name.strip()]


def _parametrize(metafunc: pytest.Metafunc, name: str, values: list, ids: list[str]) -> None:
    if not values:
        values = [pytest.param(None, marks=getattr(pytest.mark, NOT_GENERATED))]
        ids = ["no-selected-backend-applies"]
    metafunc.parametrize(name, values, ids=ids, indirect=True)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    selected = selected_backends(metafunc.config)
    for name, spec in BACKEND_FIXTURES.items():
        backends = [b for b in selected if spec.backends(b)]
        if f"{name}_dtype" in metafunc.fixturenames:
            pairs = [(b, d) for b in backends for d in b.dtypes if spec.dtypes(b, d)]
            _parametrize(metafunc, f"{name}_dtype", pairs, [f"{b.id}-{d}" for b, d in pairs])
        elif name in metafunc.fixturenames:
            _parametrize(metafunc, name, backends, [b.id for b in backends])
    if "path_case" in metafunc.fixturenames:
        items = path_cases(selected, metafunc.module.PATH_CASES)
        ids = [f"{c.backend.id}-{c.dtype}-{c.path.name}-{c.case.id}" for c in items]
        _parametrize(metafunc, "path_case", items, ids)


def _backend_of(item: pytest.Item) -> Backend | None:
    """The backend an item runs on (that of its backend fixture), if any."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if isinstance(params.get("path_case"), PathCase):
        return params["path_case"].backend
    for name in BACKEND_FIXTURES:
        value = params.get(name, params.get(f"{name}_dtype"))
        if isinstance(value, tuple):
            value = value[0]
        if isinstance(value, Backend):
            return value
    return None


def _mark_slow_on(item: pytest.Item) -> None:
    """``@pytest.mark.slow_on(*libraries)`` (on a test or on one of its parameters): its
    cases on the backends of these libraries get the ``slow`` mark."""
    libraries = {library for mark in item.iter_markers("slow_on") for library in mark.args}
    unknown = libraries - {b.library for b in BACKENDS}
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: slow_on names no library: {sorted(unknown)}")
    backend = _backend_of(item)
    if backend is not None and backend.library in libraries:
        item.add_marker(pytest.mark.slow)


# First, so that ``-m "not slow"`` (the mark plugin's own hook) sees the marks added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        _mark_slow_on(item)
    unused = [item for item in items if item.get_closest_marker(NOT_GENERATED)]
    if unused:
        config.hook.pytest_deselected(items=unused)
        items[:] = [item for item in items if not item.get_closest_marker(NOT_GENERATED)]


def _require(backend: Backend) -> Backend:
    if not backend.is_installed():
        pytest.skip(f"{backend.module} is not installed (pip install sdpa_array[{backend.extra}])")
    if not backend.is_available():
        pytest.skip(f"backend {backend.id!r} needs a {backend.device} device, absent here")
    backend.configure()
    backend.namespace()
    return backend


def _make_fixtures(name: str) -> None:
    def one(request: pytest.FixtureRequest) -> Backend:
        return _require(request.param)

    def pair(request: pytest.FixtureRequest) -> tuple[Backend, str]:
        b, dtype = request.param
        return _require(b), dtype

    one.__doc__ = f"A selected backend of the {name!r} kind whose library and device are present."
    pair.__doc__ = f"A (backend, dtype name) pair of the {name!r} kind."
    globals()[name] = pytest.fixture(one, name=name)
    globals()[f"{name}_dtype"] = pytest.fixture(pair, name=f"{name}_dtype")


@pytest.fixture
def path_case(request: pytest.FixtureRequest) -> PathCase:
    """A (backend, dtype, path, case) of the test module's ``PATH_CASES`` that the path
    computes (:mod:`tests.paths`), on a backend whose library and device are present."""
    _require(request.param.backend)
    return request.param


# One fixture per entry of BACKEND_FIXTURES, and its ``_dtype`` variant.
for _name in BACKEND_FIXTURES:
    _make_fixtures(_name)


@pytest.fixture(autouse=True)
def _free_gpu_memory_pools():
    """Give memory cached by CuPy's and torch's GPU allocators back after each test: the
    test workers share one GPU, and cuBLAS allocates its workspace outside those pools (it
    failed with ``CUBLAS_STATUS_ALLOC_FAILED`` while eight workers' pools held the memory)."""
    yield
    import sys

    cupy = sys.modules.get("cupy")
    if cupy is not None and cupy.cuda.is_available():
        cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Start each test without the plans kept for repeated calls (:mod:`sdpa_array._plan.cache`):
    a test that changes the dispatch (a threshold, a kernel table) then sees it planned."""
    from sdpa_array._plan import cache

    cache.clear()


@pytest.fixture(autouse=True)
def _fresh_jax_eager_programs():
    """Start each test without the compiled programs of eager JAX calls
    (:mod:`sdpa_array._api.jax_eager`): a test that spies on the kernels then sees its
    first call traced, whatever earlier tests compiled."""
    from sdpa_array._api import jax_eager

    jax_eager.clear_compiled()
