"""Conversion of any supported library's arrays to NumPy on the host (the oracle's input)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_float64", "to_numpy"]


def to_numpy(x: Any) -> np.ndarray:
    """Copy an array of any supported library to a NumPy array on the host.

    Parameters
    ----------
    x : array_like
        A NumPy, torch (any device, any dtype, with or without ``requires_grad``), JAX,
        Dask, array-api-strict or CuPy array, or anything :func:`numpy.asarray` accepts
        (Python scalars, nested lists).

    Returns
    -------
    numpy.ndarray
        A new NumPy array that shares no memory with ``x``. Its dtype is the closest NumPy
        dtype to that of ``x``; ``bfloat16`` (which NumPy lacks; torch and JAX have it)
        becomes ``float32``.

    Notes
    -----
    Dask arrays are computed. Array-api-strict arrays on one of its simulated non-CPU
    devices are first moved to its CPU device.

    Examples
    --------
    >>> to_numpy([1, 2, 3])
    array([1, 2, 3])
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return np.array(x, copy=True)

    library = type(x).__module__.split(".")[0]

    if library == "torch":
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)
        return np.array(t.resolve_conj().resolve_neg().numpy(), copy=True)

    if library == "cupy":
        return np.array(x.get(), copy=True)

    if library == "array_api_strict":
        import array_api_strict

        cpu = array_api_strict.Device("CPU_DEVICE")
        if x.device != cpu:
            x = x.to_device(cpu)
        return np.array(np.from_dlpack(x), copy=True)

    if library == "dask":
        return np.array(x.compute(), copy=True)

    # JAX arrays, Python scalars and sequences, and anything else with __array__.
    try:
        result = np.array(x, copy=True)
    except (TypeError, ValueError):
        result = np.array(np.from_dlpack(x), copy=True)
    if result.dtype.name == "bfloat16":  # JAX's ml_dtypes.bfloat16: widen, as for torch
        result = result.astype(np.float32)
    return result


def as_float64(x: Any) -> np.ndarray:
    """``x`` on the host as a float64 NumPy array."""
    return to_numpy(x).astype(np.float64)
