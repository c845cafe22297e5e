"""The only module that imports :mod:`array_api_compat`.

Everything else in the package asks this module for an array's namespace and device, so the
dependency is visible in one place.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np
from array_api_compat import (
    device,
    is_array_api_obj,
    is_dask_array,
    is_jax_array,
    is_jax_namespace,
    is_torch_namespace,
)

__all__ = [
    "array_namespace",
    "device",
    "host_values",
    "in_library",
    "is_array_api_obj",
    "is_dask_array",
    "is_jax_namespace",
    "is_torch_namespace",
    "known_value",
    "namespace_name",
    "numpy_namespace",
    "on_device_of",
    "on_gpu",
    "plain_signature",
    "stop_gradient",
]


def array_namespace(named: dict[str, Any]) -> ModuleType:
    """Return the one Array-API namespace shared by the named arrays.

    Parameters
    ----------
    named : dict of str to array or None
        Argument name to value; ``None`` values are ignored.

    Raises
    ------
    TypeError
        If a value is not an array, or the arrays come from different libraries. The message
        names the arguments and their types.
    """
    present = {k: v for k, v in named.items() if v is not None}
    for name, value in present.items():
        if not is_array_api_obj(value):
            raise TypeError(
                f"{name} must be an array (NumPy, CuPy, torch, JAX, Dask or array-api-strict), "
                f"got {type(value).__module__}.{type(value).__qualname__}"
            )
    try:
        return array_api_compat.array_namespace(*present.values())
    except TypeError as exc:
        kinds = ", ".join(
            f"{k}: {type(v).__module__}.{type(v).__qualname__}" for k, v in present.items()
        )
        names = ", ".join(present)
        raise TypeError(f"{names} must come from one array library; got {kinds}") from exc


def numpy_namespace() -> ModuleType:
    """NumPy's Array-API namespace (``array_api_compat.numpy``): the standard's functions
    (``arange(..., device=)`` and the like) on NumPy 1.26 as on 2.x."""
    from array_api_compat import numpy as compat_numpy

    return compat_numpy


def namespace_name(xp: ModuleType) -> str:
    """Short library name of a namespace, for messages (``'numpy'``, ``'torch'``...)."""
    name = xp.__name__.removeprefix("array_api_compat.")
    return name.split(".")[0]


def in_library(xp: ModuleType, a: Any) -> bool:
    """Whether ``a`` is an array of the namespace ``xp``'s library (``False`` for
    anything that is not an array)."""
    try:
        return namespace_name(array_namespace({"array": a})) == namespace_name(xp)
    except TypeError:  # not an array
        return False


def on_device_of(xp: ModuleType, x: Any, target: Any) -> Any:
    """``x`` (an array of ``xp``) on ``target``'s device: moved only where both devices
    are known and differ. A tracer may have no device, or ``None`` (a batched tracer under
    ``jax.vmap``): then ``x`` is used as it is."""
    try:
        here, there = device(x), device(target)
    except Exception:
        return x
    same = here is None or there is None or here == there
    return x if same else xp.asarray(x, device=there)


def on_gpu(x: Any) -> bool:
    """Whether ``x`` lives in a GPU's memory (a CuPy array, a torch tensor on CUDA, a JAX
    array on a ``gpu`` device), where reading its values on the host would wait for the
    device. A JAX tracer has no device: it is taken to run on JAX's default backend."""
    if type(x).__module__.split(".")[0] == "cupy":
        return True
    if is_jax_array(x):
        return _jax_platform(x) == "gpu"
    kind = getattr(getattr(x, "device", None), "type", None)
    return kind is not None and str(kind) == "cuda"


def _jax_platform(x: Any) -> str:
    try:
        return str(x.device.platform)
    except AttributeError:  # a tracer (under jit, grad, vmap)
        import jax

        return str(jax.default_backend())


