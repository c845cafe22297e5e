"""Delegation to a backend's own fused attention kernel: the one table of native kernels.

:data:`NATIVE_KERNELS` lists every kernel the library can hand a call to, in order of
preference. Each entry's ``plan`` either returns a :class:`Delegation` (a ready-to-run call
whose result has exactly the library's semantics) or raises :class:`CannotDelegateError`
with the reason. :func:`plan_native` tries the entries for the caller's array library and
reports every reason when none fits; nothing else in the package knows about these kernels.

What every delegation does the same way (so the kernels' own rules never leak out):

* inputs are cast to the compute dtype first (float32 for float16/bfloat16), as the generic
  implementations compute, so results agree to float32 accuracy instead of to the input
  precision;
* ``scale`` is always passed explicitly; an array ``scale`` is multiplied into the query
  (the kernel gets ``scale=1.0``), so its gradient flows through the library's autodiff;
* the kernels' ``is_causal`` is top-left aligned, so it is used only for ``is_causal`` with
  the diagonal at key ``i`` (``"top_left"``, or ``L == S``) and no window; every other
  positional restriction (bottom-right with ``L != S``, windows) becomes an explicit
  boolean mask built from the call's :class:`~.restrictions.Band` (``builds_mask``);
* rows with no admissible key get zeros and a log-sum-exp of ``-inf`` afterwards, whatever
  the kernel gave (torch < 2.5: NaN; JAX: the mean of the values or NaN); sinks and
  dropout are refused (no kernel has the first, none draws the keep mask's bits);
* ``return_weights`` needs the kernel's log-sum-exp: the weights are then formed once as
  ``exp(scores - lse)`` with the shared score builder (the output and log-sum-exp still
  come from the kernel).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._compat import namespace_name
from .._problem import Inputs, Problem
from .._result import AttentionResult
from .._typing import Array
from .layout import leading_axes, ungroup
from .operands import kernel_scale, prepare, tile_scores
from .softmax import exp_shift

__all__ = [
    "NATIVE_KERNELS",
    "CannotDelegateError",
    "Delegation",
    "NativeKernel",
    "Request",
    "native_attention",
    "plan_native",
]


class CannotDelegateError(ValueError):
    """``implementation="native"`` was asked for a call no native kernel computes exactly.

    The message lists, for each kernel of the caller's library, why it does not apply.
    """


@dataclass(frozen=True)
class Request:
    """The caller's arrays and output flags, beside the validated :class:`Problem`."""

    inputs: Inputs
    return_weights: bool
    return_lse: bool

    @property
    def mask(self) -> Array:
        return self.inputs.mask

    @property
    def bias(self) -> Array:
        return self.inputs.bias


@dataclass(frozen=True)
class Delegation:
    """A call that a native kernel will compute exactly, ready to run.

    Attributes
    ----------
    kernel : str
        Qualified name of the kernel.
    memory_efficient : bool
        Whether the kernel avoids forming the ``(L, S)`` score matrix.
    builds_mask : bool
        Whether an ``(L, S)`` mask the caller did not pass is built to express the call.
    run : callable
        Computes the call.
    twice_differentiable : bool
        Whether the library can differentiate the kernel's own backward pass (double
        backward); where it cannot, :mod:`sdpa_array._autograd` differentiates the call
        through our backward kernels instead.
    """

    kernel: str
    memory_efficient: bool
    builds_mask: bool
    run: Callable[[], AttentionResult]
    twice_differentiable: bool = True


@dataclass(frozen=True)
class NativeKernel:
    """One row of the delegation table.

    Attributes
    ----------
    kernel : str
        Qualified name of the kernel (shown in messages).
    library : str
        Array library whose arrays it takes (as :func:`namespace_name` spells it).
    plan : callable
        ``plan(problem, request) -> Delegation``; raises :class:`CannotDelegateError`.
    """

    kernel: str
    library: str
    plan: Callable[[Problem, Request], Delegation]


# --- shared, library-independent pieces ---------------------------------------------------


def _refuse(reason: str) -> CannotDelegateError:
    return CannotDelegateError(reason)


def _common_checks(p: Problem) -> None:
    for refused, reason in (
        (p.has_sequences, "query/key lengths and segment ids are not delegated"),
        (p.softcap is not None, "no native kernel applies a softcap"),
        (p.has_sinks, "no native kernel adds attention sinks"),
        (p.dropout_p > 0, "native dropout does not draw dropout_keep_mask's bits"),
        (p.has_mods, "mask_mod/bias_mod are not delegated (see docs: implementations)"),
        (p.E == 0, "E == 0 (empty feature axis)"),
    ):
        if refused:
            raise _refuse(reason)


