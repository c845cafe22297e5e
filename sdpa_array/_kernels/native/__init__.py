"""Delegation to a backend's own fused attention kernel: the one table of native kernels.

:data:`NATIVE_KERNELS` lists every kernel the library can hand a call to, in order of
preference. Each entry's ``plan`` either returns a :class:`Delegation` (a ready-to-run call
whose result has exactly the library's semantics) or raises :class:`CannotDelegateError`
with the reason. :func:`plan_native` tries the entries for the caller's array library and
reports every reason when none fits; nothing else in the package knows about these kernels.

What every delegation does the same way (so the kernels' own rules never leak out):

* on the CPU, inputs are cast to the compute dtype first (float32 for float16/bfloat16), as
  the generic implementations compute, so results agree to float32 accuracy instead of to
  the input precision; on a CUDA device the kernels run in the caller's dtype (their fused
  kernels accumulate in float32 and round the probabilities to the input dtype before the
  product with the values, as FlashAttention does: :func:`kernel_dtype`), since an upcast
  would forgo their tensor-core speed;
* ``scale`` is always passed explicitly; an array ``scale`` is multiplied into the query
  (the kernel gets ``scale=1.0``), so its gradient flows through the library's autodiff;
* the kernels' ``is_causal`` is top-left aligned, so it is used only for ``is_causal`` with
  the diagonal at key ``i`` (``"top_left"``, or ``L == S``) and no window; every other
  positional restriction (bottom-right with ``L != S``, windows) becomes an explicit
  boolean mask built from the call's :class:`~sdpa_array._problem.band.Band` (``builds_mask``);
* query and key lengths (torch's CPU flash kernel only) become a key mask ``(..., 1, 1, S)``
  beside the kernel's causal rule, and the rows they leave without a key are known from
  the lengths (:func:`~.delegation.length_terms`), so no ``(L, S)`` array is formed;
* rows with no admissible key get zeros and a log-sum-exp of ``-inf`` afterwards, whatever
  the kernel gave (torch < 2.5: NaN; JAX: the mean of the values or NaN); sinks and
  dropout are refused (no kernel has the first, none draws the keep mask's bits);
* NumPy arrays have one row, off by default: torch's kernels on the same memory
  (:mod:`~.torch_on_numpy`), tried only once the caller allowed that optional kernel
  (``sdpa_array.set_optional_kernels("torch")``, the row's ``optional``);
* ``return_weights`` needs the kernel's log-sum-exp: the weights are then formed once as
  ``exp(scores - lse)`` with the shared score builder (the output and log-sum-exp still
  come from the kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._arrays.compat import namespace_name
from ..._arrays.typing import Array
from ..._problem.outputs import Outputs
from ..._problem.problem import Inputs, Problem
from ..layout import grouped_operand, grouped_score_term
from ..result import AttentionResult, RawGrads
from .delegation import (
    CannotDelegateError,
    Delegation,
    NativeKernel,
    Request,
    kernel_dtype,
)
from .jax_kernel import plan_jax
from .torch_kernels import (
    CUDA_LSE_KERNELS,
    plan_torch_cpu_flash,
    plan_torch_cuda_lse,
    plan_torch_public,
)
from .torch_on_numpy import allowed, numpy_vjp, plan_torch_on_numpy

__all__ = [
    "NATIVE_KERNELS",
    "CannotDelegateError",
    "Delegation",
    "NativeKernel",
    "Request",
    "kernel_dtype",
    "native_attention",
    "native_vjp",
    "plan_native",
    "plan_native_vjp",
]

#: The delegation table: for each library, its kernels in order of preference.
NATIVE_KERNELS: tuple[NativeKernel, ...] = (
    NativeKernel("torch.nn.functional.scaled_dot_product_attention", "torch", plan_torch_public),
    NativeKernel(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", "torch", plan_torch_cpu_flash
    ),
    *(NativeKernel(kernel, "torch", plan_torch_cuda_lse(kernel)) for kernel in CUDA_LSE_KERNELS),
    NativeKernel("jax.nn.dot_product_attention", "jax", plan_jax),
    NativeKernel("torch's kernels on NumPy memory", "numpy", plan_torch_on_numpy, optional="torch"),
)


def plan_native(p: Problem, req: Request) -> Delegation:
    """The first kernel of :data:`NATIVE_KERNELS` that computes the call exactly.

    Raises
    ------
    CannotDelegateError
        If none does; the message gives each candidate's reason.
    """
    library = namespace_name(p.xp)
    rows = [row for row in NATIVE_KERNELS if row.library == library]
    candidates = [row for row in rows if row.optional is None or row.optional in allowed()]
    if not candidates:
        known = sorted({row.library for row in NATIVE_KERNELS if row.optional is None})
        hints = "".join(
            f"; {row.kernel} once sdpa_array.set_optional_kernels({row.optional!r}) allows them"
            for row in rows
        )
        raise CannotDelegateError(
            f"implementation='native' has no kernel for {library} arrays; native kernels "
            f"exist for {', '.join(known)}{hints}"
        )
    reasons = []
    for row in candidates:
        try:
            return row.plan(p, req)
        except CannotDelegateError as exc:
            reasons.append(f"{row.kernel}: {exc}")
    raise CannotDelegateError(
        "implementation='native' cannot compute this call exactly: " + "; ".join(reasons)
    )


def native_attention(p: Problem, x: Inputs, outputs: Outputs) -> AttentionResult:
    """Run the call on the first native kernel that computes it exactly.

    Raises
    ------
    CannotDelegateError
        If no native kernel does (see :func:`plan_native`).
    """
    req = Request(x, outputs)
    return plan_native(p, req).run()


# --- the backward pass: the library's own autodiff of the delegated call ------------------


def _torch_vjp(p: Problem, x: Inputs, grad_output: Any) -> RawGrads:
    """torch: differentiate the delegated forward call (its fused backward kernel runs)."""
    import torch

    q, k, v = (t.detach().requires_grad_() for t in (x.query, x.key, x.value))
    bias = None if x.bias is None else x.bias.detach().requires_grad_()
    wrt = [q, k, v, *([] if bias is None else [bias])]
    leaf_inputs = Inputs(q, k, v, x.mask, bias, x.scale, x.sinks)
    with torch.enable_grad():
        out = plan_native(p, Request(leaf_inputs)).run().out
        grads = torch.autograd.grad(
            out, wrt, grad_output.to(out.dtype), allow_unused=True, materialize_grads=True
        )
    return _raw_grads(p, grads)


def _jax_vjp(p: Problem, x: Inputs, grad_output: Any) -> RawGrads:
    """JAX: ``jax.vjp`` of the delegated forward call."""
    import jax

    def call(q: Any, k: Any, v: Any, bias: Any) -> Any:
        leaf_inputs = Inputs(q, k, v, x.mask, bias, x.scale, x.sinks)
        return plan_native(p, Request(leaf_inputs)).run().out

    out, pullback = jax.vjp(call, x.query, x.key, x.value, x.bias)
    grads = pullback(p.xp.astype(grad_output, out.dtype))
    return _raw_grads(p, grads if x.bias is not None else grads[:3])


def _raw_grads(p: Problem, grads: Any) -> RawGrads:
    """The gradients in the backward kernels' grouped layout (:class:`RawGrads`)."""
    dq, dk, dv = grads[:3]
    dbias = grads[3] if len(grads) > 3 else None
    if p.grouped:
        dq = grouped_operand(p, dq, query=True)
        dbias = None if dbias is None else grouped_score_term(p, dbias)
    return RawGrads(dq=dq, dk=dk, dv=dv, dbias=dbias)