def plain_signature(x: Any) -> tuple[Any, ...] | None:
    """``(type, shape, dtype, device, requires_grad)`` of an eager NumPy array, torch tensor
    or CuPy array, which is all a call's validation reads of it; ``None`` for anything else
    (subclasses, tensors a ``torch.func`` transform wraps, JAX arrays and tracers, Dask
    arrays, other libraries), whose validation is not cached."""
    kind = type(x)
    if kind is np.ndarray:
        return (kind, x.shape, x.dtype, "cpu", False)
    library = kind.__module__.split(".")[0]
    if library == "torch" and kind.__name__ == "Tensor":
        import torch

        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            return None
        return (kind, tuple(x.shape), x.dtype, x.device, x.requires_grad)
    if library == "cupy" and kind.__name__ == "ndarray":
        return (kind, x.shape, x.dtype, x.device.id, False)
    return None


def known_value(x: Any) -> float | None:
    """The value of a 0-d array as a float, or ``None`` where reading it is not possible.

    Lazy Dask arrays are not computed for it; JAX tracers, torch tensors inside
    ``torch.func.vmap`` and the like refuse to give a value; arrays on a GPU are not read
    (that would wait for the device, a host synchronisation in every call).
    """
    if is_dask_array(x) or on_gpu(x):
        return None
    try:
        return float(x.detach() if hasattr(x, "detach") else x)  # torch: no autograd warning
    except Exception:  # tracers and batched tensors raise library-specific errors
        return None


def host_values(x: Any, *, from_device: bool = True) -> np.ndarray | None:
    """A NumPy copy (or view) of ``x``'s values, or ``None`` where reading them is not possible.

    NumPy arrays are returned as they are; arrays on the CPU are read through DLPack; device
    arrays (CuPy, torch CUDA, JAX on a GPU) are copied to the host, unless ``from_device`` is
    false (the copy would wait for the device). Lazy Dask arrays are not computed, and JAX
    tracers have no values.
    """
    if isinstance(x, np.ndarray):
        return x
    if is_dask_array(x) or (not from_device and on_gpu(x)):
        return None
    try:
        return np.from_dlpack(x)
    except Exception:  # not on the CPU, or a tracer: the libraries raise different errors
        pass
    try:
        if hasattr(x, "get"):  # CuPy
            return np.asarray(x.get())
        if hasattr(x, "cpu"):  # torch on a device
            return np.asarray(x.detach().cpu())
        if array_api_compat.is_jax_array(x):  # on a device (a tracer raises)
            return np.asarray(x)
        return None
    except Exception:
        return None


def stop_gradient(xp: ModuleType, x: Any) -> Any:
    """``x`` as data: torch and JAX autodiff see no dependence on what it was computed from.

    Used on the values of mask and bias functions, which are data to the kernels (their
    gradients are not computed), so that no path differentiates through them.
    """
    if is_torch_namespace(xp):
        return x.detach()
    if is_jax_namespace(xp):
        import jax

        return jax.lax.stop_gradient(x)
    return x


def has_autodiff(xp: ModuleType) -> bool:
    """Whether the namespace's library differentiates by itself (torch, JAX): what
    :func:`elementwise_derivative` needs."""
    return bool(is_torch_namespace(xp) or is_jax_namespace(xp))


def elementwise_derivative(
    xp: ModuleType, f: Callable[[Any], Any], x: Any
) -> tuple[Any, Any] | None:
    """``(f(x), f'(x))`` for an element-wise ``f`` by the library's forward-mode autodiff
    (torch's :func:`torch.func.jvp`, :func:`jax.jvp`, with a tangent of ones); ``None`` for
    a library without autodiff.

    Under torch autograd the result stays differentiable (a gradient of the derivative,
    as double backward needs, is taken through it).
    """
    if is_torch_namespace(xp):
        import torch

        _load_torch_forward_mode()
        return tuple(torch.func.jvp(f, (x,), (torch.ones_like(x),)))
    if is_jax_namespace(xp):
        import jax

        return tuple(jax.jvp(f, (x,), (xp.ones_like(x),)))
    return None


@functools.cache
def _load_torch_forward_mode() -> None:
    """Run torch's forward mode once on a 0-d tensor, without the ``DeprecationWarning``
    that torch's own first use of it raises (it scripts its decompositions with
    ``torch.jit.script``), so a caller's first ``score_mod`` gradient does not show it."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        zero = torch.zeros(())
        torch.func.jvp(torch.neg, (zero,), (zero,))