@dataclass(frozen=True)
class _Terms:
    """Mask and bias as a kernel takes them, and which rows keep an admissible key."""

    is_causal: bool
    mask: Any
    bias: Any
    row_ok: Any


def _kernel_causal(p: Problem, has_terms: bool) -> bool:
    """Whether the kernel's own (top-left) ``is_causal`` expresses all positional rules.

    Only without a mask or bias: torch refuses ``is_causal`` beside a mask, and with one,
    the rows left with no admissible key must be known (:func:`_fix_empty_rows`), which
    needs the positional restriction as a mask anyway.
    """
    pos = p.band
    top_left_causal = pos.is_causal and pos.left is None and pos.right is None and pos.offset == 0
    return top_left_causal and not has_terms


def _builds_mask(p: Problem, has_terms: bool) -> bool:
    """Whether :func:`_score_terms` will build an ``(L, S)`` positional mask."""
    return p.band.restricts and not _kernel_causal(p, has_terms)


def _score_terms(p: Problem, mask: Any, bias: Any, *, merge: bool) -> _Terms:
    """Express mask, bias and positions with the kernel's arguments.

    ``merge``: fold every boolean restriction into one additive float mask (``-inf`` where
    excluded); needed when a kernel takes only one mask argument, or treats a boolean mask
    with a large finite negative instead of ``-inf``.
    """
    xp = p.xp
    has_terms = mask is not None or bias is not None
    is_causal = _kernel_causal(p, has_terms)
    positional = None
    if _builds_mask(p, has_terms):
        positional = p.band.tile_mask(xp, p.device, slice(0, p.L), slice(0, p.S))
    allowed = mask
    if positional is not None:
        allowed = positional if allowed is None else xp.logical_and(allowed, positional)
    if bias is not None:
        bias = xp.astype(bias, p.compute_dtype, copy=False)
    neg_inf = xp.asarray(-math.inf, dtype=p.compute_dtype, device=p.device)
    row_ok = None
    if allowed is not None or bias is not None:
        ok = allowed
        if bias is not None:
            finite = bias != neg_inf
            ok = finite if ok is None else xp.logical_and(ok, finite)
        row_ok = xp.any(ok, axis=-1, keepdims=True)
    if merge and allowed is not None:
        zero = xp.asarray(0.0, dtype=p.compute_dtype, device=p.device)
        bias, allowed = xp.where(allowed, zero if bias is None else bias, neg_inf), None
    return _Terms(is_causal, allowed, bias, row_ok)


def _fix_empty_rows(p: Problem, terms: _Terms, out: Any, lse: Any) -> tuple[Any, Any]:
    """Zeros and ``-inf`` for rows with no admissible key, whatever the kernel gave."""
    if terms.row_ok is None:
        return out, lse
    xp = p.xp
    out = xp.where(terms.row_ok, out, xp.asarray(0.0, dtype=out.dtype, device=p.device))
    if lse is not None:
        neg_inf = xp.asarray(-math.inf, dtype=lse.dtype, device=p.device)
        lse = xp.where(terms.row_ok[..., 0], lse, neg_inf)
    return out, lse


def _weights_from_lse(p: Problem, req: Request, lse: Any) -> Any:
    """``exp(scores - lse)``: the weights, formed once with the shared score builder."""
    xp = p.xp
    ops = prepare(p, req.inputs)
    s, _ = tile_scores(p, ops, ops.q, slice(0, p.L), slice(0, p.S))
    lse = xp.astype(lse, p.compute_dtype, copy=False)
    if p.grouped:
        lse = xp.reshape(lse, (*lse.shape[:-2], p.heads_kv, p.groups, p.L))
    return ungroup(p, xp.exp(s - exp_shift(p, lse)[..., None]))


def _finish(p: Problem, req: Request, terms: _Terms, out: Any, lse: Any) -> AttentionResult:
    out, lse = _fix_empty_rows(p, terms, out, lse)
    weights = _weights_from_lse(p, req, lse) if req.return_weights else None
    return AttentionResult(out=out, weights=weights, lse=lse if req.return_lse else None)


def _cast(p: Problem, req: Request) -> tuple[Any, Any, Any]:
    """Query, key and value in the compute dtype; the query times ``scale`` if it is an array."""
    xp, dtype, x = p.xp, p.compute_dtype, req.inputs
    q = xp.astype(x.query, dtype, copy=False)
    if p.scale_is_array:
        q = q * kernel_scale(p)
    return q, xp.astype(x.key, dtype, copy=False), xp.astype(x.value, dtype, copy=False)


def _scale_option(p: Problem) -> float:
    """The kernel's ``scale`` (1 when :func:`_cast` multiplied an array scale into ``q``)."""
    return 1.0 if p.scale_is_array else float(p.scale)


