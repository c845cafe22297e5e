"""What the test suite states about the array libraries: which have native kernels and in
which dtypes those refuse, which have their own autodiff, which compile every new shape.

``tests/conftest.py`` narrows its backend fixtures with these, and :mod:`tests.paths` its
paths; ``tests/test_native.py`` checks the stated refusals.
"""

from __future__ import annotations

from sdpa_array._kernels.native import NATIVE_KERNELS
from sdpa_array.testing.backends import Backend

#: Libraries with at least one native kernel, from the library's own delegation table (its
#: optional rows, off by default, aside: ``tests/test_optional_kernels.py``).
NATIVE_LIBRARIES = frozenset(row.library for row in NATIVE_KERNELS if row.optional is None)

#: Dtypes in which a library's native kernels never compute a call, with the reason their
#: refusal gives (stated here, not derived: ``tests/test_native.py::test_refused_dtypes``
#: checks the refusals, and the other dtypes of a native backend must delegate).
NATIVE_REFUSED_DTYPES: dict[str, dict[str, str]] = {
    "jax": {"float64": "computes the softmax in float32"}
}

#: (library, device) -> dtypes in which no native kernel returns the log-sum-exp on that
#: device, with the reason the refusal gives (stated;
#: ``tests/test_native.py::test_lse_and_weights_delegation`` checks the refusals).
NATIVE_LSE_REFUSED_DTYPES: dict[tuple[str, str], dict[str, str]] = {
    ("torch", "cuda"): {"float64": "no CUDA kernel returning the log-sum-exp computes float64"}
}

#: Libraries whose own autodiff the library supports (torch autograd, JAX transforms).
AUTOGRAD_LIBRARIES = frozenset({"torch", "jax"})

#: Libraries that compile every operation anew for each new combination of shapes and
#: dtypes (JAX, eagerly: tens of milliseconds each). Tests share shapes on them
#: (``Q``, ``KV``... of ``tests/helpers.py``) and draw random sizes from a few; random
#: sizes of any kind run on them in the ``slow`` tests.
SHAPE_COMPILING_LIBRARIES = frozenset({"jax"})


def native_dtype(b: Backend, dtype: str) -> bool:
    """Whether ``b``'s native kernels compute calls in ``dtype``."""
    return b.library in NATIVE_LIBRARIES and dtype not in NATIVE_REFUSED_DTYPES.get(b.library, {})


def native_lse_device(b: Backend) -> bool:
    """Whether a native kernel returns the log-sum-exp on ``b``'s device in some dtype."""
    return b.library in NATIVE_LIBRARIES


def native_lse(b: Backend, dtype: str) -> bool:
    """Whether a native kernel computes calls returning the log-sum-exp on ``b`` in ``dtype``."""
    refused = NATIVE_LSE_REFUSED_DTYPES.get((b.library, b.device), {})
    return native_lse_device(b) and native_dtype(b, dtype) and dtype not in refused
