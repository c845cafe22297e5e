"""Whether the Triton kernels compute a call exactly, decided before any work.

:func:`plan_triton` raises :class:`CannotUseTritonError` (a ``ValueError``) naming the
first reason the kernels cannot run the call: triton missing, arrays that are neither torch
tensors nor CuPy arrays, a device the kernels do not run on, float64, mask or bias
functions, or head dims above :data:`MAX_HEAD_DIM`. It imports triton only for a call that
passes every other check (to see that it imports), never at sdpa_array's import.
"""

from __future__ import annotations

import importlib.util

from ..._arrays.compat import namespace_name
from ..._errors import CannotUseTritonError
from ..._problem.problem import Inputs, Problem
from .configs import interpreting

__all__ = ["MAX_HEAD_DIM", "CannotUseTritonError", "plan_triton"]

#: Largest query/key and value head dim (each is padded to a power of two, at least 16).
MAX_HEAD_DIM = 256


def _device_reason(p: Problem, lib: str) -> str | None:
    """Why the arrays' device does not suit the kernels, or ``None``."""
    if interpreting():
        if lib != "torch" or p.on_gpu or str(p.device) != "cpu":
            return (
                "triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU torch "
                f"tensors only, got {lib} arrays on {p.device}"
            )
        return None
    if not p.on_gpu:
        return (
            "the Triton kernels run on a CUDA device (or under TRITON_INTERPRET=1 on the "
            f"CPU), got {lib} arrays on {p.device}"
        )
    return None


def _functorch_wrapped(x: Inputs) -> bool:
    """Whether torch.func wraps the tensors (whose memory a kernel cannot address)."""
    import torch

    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return wrapped is not None and any(
        wrapped(a) for a in (x.query, x.key, x.value, x.mask, x.bias, x.sinks) if a is not None
    )


def plan_triton(p: Problem, x: Inputs) -> None:
    """Raise :class:`CannotUseTritonError` unless the Triton kernels compute ``p`` exactly.

    Parameters
    ----------
    p : Problem
        The validated call.
    x : Inputs
        Its arrays.

    Raises
    ------
    CannotUseTritonError
        With the reason: triton is not installed (or does not import); the arrays are not
        torch tensors or CuPy arrays; they are not on a CUDA device (under
        ``TRITON_INTERPRET=1``: not CPU torch tensors); float64 inputs (the kernels compute
        in float32); a ``mask_mod``, ``bias_mod`` or ``score_mod`` (arbitrary Python
        functions: the generic kernels evaluate them); a head dim of 0 or above
        :data:`MAX_HEAD_DIM`; tensors that ``torch.func`` transforms wrap (``vmap``,
        ``grad``). Triton itself
        is imported only for a call that passes every other check.
    """
    if importlib.util.find_spec("triton") is None:
        raise CannotUseTritonError(
            "triton is not installed (pip install triton, or sdpa_array[triton]); the Triton "
            "kernels need it"
        )
    lib = namespace_name(p.xp)
    if lib not in ("torch", "cupy"):
        raise CannotUseTritonError(
            f"the Triton kernels take torch tensors or CuPy arrays, got {lib} arrays"
        )
    reason = _device_reason(p, lib)
    if reason is not None:
        raise CannotUseTritonError(reason)
    if lib == "torch" and _functorch_wrapped(x):
        raise CannotUseTritonError(
            "torch.func transforms (vmap, grad) wrap the tensors, and the Triton kernels "
            "need plain tensors' memory"
        )
    if p.xp.finfo(p.dtype).bits > 32:
        raise CannotUseTritonError(
            f"the Triton kernels compute in float32 and take float16, bfloat16 or float32 "
            f"inputs, got {p.dtype}"
        )
    if p.has_mods:
        given = " and ".join(
            name
            for name, f in (
                ("mask_mod", p.mask_mod),
                ("bias_mod", p.bias_mod),
                ("score_mod", p.score_mod),
            )
            if f
        )
        raise CannotUseTritonError(
            f"{given} is an arbitrary Python function, which the Triton kernels cannot "
            "compile; the blocked or materialized implementations evaluate it"
        )
    if p.left_padded:
        raise CannotUseTritonError(
            "padding_side='left' is computed by the blocked and materialized "
            "implementations; the Triton kernels take right-padded lengths"
        )
    for name, n in (("query/key head dim E", p.E), ("value head dim Ev", p.Ev)):
        if not 0 < n <= MAX_HEAD_DIM:
            raise CannotUseTritonError(
                f"the Triton kernels take head dims from 1 to {MAX_HEAD_DIM}, got {name} = {n}"
            )
    from ._lang import IMPORT_ERROR  # the first import of triton, for calls it may run

    if IMPORT_ERROR is not None:
        raise CannotUseTritonError(f"triton is installed but does not import: {IMPORT_ERROR}")
