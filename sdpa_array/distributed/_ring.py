"""The ring's work at one step, on any Array-API library: the same for torch and JAX.

At step ``t`` participant ``r`` holds the key/value slice of participant ``(r - t) mod P``
and computes the block pairs :func:`~._schedule.schedule_of` lists for it: the forward
merges each pair's partial ``(out, lse)`` into its query chunk's running result
(:func:`~sdpa_array.merge_attention_states`); the backward adds each pair's gradients,
computed from the whole call's output and log-sum-exp, into the query chunk's ``dq`` and
the key chunk's ``dk``, ``dv`` (which travel on with the slice).

Lengths (counted over the whole sequence) reach each pair at its absolute offsets
(:func:`~sdpa_array._api.blocks.block_options`). Sinks are folded in once, after the last
step (:func:`finish_forward`): each row's log-sum-exp gains the sink's term and its output
shrinks by the same factor; the backward then takes that log-sum-exp, so the blocks'
probabilities are the whole call's, and the sinks' gradient comes from the participant's
rows (:func:`sink_gradient`).
"""

from __future__ import annotations

import math
from typing import Any

from .._api.blocks import block_forward, block_options, block_vjp
from .._arrays.compat import array_namespace, device
from .._arrays.merge import merge_attention_states
from .._arrays.typing import Array
from .._kernels.layout import sum_to_shape
from .._problem.options import Options
from ._schedule import BlockPair, local_chunks, schedule_of, split_by_position

__all__ = ["Ring", "backward_step", "forward_step", "sink_gradient"]

#: The whole call's ``(query_lengths, key_lengths)``: integer arrays or ``None``.
Lengths = tuple[Any, Any]


class Ring:
    """One call's ring: its options, the participants and each participant's schedule."""

    def __init__(
        self,
        options: Options,
        world_size: int,
        sharding: str,
        lengths: tuple[int, int],
        implementation: str,
        by_lengths: bool = False,
    ) -> None:
        self.options = options  # without lengths: they reach the steps as arrays
        self.world_size = world_size
        self.sharding = sharding
        self.lengths = lengths  # local query and key lengths
        self.implementation = implementation
        self.by_lengths = by_lengths  # sequence lengths (query or key) restrict the call
        self._schedules: dict[int, list[list[BlockPair]]] = {}

    def schedule(self, rank: int) -> list[list[BlockPair]]:
        if rank not in self._schedules:
            self._schedules[rank] = schedule_of(
                self.options,
                rank,
                self.world_size,
                self.sharding,
                self.lengths,
                self.by_lengths,
            )
        return self._schedules[rank]

    def pairs(self, rank: int, step: int) -> list[BlockPair]:
        return self.schedule(rank)[step]

    def _chunks(self, n: int) -> list[range]:
        restricted = split_by_position(self.options, self.world_size, self.lengths, self.by_lengths)
        return [r for r, _ in local_chunks(0, self.world_size, self.sharding, n, restricted)]

    def query_chunks(self) -> list[range]:
        """The local rows of each query chunk (the same on every participant)."""
        return self._chunks(self.lengths[0])

    def key_chunks(self) -> list[range]:
        """The local rows of each key chunk (the same on every participant)."""
        return self._chunks(self.lengths[1])


def _rows(x: Array, rows: range, features: bool = True) -> Array:
    if features:
        return x[..., rows.start : rows.stop, :]
    return x[..., rows.start : rows.stop]


def empty_state(ring: Ring, q: Array, v: Array, compute: Any) -> list[tuple[Array, Array]]:
    """``(out, lse)`` of each query chunk before any key: zeros and ``-inf``."""
    xp = array_namespace({"query": q})
    lead = tuple(q.shape[:-2])
    ev = int(v.shape[-1])
    dev = device(q)
    return [
        (
            xp.zeros((*lead, len(r), ev), dtype=compute, device=dev),
            xp.full((*lead, len(r)), -math.inf, dtype=compute, device=dev),
        )
        for r in ring.query_chunks()
    ]


def forward_step(
    ring: Ring, rank: int, step: int, q: Array, k: Array, v: Array, state: list[Any],
    lengths: Lengths = (None, None),
) -> list[Any]:  # fmt: skip
    """The running ``(out, lse)`` per query chunk after the pairs of ``(rank, step)``."""
    xp = array_namespace({"query": q})
    chunks = ring.query_chunks()
    state = list(state)
    for pair in ring.pairs(rank, step):
        i = chunks.index(pair.query_rows)
        out, lse = block_forward(
            _rows(q, pair.query_rows),
            _rows(k, pair.key_rows),
            _rows(v, pair.key_rows),
            block_options(ring.options, lengths, pair.query_positions, pair.key_positions),
            pair.band,
            ring.implementation,
        )
        acc_out, acc_lse = state[i]
        out = xp.astype(out, acc_out.dtype, copy=False)
        state[i] = merge_attention_states([acc_out, out], [acc_lse, lse])
    return state


