"""torch's kernels: the public ``scaled_dot_product_attention`` (any device), the CPU
flash-attention kernel and the CUDA kernels (cuDNN, flash, memory-efficient) that return the
log-sum-exp."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

from ..._problem.problem import Problem
from ..result import AttentionResult
from .delegation import (
    Delegation,
    Layout,
    Request,
    builds_mask,
    cast,
    common_checks,
    finish,
    four_d,
    four_d_term,
    from_four_d,
    kernel_causal,
    kernel_dtype,
    refuse,
    scale_option,
    score_terms,
)

__all__ = ["CUDA_LSE_KERNELS", "plan_torch_cpu_flash", "plan_torch_cuda_lse", "plan_torch_public"]


@functools.cache
def _torch_sdpa_has_gqa() -> bool:
    import torch

    try:
        params = inspect.signature(torch.nn.functional.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # builtins without a signature: try the docstring
        doc = torch.nn.functional.scaled_dot_product_attention.__doc__ or ""
        return "enable_gqa" in doc.split("->")[0]
    return "enable_gqa" in params


#: torch's CPU kernels take a row's maximum score in vectors of up to this many bytes and the
#: rest one score at a time, which skips a NaN: a row shorter than a vector whose every
#: score is NaN comes out zeros (float32 rows of up to 15 keys, float64 of up to 7, with
#: 64-byte vectors); longer rows come out NaN.
_VECTOR_BYTES = 64


def _may_drop_nan(p: Problem) -> bool:
    """Whether torch's kernel may give zeros for a row whose scores are all NaN, so that
    such rows are fixed after it (:func:`~.delegation.nan_rows`): rows shorter than two
    vectors (a margin for wider ones), and every call on CUDA, whose kernels' handling is
    not stated here."""
    itemsize = p.xp.finfo(kernel_dtype(p)).bits // 8
    return p.on_gpu or p.S * itemsize < 2 * _VECTOR_BYTES


def plan_torch_public(p: Problem, req: Request) -> Delegation:
    """``torch.nn.functional.scaled_dot_product_attention``: output only, any device."""
    common_checks(p, req)
    if req.return_lse or req.return_weights:
        raise refuse("it returns neither the log-sum-exp nor the weights")
    if p.grouped and not _torch_sdpa_has_gqa():
        raise refuse("grouped-query attention needs torch >= 2.5 (enable_gqa)")
    import torch

    has_terms = req.mask is not None or req.bias is not None

    def run() -> AttentionResult:
        merge = req.bias is not None  # one attn_mask argument: fold masks into the bias
        terms = score_terms(p, req.mask, req.bias, merge=merge)
        attn_mask = terms.mask if terms.bias is None else terms.bias
        if attn_mask is not None and attn_mask.ndim < 2:  # the kernel indexes its -2 axis
            attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.ndim) + tuple(attn_mask.shape))
        q, k, v = cast(p, req)
        extra = {"enable_gqa": True} if p.grouped else {}
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=terms.is_causal, scale=scale_option(p), **extra
        )
        return finish(p, req, terms, out, None, (q, k) if _may_drop_nan(p) else None)

    return Delegation(
        "torch.nn.functional.scaled_dot_product_attention",
        memory_efficient=True,
        builds_mask=builds_mask(p, has_terms),
        run=run,
        direct=None if has_terms else _direct_call(p, req),
    )


def _direct_call(p: Problem, req: Request) -> Any:
    """torch's function with this call's options bound, where its output is the public
    function's as it is (:attr:`Delegation.direct`), else ``None``: queries and keys (an
    empty call runs no kernel), no mask or bias beyond the kernel's own ``is_causal``, no
    lengths or segments, the caller's dtype (the kernel's on the CPU is float32 for
    half-precision inputs), a number as ``scale``, and a query with the output's batch
    shape (nothing to broadcast). The function is looked up at each call, as the planned
    call looks it up."""
    if p.L == 0 or p.S == 0 or p.has_sequences or builds_mask(p, False) or p.scale_is_array:
        return None
    if kernel_dtype(p) != p.dtype or tuple(req.inputs.query.shape[:-1]) != p.out_shape[:-1]:
        return None
    import torch

    options: dict[str, Any] = {"is_causal": kernel_causal(p, False), "scale": scale_option(p)}
    groups = p.groups if p.grouped else 1
    if p.grouped:
        options["enable_gqa"] = True

    def plain(query: Any, key: Any, value: Any) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, **options)

    if not _may_drop_nan(p):
        return plain

    def direct(query: Any, key: Any, value: Any) -> Any:
        out = plain(query, key, value)
        # delegation.nan_rows in few torch operations (a small call pays for each): a NaN
        # in the query's row sum or the first key's (inf - inf needs sums past the largest
        # float, whose scores overflow too)
        first = key[..., :1, :].sum(-1, keepdim=True)
        if groups > 1:
            first = first.repeat_interleave(groups, dim=-3)
        bad = torch.isnan(query.sum(-1, keepdim=True).add_(first))
        if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            return torch.where(bad, math.nan, out)  # the kernel's backward keeps its output
        return out.masked_fill_(bad, math.nan)

    return direct


def _torch_cpu_flash() -> Any:
    import torch

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or "attn_mask" not in str(op.default._schema):
        raise refuse("this torch has no CPU flash-attention kernel that takes a mask")
    return op


def plan_torch_cpu_flash(p: Problem, req: Request) -> Delegation:
    """torch's CPU flash-attention kernel, which also returns the log-sum-exp; it takes
    query and key lengths as a key mask beside its own ``is_causal``."""
    common_checks(p, req, lengths=True)
    if p.on_gpu or str(p.device) != "cpu":
        raise refuse(f"it runs on the CPU only (device {p.device})")
    if p.Ev != p.E:
        raise refuse(f"it needs Ev == E (got E={p.E}, Ev={p.Ev})")
    op = _torch_cpu_flash()
    four_d(p, req.inputs.query, req.inputs.key, req.inputs.value)  # shape checks first
    for name, term in (("mask", req.mask), ("bias", req.bias)):
        four_d_term(p, term, name)
    has_terms = req.mask is not None or req.bias is not None

    def run() -> AttentionResult:
        terms = score_terms(p, req.mask, req.bias, merge=True)
        bias4 = four_d_term(p, terms.bias, "mask/bias")
        q, k, v = cast(p, req)
        lay = four_d(p, q, k, v)
        out, lse = op(
            lay.q, lay.k, lay.v, 0.0, terms.is_causal, attn_mask=bias4, scale=scale_option(p)
        )
        out = from_four_d(p, out, (p.L, p.Ev))
        lse = from_four_d(p, lse, (p.L,))
        return finish(p, req, terms, out, lse, (q, k) if _may_drop_nan(p) else None)

    return Delegation(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        memory_efficient=True,
        builds_mask=builds_mask(p, has_terms),
        run=run,
        twice_differentiable=False,  # its backward op has no derivative
        lse_differentiable=False,
    )


# torch's CUDA kernels that return the log-sum-exp, fastest first. Each takes (B, H, N, X)
# tensors with equal head counts (grouped key/value heads are repeated for them), computes
# in the caller's dtype and returns the log-sum-exp in float32.
_CUDNN = "torch.ops.aten._scaled_dot_product_cudnn_attention"
_FLASH = "torch.ops.aten._scaled_dot_product_flash_attention"
_EFFICIENT = "torch.ops.aten._scaled_dot_product_efficient_attention"

#: The CUDA kernels returning the log-sum-exp, in order of preference.
CUDA_LSE_KERNELS = (_CUDNN, _FLASH, _EFFICIENT)


def _cuda_lse_checks(p: Problem, req: Request, kernel: str) -> None:
    """The conditions every CUDA kernel returning the log-sum-exp shares."""
    common_checks(p, req)
    if not p.on_gpu:
        raise refuse(f"it runs on CUDA devices only (device {p.device})")
    if p.Ev != p.E:
        raise refuse(f"it needs Ev == E (got E={p.E}, Ev={p.Ev})")
    if p.dtype == p.xp.float64:
        raise refuse("no CUDA kernel returning the log-sum-exp computes float64")
    half = p.dtype in (p.xp.float16, p.xp.bfloat16)
    has_terms = req.mask is not None or req.bias is not None
    if kernel in (_CUDNN, _FLASH):
        if not half:
            raise refuse(f"it computes in float16/bfloat16 only (got {p.dtype})")
        if has_terms:
            raise refuse("it takes no mask or bias")
        if p.band.restricts and not kernel_causal(p, has_terms):
            raise refuse("its causal rule is top-left only, without windows")
    limit = 128 if kernel == _CUDNN else 256
    if _padded(p.E) > limit:
        raise refuse(f"it takes head dims up to {limit} (got {p.E})")
    four_d(p, req.inputs.query, req.inputs.key, req.inputs.value)  # shape checks first
    for name, term in (("mask", req.mask), ("bias", req.bias)):
        four_d_term(p, term, name)


def _padded(n: int) -> int:
    """``n`` rounded up to a multiple of 8, the head dims these kernels take."""
    return -(-n // 8) * 8


def _pad_heads(x: Any) -> Any:
    """``x`` with zero features appended up to :func:`_padded` (they add nothing to
    ``q·k``; the output's extra columns are dropped)."""
    pad = _padded(x.shape[-1]) - x.shape[-1]
    if not pad:
        return x
    import torch

    return torch.nn.functional.pad(x, (0, pad))


def _repeat_kv(lay: Layout) -> tuple[Any, Any]:
    """Key and value with each key/value head repeated for its group of query heads."""
    if lay.Hq == lay.Hkv:
        return lay.k, lay.v
    groups = lay.Hq // lay.Hkv
    return lay.k.repeat_interleave(groups, dim=1), lay.v.repeat_interleave(groups, dim=1)


def _aligned_bias(bias4: Any, shape: tuple[int, int, int, int]) -> Any:
    """The additive mask as the memory-efficient kernel reads it: rows padded to 16 bytes
    (a view of the first ``S`` columns) and expanded, without copying, to ``shape``."""
    if bias4 is None:
        return None
    import torch

    align = 16 // bias4.element_size()
    pad = -bias4.shape[-1] % align
    if pad or bias4.stride(-1) != 1:
        bias4 = torch.nn.functional.pad(bias4.contiguous(), (0, pad))[..., : shape[-1]]
    return bias4.expand(shape)


def plan_torch_cuda_lse(kernel: str) -> Callable[[Problem, Request], Delegation]:
    def plan(p: Problem, req: Request) -> Delegation:
        _cuda_lse_checks(p, req, kernel)
        import torch

        aten = torch.ops.aten
        has_terms = req.mask is not None or req.bias is not None

        def run() -> AttentionResult:
            terms = score_terms(p, req.mask, req.bias, merge=True)
            query, key, value = cast(p, req)
            lay = four_d(p, query, key, value)
            q, (k, v) = _pad_heads(lay.q), map(_pad_heads, _repeat_kv(lay))
            scale = scale_option(p)
            if kernel == _CUDNN:
                out, lse = aten._scaled_dot_product_cudnn_attention(
                    q, k, v, None, True, 0.0, terms.is_causal, False, scale=scale
                )[:2]
            elif kernel == _FLASH:
                out, lse = aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, terms.is_causal, False, scale=scale
                )[:2]
            else:
                bias4 = four_d_term(p, terms.bias, "mask/bias")
                bias4 = _aligned_bias(bias4, (lay.B, lay.Hq, p.L, p.S))
                out, lse = aten._scaled_dot_product_efficient_attention(
                    q, k, v, bias4, True, 0.0, terms.is_causal, scale=scale
                )[:2]
            out = from_four_d(p, out[..., : p.Ev], (p.L, p.Ev))
            # cuDNN returns (B, H, L, 1); the memory-efficient kernel pads L to a multiple of 32
            lse = from_four_d(p, lse.reshape(lay.B, lay.Hq, -1)[..., : p.L], (p.L,))
            return finish(p, req, terms, out, lse, (query, key))  # on CUDA

        return Delegation(
            kernel,
            memory_efficient=True,
            builds_mask=builds_mask(p, has_terms),
            run=run,
            twice_differentiable=False,  # their backward ops have no derivative
            lse_differentiable=False,
        )

    return plan