@dataclass(frozen=True)
class _Layout:
    """The call as ``(B, H, N, X)`` arrays with one flat batch axis (for 4-D kernels)."""

    q: Any
    k: Any
    v: Any
    B: int
    Hq: int
    Hkv: int


def _four_d(p: Problem, q: Any, k: Any, v: Any) -> _Layout:
    """Reshape q, k, v to ``(B, H, N, X)``; refuse batch axes that broadcast."""
    xp = p.xp
    batch = p.batch_shape
    lead = batch[:-1]
    B = math.prod(lead)
    ndim = len(batch) + 2
    heads = []
    out = []
    for name, x in (("query", q), ("key", k), ("value", v)):
        x = leading_axes(xp, x, ndim)
        if tuple(x.shape[: len(lead)]) != lead:
            raise _refuse(
                f"4-D kernels need query, key and value with equal batch axes; {name} has "
                f"{tuple(x.shape[: len(lead)])}, the call {lead}"
            )
        h = int(x.shape[-3]) if batch else 1
        heads.append(h)
        out.append(xp.reshape(x, (B, h, *x.shape[-2:])))
    hq, hk, hv = heads
    if hq != (batch[-1] if batch else 1) or hk != hv or hq % hk:
        raise _refuse(
            f"heads (query {hq}, key {hk}, value {hv}) must be equal, or the query's a "
            "multiple of the key/value's"
        )
    return _Layout(q=out[0], k=out[1], v=out[2], B=B, Hq=hq, Hkv=hk)


def _four_d_term(p: Problem, x: Any, name: str) -> Any:
    """A mask/bias as ``(B|1, H|1, L|1, S|1)``; refuse one that broadcasts partially."""
    if x is None:
        return None
    xp = p.xp
    batch = p.batch_shape
    lead = batch[:-1]
    x = leading_axes(xp, x, len(batch) + 2)
    x_lead = tuple(x.shape[: len(lead)])
    if x_lead != lead and any(n != 1 for n in x_lead):
        raise _refuse(f"the {name}'s batch axes {x_lead} broadcast partially against {lead}")
    h = int(x.shape[-3]) if batch else 1
    return xp.reshape(x, (math.prod(lead) if x_lead == lead else 1, h, *x.shape[-2:]))


def _from_four_d(p: Problem, x: Any, tail: tuple[int, ...]) -> Any:
    return p.xp.reshape(x, (*p.batch_shape, *tail))


# --- torch --------------------------------------------------------------------------------


@functools.cache
def _torch_sdpa_has_gqa() -> bool:
    import torch

    try:
        params = inspect.signature(torch.nn.functional.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # builtins without a signature: try the docstring
        doc = torch.nn.functional.scaled_dot_product_attention.__doc__ or ""
        return "enable_gqa" in doc.split("->")[0]
    return "enable_gqa" in params


def _plan_torch_public(p: Problem, req: Request) -> Delegation:
    """``torch.nn.functional.scaled_dot_product_attention``: output only, any device."""
    _common_checks(p)
    if req.return_lse or req.return_weights:
        raise _refuse("it returns neither the log-sum-exp nor the weights")
    if p.grouped and not _torch_sdpa_has_gqa():
        raise _refuse("grouped-query attention needs torch >= 2.5 (enable_gqa)")
    import torch

    has_terms = req.mask is not None or req.bias is not None

    def run() -> AttentionResult:
        merge = req.bias is not None  # one attn_mask argument: fold masks into the bias
        terms = _score_terms(p, req.mask, req.bias, merge=merge)
        attn_mask = terms.mask if terms.bias is None else terms.bias
        q, k, v = _cast(p, req)
        extra = {"enable_gqa": True} if p.grouped else {}
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=terms.is_causal, scale=_scale_option(p), **extra
        )
        return _finish(p, req, terms, out, None)

    return Delegation(
        "torch.nn.functional.scaled_dot_product_attention",
        memory_efficient=True,
        builds_mask=_builds_mask(p, has_terms),
        run=run,
    )


def _torch_cpu_flash() -> Any:
    import torch

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or "attn_mask" not in str(op.default._schema):
        raise _refuse("this torch has no CPU flash-attention kernel that takes a mask")
    return op


