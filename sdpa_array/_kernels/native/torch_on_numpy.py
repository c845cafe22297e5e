"""torch's CPU kernels on NumPy memory: an optional extra of the NumPy path, off by default.

Where torch is installed and the caller allowed it (:func:`allow`, what
``sdpa_array.set_optional_kernels("torch")`` sets), a NumPy call is handed to torch's
kernels as :mod:`~sdpa_array._kernels.native.torch_kernels` plans them for torch tensors:
the arrays are shared through ``torch.from_numpy`` (no copy; read-only arrays, arrays with
negative strides and non-native byte orders are copied first, which torch does not take,
their broadcast axes once),
the :class:`~sdpa_array._problem.problem.Problem` is the same call on torch's namespace, and
every array of the result comes back through ``.numpy()``, again without a copy. The
checks, casts and fixes of every torch delegation apply unchanged; the library's pure
Array-API path stays the default and the reference this route is tested against.

What it refuses beside what torch's kernels refuse: lengths and segment ids and an array
``scale`` (arrays the torch call would need in torch's namespace too), and dtypes torch
has no counterpart of (NumPy float16, float32 and float64 only).

Measured (``asv_benchmarks/studies/optional_kernels.py``, 2 threads, float32): torch's
forward takes 0.58-0.69 of our time from 1x8x128x64 to 1x8x512x64 and 0.88-0.96 at
1x8x1024x64 and 1x8x4096x64; its backward (with the forward recomputed, as our VJP
recomputes the scores) 1.1-1.6x ours from 1x8x512x64 up. ``"auto"`` hence takes this route
for the forward only (the VJP's ``"auto"`` keeps the library's own backward off a GPU);
``implementation="native"`` takes it for both.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from ..._arrays.compat import array_namespace
from ..._problem.problem import Inputs, Problem
from ..result import AttentionResult, RawGrads
from .delegation import CannotDelegateError, Delegation, Request, refuse
from .torch_kernels import plan_torch_cpu_flash, plan_torch_public

__all__ = [
    "KNOWN",
    "allow",
    "allowed",
    "numpy_vjp",
    "plan_torch_on_numpy",
    "to_numpy",
    "torch_call",
]

#: The optional kernels a caller may allow, by name.
KNOWN = ("torch",)

#: Suffix of the kernel names this route gives (what ``explain()`` shows).
ON_NUMPY = " on NumPy memory"

_lock = threading.Lock()
_allowed: frozenset[str] = frozenset()


def allow(names: frozenset[str]) -> None:
    """Allow exactly the optional kernels ``names`` (a subset of :data:`KNOWN`)."""
    global _allowed
    with _lock:
        _allowed = names


def allowed() -> frozenset[str]:
    """The optional kernels the caller allowed."""
    return _allowed


def _shared(x: Any) -> Any:
    """``x`` as a torch tensor on the same memory (a copy only where torch refuses it)."""
    if x is None:
        return None
    import torch

    if x.flags.writeable and all(s >= 0 for s in x.strides) and x.dtype.isnative:
        return torch.from_numpy(x)
    # a copy of the distinct elements only: a broadcast axis (stride 0) is copied once and
    # expanded again by torch, without memory
    distinct = tuple(
        slice(0, 1) if s == 0 else slice(None) for s, n in zip(x.strides, x.shape, strict=True)
    )
    small = np.array(x[distinct], dtype=x.dtype.newbyteorder("="))
    return torch.from_numpy(small).expand(x.shape)


def torch_call(p: Problem, x: Inputs) -> tuple[Problem, Inputs]:
    """The call on torch's namespace: the same problem, the arrays shared with torch.

    Raises
    ------
    CannotDelegateError
        If the route is not allowed, torch is missing, or the call needs what it refuses.
    """
    if "torch" not in _allowed:
        raise refuse("optional kernels are off: sdpa_array.set_optional_kernels('torch') allows it")
    try:
        import torch
    except ImportError:
        raise refuse("torch is not installed") from None
    if p.has_sequences:
        raise refuse("query/key lengths and segment ids are not passed to torch")
    if p.scale_is_array:
        raise refuse("an array scale is not passed to torch")
    name = np.dtype(p.dtype).name
    if name not in ("float16", "float32", "float64"):
        raise refuse(f"torch has no counterpart of NumPy's {name}")
    arrays = [_shared(a) for a in (x.query, x.key, x.value, x.mask, x.bias)]
    dtype = getattr(torch, name)
    compute = getattr(torch, np.dtype(p.compute_dtype).name)
    xp = array_namespace({"query": arrays[0]})
    pt = dataclasses.replace(p, xp=xp, device=arrays[0].device, dtype=dtype, compute_dtype=compute)
    return pt, Inputs(*arrays)


def to_numpy(result: Any) -> Any:
    """An :class:`AttentionResult` or :class:`RawGrads` with its tensors as NumPy arrays."""
    import torch

    def back(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.detach().numpy()
        if isinstance(a, tuple):
            return tuple(back(b) for b in a)
        return a

    return dataclasses.replace(
        result, **{f.name: back(getattr(result, f.name)) for f in dataclasses.fields(result)}
    )


def plan_torch_on_numpy(p: Problem, req: Request) -> Delegation:
    """torch's public kernel, else its CPU flash kernel (which returns the log-sum-exp), on
    the NumPy call's memory, where the caller allowed it."""
    pt, xt = torch_call(p, req.inputs)
    inner = Request(xt, req.outputs)
    reasons = []
    for plan in (plan_torch_public, plan_torch_cpu_flash):
        try:
            delegation = plan(pt, inner)
        except CannotDelegateError as exc:
            reasons.append(f"{plan.__name__}: {exc}")
            continue

        def run(delegation: Delegation = delegation) -> AttentionResult:
            result: AttentionResult = to_numpy(delegation.run())
            return result

        return dataclasses.replace(
            delegation, kernel=delegation.kernel + ON_NUMPY, run=run, direct=None
        )
    raise refuse("; ".join(reasons))


def numpy_vjp(p: Problem, x: Inputs, grad_output: Any, torch_vjp: Any) -> RawGrads:
    """The VJP through torch's backward on the NumPy call's memory (``torch_vjp``: the
    torch delegation's own VJP), the gradients back as NumPy arrays."""
    pt, xt = torch_call(p, x)
    grads: RawGrads = to_numpy(torch_vjp(pt, xt, _shared(grad_output)))
    return grads
