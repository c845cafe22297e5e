"""JAX's kernel: ``jax.nn.dot_product_attention``."""

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

__all__ = ["plan_jax"]


@functools.cache
def _jax_has_residual() -> bool:
    import jax

    return "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters


def plan_jax(p: Problem, req: Request) -> Delegation:
    """``jax.nn.dot_product_attention`` (layout ``BTNH``; XLA forms the score matrix)."""
    common_checks(p)
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

    def run() -> AttentionResult:
        merge = req.bias is not None
        terms = score_terms(p, req.mask, req.bias, merge=merge)
        mask4 = four_d_term(p, terms.mask, "mask")
        bias4 = four_d_term(p, terms.bias, "bias")
        lay = four_d(p, *cast(p, req))
        q, k, v = (xp.permute_dims(x, (0, 2, 1, 3)) for x in (lay.q, lay.k, lay.v))
        options: dict[str, Any] = {"scale": scale_option(p), "is_causal": terms.is_causal}
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
        "jax.nn.dot_product_attention",
        memory_efficient=False,
        builds_mask=builds_mask(p, has_terms),
        run=run,
    )