def finish_forward(state: list[Any], dtype: Any, sinks: Array | None = None) -> tuple[Array, Array]:
    """The slice's output (in ``dtype``) and log-sum-exp from the chunks' results, with
    ``sinks`` (broadcastable to ``(..., Hq)``) folded in: ``lse' = logaddexp(lse, sink)``,
    ``out' = out * exp(lse - lse')`` (a sink is one more logit whose value row is zero)."""
    xp = array_namespace({"out": state[0][0]})
    outs = [o for o, _ in state]
    lses = [s for _, s in state]
    out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)
    lse = lses[0] if len(lses) == 1 else xp.concat(lses, axis=-1)
    if sinks is not None:
        sink = xp.astype(sinks, lse.dtype)[..., None]
        total = xp.logaddexp(lse, sink)
        kept = xp.where(total == -math.inf, 0.0, xp.exp(lse - total))
        out, lse = out * kept[..., None], total
    return xp.astype(out, dtype, copy=False), lse


def sink_gradient(sinks: Array, grad_out: Array, out: Array, lse: Array) -> Array:
    """The gradient of ``sinks`` from this participant's rows: ``-sum_i p_i D_i`` with the
    sink's share ``p_i = exp(sink - lse_i)`` (``lse`` includes the sink) and ``D_i =
    rowsum(dO * O)``, summed to the sinks' shape and dtype."""
    xp = array_namespace({"out": out})
    compute = lse.dtype
    sink = xp.astype(sinks, compute)[..., None]
    share = xp.where(lse == -math.inf, 0.0, xp.exp(sink - lse))
    delta = xp.sum(xp.astype(grad_out, compute) * xp.astype(out, compute), axis=-1)
    grad = -xp.sum(share * delta, axis=-1)
    return xp.astype(sum_to_shape(xp, grad, tuple(sinks.shape)), sinks.dtype)


def zero_grads(ring: Ring, k: Array, v: Array) -> list[Any]:
    """``(dk, dv)`` of each key chunk of a slice, zero."""
    xp = array_namespace({"key": k})
    dev = device(k)
    return [
        (
            xp.zeros((*k.shape[:-2], len(r), k.shape[-1]), dtype=k.dtype, device=dev),
            xp.zeros((*v.shape[:-2], len(r), v.shape[-1]), dtype=v.dtype, device=dev),
        )
        for r in ring.key_chunks()
    ]


def backward_step(
    ring: Ring,
    rank: int,
    step: int,
    saved: tuple[Array, Array, Array, Array],
    k: Array,
    v: Array,
    dq: list[Array],
    dkv: list[Any],
    lengths: Lengths = (None, None),
) -> tuple[list[Array], list[Any]]:
    """``dq`` per query chunk and ``(dk, dv)`` per key chunk of the held slice after the
    pairs of ``(rank, step)``; ``saved``: the participant's query, output cotangent,
    output and log-sum-exp."""
    q, grad_out, out, lse = saved
    q_chunks, k_chunks = ring.query_chunks(), ring.key_chunks()
    dq, dkv = list(dq), list(dkv)
    for pair in ring.pairs(rank, step):
        i, j = q_chunks.index(pair.query_rows), k_chunks.index(pair.key_rows)
        gq, gk, gv = block_vjp(
            _rows(q, pair.query_rows),
            _rows(k, pair.key_rows),
            _rows(v, pair.key_rows),
            _rows(grad_out, pair.query_rows),
            _rows(out, pair.query_rows),
            _rows(lse, pair.query_rows, features=False),
            block_options(ring.options, lengths, pair.query_positions, pair.key_positions),
            pair.band,
        )
        dq[i] = dq[i] + gq
        dk, dv = dkv[j]
        dkv[j] = (dk + gk, dv + gv)
    return dq, dkv


def zero_dq(ring: Ring, q: Array) -> list[Array]:
    xp = array_namespace({"query": q})
    return [
        xp.zeros((*q.shape[:-2], len(r), q.shape[-1]), dtype=q.dtype, device=device(q))
        for r in ring.query_chunks()
    ]


def concat_rows(parts: list[Array]) -> Array:
    """The chunks' rows as one slice."""
    if len(parts) == 1:
        return parts[0]
    return array_namespace({"array": parts[0]}).concat(parts, axis=-2)
