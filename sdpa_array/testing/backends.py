"""The one registry of array backends that tests, benchmarks, the demo and docs share.

Each :class:`Backend` names an array library and a device, the dtypes it supports, how to
move a NumPy array onto it and how to wait for its queued work. Nothing in the attention
maths reads this module: it exists so that the *callers* of the library (the test suite,
the asv benchmarks, ``python -m sdpa_array demo`` and the docs' support table) enumerate
backends from a single list instead of writing it several times.

Looking a backend up imports nothing and changes no setting; :meth:`Backend.configure`
applies the process-wide settings exact comparisons need (JAX's float64, the highest
matrix-product precision, no TF32), and the test session and the benchmarks call it.

Examples
--------
>>> from sdpa_array.testing.backends import BACKENDS, get_backend
>>> [b.id for b in BACKENDS][:3]
['numpy', 'numpy:readonly', 'strict']
>>> get_backend("numpy").is_available()
True
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailable",
    "available_backends",
    "get_backend",
]

#: dtype names in the order tests and tables list them.
ALL_DTYPES = ("float16", "bfloat16", "float32", "float64")


class BackendUnavailable(RuntimeError):
    """Raised when a backend's library or device is not present on this machine.

    Examples
    --------
    >>> from sdpa_array.testing import BackendUnavailable, get_backend
    >>> try:
    ...     get_backend("cupy").namespace()  # no CuPy, or no GPU
    ... except BackendUnavailable:
    ...     print("not here")
    not here
    """


def _torch_device_present(device: str) -> bool:
    import torch

    if device == "cpu":
        return True
    return bool(torch.cuda.is_available())


def _cupy_device_present(device: str) -> bool:
    import cupy

    try:
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # CUDA driver missing or broken
        return False


def _jax_device_present(device: str) -> bool:
    import jax

    return bool(jax.devices(device))


def _always(device: str) -> bool:
    return True


def _torch_sync(x: Any) -> None:
    import torch

    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def _cupy_sync(x: Any) -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def _jax_sync(x: Any) -> None:
    x.block_until_ready()


def _no_sync(x: Any) -> None:
    return None


def _dask_sync(x: Any) -> None:
    x.compute()  # a lazy backend has done no work until it computes


def _from_numpy_torch(a: np.ndarray, dtype: str, device: str) -> Any:
    import torch

    # np.array, not np.ascontiguousarray, which turns a 0-d array into shape (1,)
    return torch.from_numpy(np.array(a, order="C")).to(device=device, dtype=getattr(torch, dtype))


def _from_numpy_cupy(a: np.ndarray, dtype: str, device: str) -> Any:
    import cupy

    return cupy.asarray(a).astype(dtype)


def _from_numpy_jax(a: np.ndarray, dtype: str, device: str) -> Any:
    import jax
    import jax.numpy as jnp

    dev = jax.devices(device)[0]
    return jax.device_put(jnp.asarray(a, dtype=getattr(jnp, dtype)), dev)


def _from_numpy_readonly(a: np.ndarray, dtype: str, device: str) -> Any:
    x = np.array(a, dtype=dtype)
    x.flags.writeable = False
    return x


def _from_numpy_plain(module: str) -> Callable[[np.ndarray, str, str], Any]:
    def convert(a: np.ndarray, dtype: str, device: str) -> Any:
        xp = importlib.import_module(module)
        if module == "dask.array":
            return xp.from_array(a.astype(dtype), chunks=-1)
        if module == "numpy":  # NumPy 1.x warns on ``numpy.bool``
            return np.asarray(a, dtype=dtype)
        return xp.asarray(np.asarray(a, dtype=dtype), dtype=getattr(xp, dtype))

    return convert


def _configure_jax() -> None:
    import jax

    config: Any = jax.config  # untyped in some JAX versions, typed in others
    config.update("jax_enable_x64", True)
    config.update("jax_default_matmul_precision", "highest")


def _configure_torch() -> None:
    import torch

    torch.set_float32_matmul_precision("highest")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _configure_cupy() -> None:
    import os

    os.environ.setdefault("CUPY_TF32", "0")


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Backend:
    """One array library on one device.

    The entries of :data:`BACKENDS` are the instances; each parameter is the field of the
    same name.

    Parameters
    ----------
    id : str
        Readable id used on the command line and in test ids: ``numpy``, ``strict``,
        ``torch``, ``torch:cuda``, ``jax``, ``dask``, ``cupy``.
    module : str
        Module whose arrays the backend holds (``"array_api_strict"``, ``"jax.numpy"``...).
    device : str
        ``"cpu"`` or ``"cuda"``.
    dtypes : tuple of str
        Floating dtypes this backend supports.
    extra : str
        The ``pip install sdpa_array[extra]`` name that installs it.
    nox_session : str
        The nox session that tests it.
    needs_gpu : bool, default False
        Whether it needs a CUDA device.
    _present : callable, optional
        ``_present(device) -> bool``: whether the device is present, asked once the library
        is known to be installed. Default: always present.
    _convert : callable or None, default None
        ``_convert(a, dtype, device)``: the backend's array of NumPy array ``a``, with the
        dtype name ``dtype``, on ``device``. ``None``: the module's ``asarray`` (Dask's
        ``from_array``, in one chunk).
    _sync : callable, optional
        ``_sync(x)``: block until the work that produced ``x`` has finished. Default: return
        at once.
    _configure : callable, optional
        ``_configure()``: apply the settings of :meth:`configure`. Default: nothing.

    Examples
    --------
    >>> from sdpa_array.testing import get_backend
    >>> numpy = get_backend("numpy")
    >>> numpy.module, numpy.device, numpy.dtypes
    ('numpy', 'cpu', ('float16', 'float32', 'float64'))
    >>> x = numpy.asarray([[1.0, 2.0]], dtype="float32")
    >>> x.dtype
    dtype('float32')
    """

    id: str
    module: str
    device: str
    dtypes: tuple[str, ...]
    extra: str
    nox_session: str
    needs_gpu: bool = False
    _present: Callable[[str], bool] = field(default=_always, repr=False, compare=False)
    _convert: Callable[[np.ndarray, str, str], Any] | None = field(
        default=None, repr=False, compare=False
    )
    _sync: Callable[[Any], None] = field(default=_no_sync, repr=False, compare=False)
    _configure: Callable[[], None] = field(default=_nothing, repr=False, compare=False)

    @property
    def library(self) -> str:
        """Top-level package name (``torch`` for ``torch:cuda``)."""
        return self.module.split(".")[0]

    def is_installed(self) -> bool:
        """Whether the backend's library can be imported (without importing it).

        Returns
        -------
        bool
            Whether :func:`importlib.util.find_spec` finds :attr:`library`.
        """
        return importlib.util.find_spec(self.library) is not None

    def is_available(self) -> bool:
        """Whether the library imports and the device is present (changes no setting).

        Returns
        -------
        bool
            ``True`` if the library is installed and the device check says present;
            ``False`` also when that check raises.
        """
        if not self.is_installed():
            return False
        try:
            return bool(self._present(self.device))
        except Exception:
            return False

    def configure(self) -> None:
        """Apply the process-wide settings that exact comparisons need.

        JAX: float64 enabled and the highest matrix-product precision; torch: the highest
        float32 matrix-product precision and no TF32; CuPy: no TF32. Call it once, before
        making arrays (the test session and the benchmarks' setup do).
        """
        self._configure()

    def namespace(self) -> ModuleType:
        """Import and return the backend's array module.

        It changes no setting: :meth:`configure` does.

        Returns
        -------
        module
            The module named by :attr:`module` (``jax.numpy``, ``array_api_strict``...).

        Raises
        ------
        BackendUnavailable
            If the library is not installed or the device is absent.
        """
        if not self.is_available():
            raise BackendUnavailable(
                f"backend {self.id!r} needs {self.module!r} on device {self.device!r}, "
                "which is not available here"
            )
        return importlib.import_module(self.module)

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        """Copy NumPy data ``a`` onto this backend's device with the given dtype name.

        Parameters
        ----------
        a : array_like
            The data, read with :func:`numpy.asarray`.
        dtype : str, optional
            Dtype name on the backend (``"float32"``, ``"bfloat16"``, ``"bool"``...);
            default: the dtype of ``a``. Boolean data gives a boolean array whatever the
            dtype.

        Returns
        -------
        array
            An array of the backend's library on its device.

        Raises
        ------
        ValueError
            If ``a`` holds floats and ``dtype`` is not one of :attr:`dtypes`.
        BackendUnavailable
            If the library or the device is absent.
        """
        arr = np.asarray(a)
        dtype = dtype or str(arr.dtype)
        if dtype not in self.dtypes and arr.dtype.kind == "f":
            raise ValueError(f"backend {self.id!r} does not support dtype {dtype!r}")
        self.namespace()
        if arr.dtype.kind in "fc" and dtype == "bfloat16":
            arr = arr.astype(np.float32)
        convert = self._convert or _from_numpy_plain(self.module)
        if arr.dtype.kind == "b" or dtype == "bool":
            return convert(arr.astype(bool), "bool", self.device)
        return convert(arr, dtype, self.device)

    def synchronize(self, x: Any) -> None:
        """Block until the work that produced ``x`` has finished (GPU timing).

        Parameters
        ----------
        x : array
            An array of this backend (a Dask array is computed).
        """
        self._sync(x)


BACKENDS: tuple[Backend, ...] = (
    Backend("numpy", "numpy", "cpu", ("float16", "float32", "float64"), "", "tests-numpy"),
    # NumPy arrays with writeable=False: every path must leave its inputs alone.
    Backend(
        "numpy:readonly",
        "numpy",
        "cpu",
        ("float16", "float32", "float64"),
        "",
        "tests-numpy",
        _convert=_from_numpy_readonly,
    ),
    Backend("strict", "array_api_strict", "cpu", ("float32", "float64"), "strict", "tests-strict"),
    Backend(
        "torch",
        "torch",
        "cpu",
        ALL_DTYPES,
        "torch",
        "tests-torch",
        _present=_torch_device_present,
        _convert=_from_numpy_torch,
        _sync=_torch_sync,
        _configure=_configure_torch,
    ),
    Backend(
        "torch:cuda",
        "torch",
        "cuda",
        ALL_DTYPES,
        "torch",
        "tests-cuda",
        needs_gpu=True,
        _present=_torch_device_present,
        _convert=_from_numpy_torch,
        _sync=_torch_sync,
        _configure=_configure_torch,
    ),
    Backend(
        "jax",
        "jax.numpy",
        "cpu",
        ALL_DTYPES,
        "jax",
        "tests-jax",
        _present=_jax_device_present,
        _convert=_from_numpy_jax,
        _sync=_jax_sync,
        _configure=_configure_jax,
    ),
    Backend(
        "jax:cuda",
        "jax.numpy",
        "cuda",
        ALL_DTYPES,
        "jax",
        "tests-jax-cuda",
        needs_gpu=True,
        _present=_jax_device_present,
        _convert=_from_numpy_jax,
        _sync=_jax_sync,
        _configure=_configure_jax,
    ),
    Backend(
        "dask",
        "dask.array",
        "cpu",
        ("float16", "float32", "float64"),
        "dask",
        "tests-dask",
        _sync=_dask_sync,
    ),
    Backend(
        "cupy",
        "cupy",
        "cuda",
        ("float16", "float32", "float64"),
        "cupy",
        "tests-cupy",
        needs_gpu=True,
        _present=_cupy_device_present,
        _convert=_from_numpy_cupy,
        _sync=_cupy_sync,
        _configure=_configure_cupy,
    ),
)


def get_backend(backend_id: str) -> Backend:
    """Return the registered backend called ``backend_id``.

    Parameters
    ----------
    backend_id : str
        Its :attr:`Backend.id`, e.g. ``"numpy"`` or ``"torch:cuda"``.

    Returns
    -------
    Backend
        The entry of :data:`BACKENDS` with that id (whether available or not).

    Raises
    ------
    ValueError
        If no backend has that id.

    Examples
    --------
    >>> from sdpa_array.testing import get_backend
    >>> get_backend("torch:cuda").needs_gpu
    True
    """
    for b in BACKENDS:
        if b.id == backend_id:
            return b
    known = ", ".join(b.id for b in BACKENDS)
    raise ValueError(f"unknown backend {backend_id!r}; known backends: {known}")


def available_backends() -> list[Backend]:
    """Backends whose library and device are present on this machine.

    Returns
    -------
    list of Backend
        The entries of :data:`BACKENDS` whose :meth:`Backend.is_available` is true, in
        their order.

    Examples
    --------
    >>> from sdpa_array.testing import available_backends
    >>> "numpy" in [b.id for b in available_backends()]
    True
    """
    return [b for b in BACKENDS if b.is_available()]
