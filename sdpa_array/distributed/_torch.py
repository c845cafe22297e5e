"""The ring over a ``torch.distributed`` process group (gloo, NCCL): point-to-point sends.

Forward: at step ``t`` each rank starts sending the key/value slice it holds to rank
``r + 1`` and receiving the next one from rank ``r - 1`` (one ``batch_isend_irecv``), then
computes the step's pairs on the slice it holds, then waits: two slices at a time.
Backward (:class:`RingFunction`): the key/value slices go round again the same way; each
rank computes its pairs' gradients of the slice it holds into fresh ``(dk, dv)``, adds the
gradients that arrived for that slice from rank ``r - 1`` and sends the sum on to
``r + 1``; after ``P`` steps every slice's gradients are back with their owner. The
gradient of ``sinks`` is the rank's own part, from its rows (no communication): ``sinks``
is a replicated parameter, whose gradients the caller sums over the ranks as for any
other (``DistributedDataParallel`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

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

__all__ = ["RingStats", "TorchRing", "check_participants", "ring_function"]


@dataclass
class RingStats:
    """What one participant's ring call did (filled by :func:`ring_attention` when given).

    Attributes
    ----------
    pairs : list of int
        Block pairs computed at each forward step.
    entries : int
        Admissible (query, key) entries of those pairs.
    bytes_sent : int
        Bytes this participant sent in the forward pass.
    backward_bytes_sent : int
        Bytes it sent in the backward pass (key/value slices and their gradients).
    """

    pairs: list[int] = field(default_factory=list)
    entries: int = 0
    bytes_sent: int = 0
    backward_bytes_sent: int = 0


class TorchRing:
    """The process group's ring: this rank, its neighbours and the transfers."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next = self._global((self.rank + 1) % self.world_size)
        self.prev = self._global((self.rank - 1) % self.world_size)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def start(self, tensors: list[torch.Tensor]) -> tuple[list[Any], list[torch.Tensor], int]:
        """Send ``tensors`` to the next rank and receive their likes from the previous one;
        returns the requests, the receiving tensors and the bytes sent."""
        sends = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        requests = dist.batch_isend_irecv(ops)
        return requests, received, sum(t.numel() * t.element_size() for t in sends)

    @staticmethod
    def wait(requests: list[Any]) -> None:
        for request in requests:
            request.wait()


def check_participants(ring: TorchRing, summary: tuple[Any, ...], error: str | None) -> None:
    """Exchange every participant's ``summary`` (shapes, dtypes, options) and local error,
    and raise the same ``ValueError`` on every participant unless all agree."""
    gathered: list[Any] = [None] * ring.world_size
    dist.all_gather_object(gathered, (summary, error), group=ring.group)
    errors = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
    if errors:
        said = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise ValueError(f"ring_attention: a participant's arguments are invalid ({said})")
    first = gathered[0][0]
    differ = [r for r, (s, _) in enumerate(gathered) if s != first]
    if differ:
        said = "; ".join(f"rank {r}: {gathered[r][0]}" for r in (0, *differ))
        raise ValueError(
            "ring_attention: every participant must pass slices of the same shapes and "
            f"dtype and the same options; they differ ({said})"
        )


def _forward(
    ring: Ring, comm: TorchRing, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    extra: tuple[Any, Any], stats: RingStats | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    sinks, lengths = extra
    compute = torch.float32 if torch.finfo(q.dtype).bits < 32 else q.dtype
    state = empty_state(ring, q, v, compute)
    held = [k, v]
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        if not last:
            requests, incoming, sent = comm.start(held)
            if stats is not None:
                stats.bytes_sent += sent
        state = forward_step(ring, comm.rank, step, q, held[0], held[1], state, lengths)
        if stats is not None:
            pairs = ring.pairs(comm.rank, step)
            stats.pairs.append(len(pairs))
            stats.entries += sum(p.entries for p in pairs)
        if not last:
            comm.wait(requests)
            held = incoming
    return finish_forward(state, q.dtype, sinks)


def _backward(
    ring: Ring, comm: TorchRing, saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor,
    lengths: tuple[Any, Any], stats: RingStats | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    q, k, v, out, lse = saved
    dq = zero_dq(ring, q)
    held = [k, v]
    arriving: tuple[list[Any], list[torch.Tensor]] | None = None
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        if not last:
            requests, incoming, sent = comm.start(held)
            if stats is not None:
                stats.backward_bytes_sent += sent
        dq, dkv = backward_step(
            ring, comm.rank, step, (q, grad_out, out, lse), held[0], held[1], dq,
            zero_grads(ring, held[0], held[1]), lengths,
        )  # fmt: skip
        if arriving is not None:  # the slice's gradients from the ranks before
            comm.wait(arriving[0])
            got = arriving[1]
            dkv = [(dk + got[2 * j], dv + got[2 * j + 1]) for j, (dk, dv) in enumerate(dkv)]
        flat = [g for pair in dkv for g in pair]
        grad_requests, grad_incoming, sent = comm.start(flat)
        if stats is not None:
            stats.backward_bytes_sent += sent
        arriving = (grad_requests, grad_incoming)
        if not last:
            comm.wait(requests)
            held = incoming
    assert arriving is not None
    comm.wait(arriving[0])
    got = arriving[1]
    dk = concat_rows(got[0::2])
    dv = concat_rows(got[1::2])
    return concat_rows(dq), dk, dv


class RingFunction(torch.autograd.Function):
    """Ring attention under torch autograd: the backward is the ring backward."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Any, setup: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ring, comm, lengths, stats = setup
        detached = None if sinks is None else sinks.detach()
        out, lse = _forward(
            ring, comm, q.detach(), k.detach(), v.detach(), (detached, lengths), stats
        )
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.setup = setup
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: Any) -> tuple[Any, ...]:
        ring, comm, lengths, stats = ctx.setup
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _backward(ring, comm, (q, k, v, out, lse), grad_out, lengths, stats)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_gradient(sinks, grad_out, out, lse)
        return dq, dk, dv, dsinks, None


def ring_function(
    ring: Ring, comm: TorchRing, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sinks: Any, lengths: tuple[Any, Any], stats: RingStats | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out, lse)`` of this rank's rows, differentiable in ``q``, ``k``, ``v`` and
    ``sinks`` (its gradient: this rank's part)."""
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out, lse = RingFunction.apply(q, k, v, sinks, (ring, comm, lengths, stats))  # type: ignore[no-untyped-call]
        return out, lse
    return _forward(ring, comm, q, k, v, (sinks, lengths), stats)
