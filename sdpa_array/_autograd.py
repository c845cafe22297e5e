"""Autograd for the blocked implementation: a ``torch.autograd.Function`` and a ``jax.custom_vjp``.

The materialized and native implementations are compositions of the library's own
differentiable operations (or its fused kernel), so torch and JAX differentiate them by
themselves. They could differentiate the blocked loop too, but they would keep every tile's
probabilities for the backward pass, and the tiles add up to the whole score matrix. So when
the blocked implementation runs on torch tensors that require grad, or on JAX tracers,
:func:`differentiable` runs it as one opaque operation that keeps only its inputs, its output
(in the compute dtype) and its log-sum-exp, and whose backward pass is the blocked VJP of
:mod:`sdpa_array._vjp_blocked`: memory stays ``O(block)`` in training.

Both wrappers also differentiate the log-sum-exp output (``d lse_i / d z_ij = P_ij``). They
are first-order only: torch raises on a second backward pass through them (the saved
log-sum-exp carries no graph), and ``jax.custom_vjp`` functions are not
forward-differentiable.

This is the only module that knows torch's and JAX's autodiff APIs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ._blocked import blocked_attention
from ._compat import namespace_name
from ._problem import Problem
from ._result import AttentionResult
from ._vjp import attention_vjp
from ._vjp_blocked import blocked_vjp

__all__ = ["differentiable"]

Implementation = Callable[..., AttentionResult]


def differentiable(run: Implementation) -> Implementation:
    """``run`` itself, or, for the blocked implementation, a version for autograd.

    The returned callable has an implementation's signature. It sends the call through
    :func:`_torch_blocked` or :func:`_jax_blocked` when the arrays need gradients (torch
    tensors with ``requires_grad`` while grad mode is on, JAX tracers) and the weights are
    not asked for (they are the score matrix anyway, so the library's own autodiff of the
    materialized fallback is as good); otherwise it calls ``run`` unchanged.
    """
    if getattr(run, "func", run) is not blocked_attention:
        return run
    keywords = getattr(run, "keywords", {})
    blocks = (keywords.get("block_q"), keywords.get("block_k"))

    @functools.wraps(run)
    def run_differentiable(
        p: Problem,
        query: Any,
        key: Any,
        value: Any,
        mask: Any,
        bias: Any,
        *,
        return_weights: bool,
        return_lse: bool,
    ) -> AttentionResult:
        if not return_weights:
            library = namespace_name(p.xp)
            arrays = (query, key, value, bias)
            if library == "torch" and _torch_needs_grad(arrays):
                return _torch_blocked(p, query, key, value, mask, bias, return_lse, blocks)
            if library == "jax" and _jax_traced(arrays):
                return _jax_blocked(p, query, key, value, mask, bias, return_lse, blocks)
        return run(
            p, query, key, value, mask, bias, return_weights=return_weights, return_lse=return_lse
        )

    return run_differentiable


def _torch_needs_grad(arrays: tuple[Any, ...]) -> bool:
    import torch

    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in arrays)


def _jax_traced(arrays: tuple[Any, ...]) -> bool:
    import jax

    return any(isinstance(x, jax.core.Tracer) for x in arrays)


def _forward(
    p: Problem, query: Any, key: Any, value: Any, mask: Any, bias: Any, blocks: tuple[Any, Any]
) -> tuple[Any, Any]:
    r = blocked_attention(
        p,
        query,
        key,
        value,
        mask,
        bias,
        return_weights=False,
        return_lse=True,
        block_q=blocks[0],
        block_k=blocks[1],
    )
    return r.out, r.lse


def _backward(
    p: Problem,
    blocks: tuple[Any, Any],
    saved: tuple[Any, ...],
    grad_out: Any,
    grad_lse: Any,
) -> tuple[Any, ...]:
    query, key, value, mask, bias, out, lse = saved
    run = functools.partial(blocked_vjp, block_q=blocks[0], block_k=blocks[1])
    grads = attention_vjp(
        p, run, query, key, value, mask, bias, grad_out, out=out, lse=lse, grad_lse=grad_lse
    )
    return (*grads[:3], grads[3] if bias is not None else None)


@functools.cache
def _torch_function() -> Any:
    """The ``torch.autograd.Function`` (defined on first use: torch is optional)."""
    import torch

    class BlockedAttention(torch.autograd.Function):
        """Blocked attention whose backward pass is the blocked VJP."""

        @staticmethod
        def forward(
            ctx: Any,
            query: Any,
            key: Any,
            value: Any,
            bias: Any,
            mask: Any,
            p: Problem,
            blocks: tuple[Any, Any],
        ) -> tuple[Any, Any]:
            out, lse = _forward(p, query, key, value, mask, bias, blocks)
            ctx.save_for_backward(query, key, value, mask, bias, out, lse)
            ctx.p, ctx.blocks = p, blocks
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> tuple[Any, ...]:
            saved = ctx.saved_tensors
            if grad_out is None:
                grad_out = torch.zeros_like(saved[5])
            dq, dk, dv, dbias = _backward(ctx.p, ctx.blocks, saved, grad_out, grad_lse)
            return dq, dk, dv, dbias, None, None, None

    return BlockedAttention


def _torch_blocked(
    p: Problem,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    return_lse: bool,
    blocks: tuple[Any, Any],
) -> AttentionResult:
    out, lse = _torch_function().apply(query, key, value, bias, mask, p, blocks)
    return AttentionResult(out=out, lse=lse if return_lse else None)


def _jax_blocked(
    p: Problem,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    return_lse: bool,
    blocks: tuple[Any, Any],
) -> AttentionResult:
    import jax

    @jax.custom_vjp
    def attention(query: Any, key: Any, value: Any, mask: Any, bias: Any) -> tuple[Any, Any]:
        return _forward(p, query, key, value, mask, bias, blocks)

    def forward(
        query: Any, key: Any, value: Any, mask: Any, bias: Any
    ) -> tuple[tuple[Any, Any], tuple[Any, ...]]:
        out, lse = _forward(p, query, key, value, mask, bias, blocks)
        return (out, lse), (query, key, value, mask, bias, out, lse)

    def backward(saved: tuple[Any, ...], cotangents: tuple[Any, Any]) -> tuple[Any, ...]:
        grad_out, grad_lse = cotangents
        dq, dk, dv, dbias = _backward(p, blocks, saved, grad_out, grad_lse)
        return dq, dk, dv, None, dbias

    attention.defvjp(forward, backward)
    out, lse = attention(query, key, value, mask, bias)
    return AttentionResult(out=out, lse=lse if return_lse else None)