def _plan_torch_cpu_flash(p: Problem, req: Request) -> Delegation:
    """torch's CPU flash-attention kernel, which also returns the log-sum-exp."""
    _common_checks(p)
    if str(p.device) != "cpu":
        raise _refuse(f"the kernel returning the log-sum-exp is CPU-only (device {p.device})")
    if p.Ev != p.E:
        raise _refuse(f"it needs Ev == E (got E={p.E}, Ev={p.Ev})")
    op = _torch_cpu_flash()
    _four_d(p, req.inputs.query, req.inputs.key, req.inputs.value)  # shape checks first
    for name, term in (("mask", req.mask), ("bias", req.bias)):
        _four_d_term(p, term, name)
    has_terms = req.mask is not None or req.bias is not None

    def run() -> AttentionResult:
        terms = _score_terms(p, req.mask, req.bias, merge=True)
        bias4 = _four_d_term(p, terms.bias, "mask/bias")
        q, k, v = _cast(p, req)
        lay = _four_d(p, q, k, v)
        out, lse = op(
            lay.q, lay.k, lay.v, 0.0, terms.is_causal, attn_mask=bias4, scale=_scale_option(p)
        )
        out = _from_four_d(p, out, (p.L, p.Ev))
        lse = _from_four_d(p, lse, (p.L,))
        return _finish(p, req, terms, out, lse)

    return Delegation(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        memory_efficient=True,
        builds_mask=_builds_mask(p, has_terms),
        run=run,
        twice_differentiable=False,  # its backward op has no derivative
    )


# --- JAX ----------------------------------------------------------------------------------


@functools.cache
def _jax_has_residual() -> bool:
    import jax

    return "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters


def _plan_jax(p: Problem, req: Request) -> Delegation:
    """``jax.nn.dot_product_attention`` (layout ``BTNH``; XLA forms the score matrix)."""
    _common_checks(p)
    if p.compute_dtype == p.xp.float64:
        raise _refuse("jax.nn.dot_product_attention computes the softmax in float32")
    if p.Ev != p.E:
        raise _refuse(f"it needs Ev == E (got E={p.E}, Ev={p.Ev})")
    wants_lse = req.return_lse or req.return_weights
    if wants_lse and not _jax_has_residual():
        raise _refuse("this JAX cannot return the log-sum-exp (return_residual)")
    import jax

    xp = p.xp
    _four_d(p, req.inputs.query, req.inputs.key, req.inputs.value)  # shape checks first
    for name, term in (("mask", req.mask), ("bias", req.bias)):
        _four_d_term(p, term, name)
    has_terms = req.mask is not None or req.bias is not None

    def run() -> AttentionResult:
        merge = req.bias is not None
        terms = _score_terms(p, req.mask, req.bias, merge=merge)
        mask4 = _four_d_term(p, terms.mask, "mask")
        bias4 = _four_d_term(p, terms.bias, "bias")
        lay = _four_d(p, *_cast(p, req))
        q, k, v = (xp.permute_dims(x, (0, 2, 1, 3)) for x in (lay.q, lay.k, lay.v))
        options: dict[str, Any] = {"scale": _scale_option(p), "is_causal": terms.is_causal}
        if wants_lse:
            out, lse = jax.nn.dot_product_attention(
                q, k, v, bias4, mask4, return_residual=True, **options
            )
        else:
            out, lse = jax.nn.dot_product_attention(q, k, v, bias4, mask4, **options), None
        out = _from_four_d(p, xp.permute_dims(out, (0, 2, 1, 3)), (p.L, p.Ev))
        if lse is not None:
            lse = _from_four_d(p, xp.permute_dims(lse, (0, 2, 1)), (p.L,))
        return _finish(p, req, terms, out, lse)

    return Delegation(
        "jax.nn.dot_product_attention",
        memory_efficient=False,
        builds_mask=_builds_mask(p, has_terms),
        run=run,
    )


#: The delegation table: for each library, its kernels in order of preference.
NATIVE_KERNELS: tuple[NativeKernel, ...] = (
    NativeKernel("torch.nn.functional.scaled_dot_product_attention", "torch", _plan_torch_public),
    NativeKernel(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", "torch", _plan_torch_cpu_flash
    ),
    NativeKernel("jax.nn.dot_product_attention", "jax", _plan_jax),
)


def plan_native(p: Problem, req: Request) -> Delegation:
    """The first kernel of :data:`NATIVE_KERNELS` that computes the call exactly.

    Raises
    ------
    CannotDelegateError
        If none does; the message gives each candidate's reason.
    """
    library = namespace_name(p.xp)
    candidates = [row for row in NATIVE_KERNELS if row.library == library]
    if not candidates:
        known = sorted({row.library for row in NATIVE_KERNELS})
        raise CannotDelegateError(
            f"implementation='native' has no kernel for {library} arrays; native kernels "
            f"exist for {', '.join(known)}"
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


def native_attention(
    p: Problem, x: Inputs, *, return_weights: bool, return_lse: bool
) -> AttentionResult:
    """Run the call on the first native kernel that computes it exactly.

    Raises
    ------
    CannotDelegateError
        If no native kernel does (see :func:`plan_native`).
    """
    req = Request(x, return_weights, return_lse)
    return plan_native(p, req).run()
