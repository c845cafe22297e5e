"""The ring inside ``jax.shard_map``: ``lax.ppermute`` moves the slices.

The participant's index is a traced value (``lax.axis_index``) while the pairs it computes
are planned in Python, so each step is a ``lax.switch`` over the participants whose
branch ``r`` computes participant ``r``'s pairs with their offsets fixed; only the branch of
the participant runs. The slice for the next step is sent (``ppermute``) before the step's
work, so that XLA may overlap them.

The gradient is a ``jax.custom_vjp`` whose backward is the ring backward: the key/value
slices go round again with their gradients. Plain autodiff through the forward's
``ppermute`` calls would keep every received slice for the backward pass (all ``P`` of
them, the whole sequence); the custom rule keeps the participant's own slices, its output
and log-sum-exp, and holds two key/value slices and their gradients at a time.

``sinks`` enter the rule typed as varying over the axis: the rule returns each
participant's part of their gradient (from its rows), and where ``sinks`` came in
replicated, the transpose of that cast sums the parts over the participants. The lengths
are operands of the rule (integers, without gradient), not values it closes over.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ._ring import (
    Ring,
    backward_step,
    concat_rows,
    empty_state,
    finish_forward,
    forward_step,
    sink_gradient,
    zero_dq,
    zero_grads,
)

__all__ = ["axis_size", "jax_ring"]


def axis_size(axis_name: Any) -> int:
    """The number of participants along ``axis_name`` (inside ``shard_map``)."""
    try:
        return int(lax.axis_size(axis_name))
    except (NameError, KeyError, ValueError) as e:
        raise ValueError(
            f"ring_attention with axis_name={axis_name!r} must be called inside shard_map "
            f"over a mesh with that axis ({e})"
        ) from None


def _varying(tree: Any, axis_name: Any) -> Any:
    """``tree`` typed as varying over ``axis_name`` (arrays made inside the body are not),
    so that every branch of a switch returns the same types."""
    cast = getattr(lax, "pcast", None)
    if cast is not None:
        try:
            return jax.tree.map(lambda x: cast(x, axis_name, to="varying"), tree)
        except (TypeError, ValueError):
            return tree
    pvary = getattr(lax, "pvary", None)
    return tree if pvary is None else jax.tree.map(lambda x: pvary(x, axis_name), tree)


def jax_ring(
    ring: Ring, axis_name: Any, q: Any, k: Any, v: Any, sinks: Any, lengths: tuple[Any, Any]
) -> tuple[Any, Any]:
    """``(out, lse)`` of this participant's rows; ``out`` differentiable in ``q``, ``k``,
    ``v`` and ``sinks`` through the ring backward, ``lse`` a statistic without gradient."""
    P = ring.world_size
    perm = [(i, (i + 1) % P) for i in range(P)]

    def shift(tree: Any) -> Any:
        return lax.ppermute(tree, axis_name, perm)  # type: ignore[no-untyped-call]

    def forward(q: Any, k: Any, v: Any, sinks: Any, lengths: Any) -> tuple[Any, Any]:
        rank = lax.axis_index(axis_name)
        compute = jnp.float32 if q.dtype.itemsize < 4 else q.dtype
        state = _varying(empty_state(ring, q, v, compute), axis_name)
        held: Any = (k, v)
        for step in range(P):
            incoming = shift(held) if step < P - 1 else None
            branches = [partial(forward_step, ring, r, step) for r in range(P)]
            state = lax.switch(rank, branches, q, held[0], held[1], state, lengths)
            held = incoming
        return finish_forward(state, q.dtype, sinks)

    @jax.custom_vjp
    def call(q: Any, k: Any, v: Any, sinks: Any, lengths: Any) -> tuple[Any, Any]:
        return forward(q, k, v, sinks, lengths)

    def call_fwd(q: Any, k: Any, v: Any, sinks: Any, lengths: Any) -> tuple[Any, Any]:
        out, lse = forward(q, k, v, sinks, lengths)
        return (out, lse), (q, k, v, sinks, lengths, out, lse)

    def call_bwd(saved: Any, cotangents: Any) -> tuple[Any, ...]:
        q, k, v, sinks, lengths, out, lse = saved
        grad_out = cotangents[0]
        rank = lax.axis_index(axis_name)
        dq = _varying(zero_dq(ring, q), axis_name)
        held: Any = (k, v)
        arriving = None
        for step in range(P):
            incoming = shift(held) if step < P - 1 else None
            fresh = _varying(zero_grads(ring, held[0], held[1]), axis_name)
            branches = [
                partial(backward_step, ring, r, step, (q, grad_out, out, lse)) for r in range(P)
            ]
            dq, dkv = lax.switch(rank, branches, held[0], held[1], dq, fresh, lengths)
            if arriving is not None:  # the slice's gradients from the participants before
                dkv = [(dk + a, dv + b) for (dk, dv), (a, b) in zip(dkv, arriving, strict=True)]
            arriving = shift(dkv)
            held = incoming
        assert arriving is not None
        dk = concat_rows([a for a, _ in arriving])
        dv = concat_rows([b for _, b in arriving])
        dsinks = None if sinks is None else sink_gradient(sinks, grad_out, out, lse)
        no_grad = jax.tree.map(lambda _: None, lengths)
        return concat_rows(dq), dk, dv, dsinks, no_grad

    call.defvjp(call_fwd, call_bwd)
    if sinks is not None:
        sinks = _varying(sinks, axis_name)
    out, lse = call(q, k, v, sinks, lengths)
    return out, lax.stop_gradient(lse)
