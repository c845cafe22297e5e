"""Backend selection for the test suite, driven by the registry in :mod:`sdpa_array.backends`.

Choose backends with ``pytest --backend numpy,torch`` (or the ``SDPA_BACKENDS`` environment
variable, which the nox sessions set); the default is every registered backend, and those whose
library or device is absent are skipped with a reason that names what is missing.
"""

from __future__ import annotations

import os

import hypothesis
import pytest

from sdpa_array.backends import BACKENDS, Backend, get_backend

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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="store",
        default=None,
        help="comma-separated backend ids to test (default: $SDPA_BACKENDS or all): "
        + ", ".join(b.id for b in BACKENDS),
    )


def selected_backends(config: pytest.Config) -> list[Backend]:
    raw = config.getoption("--backend") or os.environ.get("SDPA_BACKENDS") or "all"
    if raw == "all":
        return list(BACKENDS)
    return [get_backend(name.strip()) for name in raw.split(",") if name.strip()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    backends = selected_backends(metafunc.config)
    if "backend_dtype" in metafunc.fixturenames:
        pairs = [(b, d) for b in backends for d in b.dtypes]
        metafunc.parametrize(
            "backend_dtype", pairs, ids=[f"{b.id}-{d}" for b, d in pairs], indirect=True
        )
    elif "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", backends, ids=[b.id for b in backends], indirect=True)


def _require(backend: Backend) -> Backend:
    if not backend.is_installed():
        pytest.skip(f"{backend.module} is not installed (pip install sdpa_array[{backend.extra}])")
    if not backend.is_available():
        pytest.skip(f"backend {backend.id!r} needs a {backend.device} device, absent here")
    backend.namespace()
    return backend


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Backend:
    """A registered backend whose library and device are present."""
    return _require(request.param)


@pytest.fixture
def backend_dtype(request: pytest.FixtureRequest) -> tuple[Backend, str]:
    """A (backend, dtype name) pair the backend supports."""
    b, dtype = request.param
    return _require(b), dtype
