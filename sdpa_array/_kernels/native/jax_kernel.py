"""JAX's kernel: ``jax.nn.dot_product_attention``, through cuDNN on a GPU where it applies.

On a GPU, float16 and bfloat16 calls without a dense mask or bias, without the
log-sum-exp, with ``E == Ev`` a multiple of 8 up to :data:`CUDNN_MAX_HEAD_DIM`, ask for
``implementation="cudnn"`` (JAX's fused flash-attention kernel, which forms no score
matrix); every other call takes JAX's XLA path (``implementation=None``), which forms the
scores. The choice is made when the call is planned and named in the kernel
(:data:`CUDNN_KERNEL`), so ``explain`` shows it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..._problem.problem import Problem
from ..result import AttentionResult
from .delegation import (
    Delegation,
    Request,
    builds_mask,
    cast,
    common_checks,
    finish,
    four_d,
    four_d_term,
    from_four_d,
    refuse,
    scale_option,
    score_terms,
)

__all__ = ["CUDNN_KERNEL", "CUDNN_MAX_HEAD_DIM", "cudnn_reason", "plan_jax"]

#: The delegation's kernel name when it runs through cuDNN.
CUDNN_KERNEL = "jax.nn.dot_product_attention[cudnn]"

#: Largest head dim the cuDNN route is asked for (cuDNN's flash attention takes up to 128 on
#: every supported GPU).
CUDNN_MAX_HEAD_DIM = 128


def cudnn_reason(p: Problem, has_terms: bool, wants_lse: bool) -> str | None:
    """Why JAX's cuDNN kernel is not asked for (``None``: it is): off a GPU, a dtype other
    than float16/bfloat16, a dense mask or bias (the caller's, or one built for the call:
    ``has_terms``), the log-sum-exp or weights asked for, or a head dim it does not take."""
    if not p.on_gpu:
        return "not on a GPU"
    if p.dtype not in (p.xp.float16, getattr(p.xp, "bfloat16", p.xp.float16)):
        return f"cuDNN's fused kernel takes float16 or bfloat16, got {p.dtype}"
    if has_terms:
        return "a dense mask or bias"
    if wants_lse:
        return "the log-sum-exp or weights were asked for"
    if p.E % 8 or p.E > CUDNN_MAX_HEAD_DIM:
        return f"head dim {p.E}: cuDNN takes multiples of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return None


@functools.cache
def _jax_has_residual() -> bool:
    import jax

    return "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters


def plan_jax(p: Problem, req: Request) -> Delegation:
    """``jax.nn.dot_product_attention`` (layout ``BTNH``; XLA forms the score matrix)."""
    common_checks(p, req)
    if p.compute_dtype == p.xp.float64:
        raise refuse("jax.nn.dot_product_attention computes the softmax in float32")
    if p.Ev != p.E:
        raise refuse(f"it needs Ev == E (got E={p.E}, Ev={p.Ev})")
    wants_lse = req.return_lse or req.return_weights
    if wants_lse and not _jax_has_residual():
        raise refuse("this JAX cannot return the log-sum-exp (return_residual)")
    import jax

    xp = p.xp
    four_d(p, req.inputs.query, req.inputs.key, req.inputs.value)  # shape checks first
    for name, term in (("mask", req.mask), ("bias", req.bias)):
        four_d_term(p, term, name)
    has_terms = req.mask is not None or req.bias is not None
    built = builds_mask(p, has_terms)
    cudnn = cudnn_reason(p, has_terms or built, wants_lse) is None

    def run() -> AttentionResult:
        merge = req.bias is not None
        terms = score_terms(p, req.mask, req.bias, merge=merge)
        mask4 = four_d_term(p, terms.mask, "mask")
        bias4 = four_d_term(p, terms.bias, "bias")
        lay = four_d(p, *cast(p, req))
        q, k, v = (xp.permute_dims(x, (0, 2, 1, 3)) for x in (lay.q, lay.k, lay.v))
        options: dict[str, Any] = {"scale": scale_option(p), "is_causal": terms.is_causal}
        if cudnn:
            options["implementation"] = "cudnn"
        if wants_lse:
            out, lse = jax.nn.dot_product_attention(
                q, k, v, bias4, mask4, return_residual=True, **options
            )
        else:
            out, lse = jax.nn.dot_product_attention(q, k, v, bias4, mask4, **options), None
        out = from_four_d(p, xp.permute_dims(out, (0, 2, 1, 3)), (p.L, p.Ev))
        if lse is not None:
            lse = from_four_d(p, xp.permute_dims(lse, (0, 2, 1)), (p.L,))
        return finish(p, req, terms, out, lse)

    return Delegation(
        CUDNN_KERNEL if cudnn else "jax.nn.dot_product_attention",
        memory_efficient=cudnn,
        builds_mask=built,
        run=run,
    )