def _numpy_vjp(p: Problem, x: Inputs, grad_output: Any) -> RawGrads:
    """NumPy, where torch's kernels on NumPy memory are allowed: torch's backward."""
    return numpy_vjp(p, x, grad_output, _torch_vjp)


_VJP_BY_LIBRARY: dict[str, Callable[[Problem, Inputs, Any], RawGrads]] = {
    "torch": _torch_vjp,
    "jax": _jax_vjp,
    "numpy": _numpy_vjp,
}

#: Libraries whose backward is an optional kernel, and the name the caller must allow.
_VJP_OPTIONAL = {"numpy": "torch"}


def plan_native_vjp(p: Problem, x: Inputs) -> Delegation:
    """The native forward call whose autodiff gives the VJP (see :func:`native_vjp`).

    Raises
    ------
    CannotDelegateError
        For a library without autodiff of its kernels, or a call no native kernel computes.
    """
    library = namespace_name(p.xp)
    optional = _VJP_OPTIONAL.get(library)
    if library not in _VJP_BY_LIBRARY or (optional is not None and optional not in allowed()):
        known = sorted(name for name in _VJP_BY_LIBRARY if name not in _VJP_OPTIONAL)
        hint = (
            f"; torch's backward on NumPy memory once sdpa_array.set_optional_kernels("
            f"{optional!r}) allows it"
            if optional
            else ""
        )
        raise CannotDelegateError(
            f"implementation='native' has no backward for {library} arrays; it differentiates "
            f"the native kernels of {', '.join(known)}{hint}"
        )
    return plan_native(p, Request(x))


def native_vjp(
    p: Problem,
    x: Inputs,
    grad_output: Array,
    *,
    out: Array = None,
    lse: Array = None,
    grad_lse: Array = None,
) -> RawGrads:
    """The VJP through the native kernel's own backward pass (torch autograd, ``jax.vjp``).

    The forward call is recomputed (``out`` and ``lse`` are not used: the kernels' backward
    ops save their own residuals). A log-sum-exp cotangent cannot be passed to those ops, so
    the dispatcher never sends one here.

    Raises
    ------
    CannotDelegateError
        As :func:`plan_native_vjp`.
    ValueError
        If ``grad_lse`` is given.
    """
    if grad_lse is not None:
        raise ValueError("the native backward takes no log-sum-exp cotangent")
    plan_native_vjp(p, x)
    return _VJP_BY_LIBRARY[namespace_name(p.xp)](p, x, grad_output)
