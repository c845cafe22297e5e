"""Which sequence positions each participant holds, and which block pairs it computes when.

Pure index arithmetic, the same for torch and JAX: the ring runs exactly the pairs of
:func:`ring_schedule`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from .._api.blocks import block_band, block_is_empty
from .._arrays.compat import array_namespace
from .._arrays.typing import Array
from .._problem.band import Band
from .._problem.options import Options

__all__ = [
    "SHARDINGS",
    "BlockPair",
    "chunks_of",
    "reorder_for_sharding",
    "restore_order",
    "ring_schedule",
    "shard_sequence",
    "unshard_sequence",
]

#: The ways a sequence is cut among the participants.
SHARDINGS = ("contiguous", "zigzag")


def check_sharding(sharding: Any) -> str:
    if not isinstance(sharding, str) or sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    return sharding


def _check_world(rank: Any, world_size: Any) -> tuple[int, int]:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}"
        )
    return rank, world_size


def chunks_of(rank: int, world_size: int, sharding: str) -> tuple[int, ...]:
    """The indices of the chunks participant ``rank`` holds, in order: ``(rank,)`` of
    ``world_size`` chunks (contiguous), ``(rank, 2 * world_size - 1 - rank)`` of
    ``2 * world_size`` (zigzag)."""
    rank, world_size = _check_world(rank, world_size)
    if check_sharding(sharding) == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def _axis(x: Array, axis: int) -> int:
    axis = operator.index(axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of shape {tuple(x.shape)}")
    return int(axis % x.ndim)


def _take(x: Array, axis: int, start: int, stop: int) -> Array:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def shard_sequence(
    x: Array, rank: int, world_size: int, *, sharding: str = "contiguous", axis: int = -2
) -> Array:
    """Participant ``rank``'s slice of the full array ``x`` along the sequence ``axis``.

    ``"contiguous"``: positions ``[rank * n, (rank + 1) * n)`` with ``n = length /
    world_size``; ``"zigzag"``: the sequence cut into ``2 * world_size`` chunks, chunks
    ``rank`` and ``2 * world_size - 1 - rank`` in that order. The length must divide evenly.
    """
    chunks = chunks_of(rank, world_size, sharding)
    axis = _axis(x, axis)
    count = world_size * len(chunks)
    length = int(x.shape[axis])
    if length % count:
        raise ValueError(
            f"the sequence axis {axis} of length {length} does not divide into {count} "
            f"chunks ({sharding!r} sharding over {world_size} participants)"
        )
    m = length // count
    parts = [_take(x, axis, c * m, (c + 1) * m) for c in chunks]
    if len(parts) == 1:
        return parts[0]
    return array_namespace({"x": x}).concat(parts, axis=axis)


def unshard_sequence(slices: Any, *, sharding: str = "contiguous", axis: int = -2) -> Array:
    """The full array from every participant's slice (``slices[rank]``), the inverse of
    :func:`shard_sequence`."""
    slices = list(slices)
    world_size = len(slices)
    if not world_size:
        raise ValueError("unshard_sequence needs at least one slice")
    axis = _axis(slices[0], axis)
    xp = array_namespace({f"slice {i}": s for i, s in enumerate(slices)})
    if check_sharding(sharding) == "contiguous":
        return xp.concat(slices, axis=axis)
    count = 2 * world_size
    n = int(slices[0].shape[axis])
    if n % 2:
        raise ValueError(f"zigzag slices hold two chunks each: length {n} along axis {axis} is odd")
    m = n // 2
    ordered: list[Any] = [None] * count
    for rank, s in enumerate(slices):
        first, second = chunks_of(rank, world_size, sharding)
        ordered[first] = _take(s, axis, 0, m)
        ordered[second] = _take(s, axis, m, n)
    return xp.concat(ordered, axis=axis)


def reorder_for_sharding(
    x: Array, world_size: int, *, sharding: str = "contiguous", axis: int = -2
) -> Array:
    """``x`` with its sequence reordered so that cutting it into ``world_size`` contiguous
    slices gives the slices of ``sharding`` (what a ``shard_map`` over the sequence axis
    hands each participant); :func:`restore_order` undoes it."""
    return array_namespace({"x": x}).concat(
        [shard_sequence(x, r, world_size, sharding=sharding, axis=axis) for r in range(world_size)],
        axis=_axis(x, axis),
    )


def restore_order(
    x: Array, world_size: int, *, sharding: str = "contiguous", axis: int = -2
) -> Array:
    """The inverse of :func:`reorder_for_sharding`."""
    slices = [
        shard_sequence(x, r, world_size, sharding="contiguous", axis=axis)
        for r in range(world_size)
    ]
    return unshard_sequence(slices, sharding=sharding, axis=axis)


@dataclass(frozen=True)
class BlockPair:
    """One (query block, key block) product of the ring.

    Attributes
    ----------
    step : int
        The ring step: the participant holds the key/value slice of ``source``.
    source : int
        The participant whose key/value slice it is.
    query_chunk, key_chunk : int
        Local indices of the query and key chunks (0, or 0 and 1 with zigzag).
    query_rows, key_rows : range
        Their rows in the local slices.
    query_positions, key_positions : range
        Their absolute positions in the sequence.
    band : Band
        The causal and window restrictions of the block, at its absolute offsets.
    """

    step: int
    source: int
    query_chunk: int
    key_chunk: int
    query_rows: range
    key_rows: range
    query_positions: range
    key_positions: range
    band: Band

    @property
    def entries(self) -> int:
        """The (query, key) pairs the restrictions admit in this block."""
        b = self.band
        total = 0
        for i in range(b.L):
            lo, hi = b.key_range(i, i + 1)
            total += max(0, hi - lo)
        return total


def local_chunks(
    rank: int, world_size: int, sharding: str, n: int, restricted: bool
) -> list[tuple[range, int]]:
    """``(local rows, absolute start)`` of each chunk participant ``rank`` computes with:
    without a restriction by position, the whole slice is one chunk."""
    chunks = chunks_of(rank, world_size, sharding)
    if not restricted or len(chunks) == 1:
        return [(range(0, n), rank * n)]
    m = n // len(chunks)
    return [(range(i * m, (i + 1) * m), c * m) for i, c in enumerate(chunks)]


def split_by_position(
    options: Options, world_size: int, lengths: tuple[int, int], by_lengths: bool = False
) -> bool:
    """Whether positions restrict the call (causal, a window, sequence lengths:
    ``by_lengths``), so that the zigzag sharding's two chunks are computed apart."""
    extent = (lengths[0] * world_size, lengths[1] * world_size)
    return by_lengths or block_band(options, extent, slice(0, 1), slice(0, 1)).restricts


def schedule_of(
    options: Options, rank: int, world_size: int, sharding: str, lengths: tuple[int, int],
    by_lengths: bool = False,
) -> list[list[BlockPair]]:  # fmt: skip
    """The pairs participant ``rank`` computes at each step, for local lengths ``(n_q,
    n_k)`` (options validated); ``by_lengths``: sequence lengths restrict the call."""
    n_q, n_k = lengths
    extent = (n_q * world_size, n_k * world_size)
    restricted = split_by_position(options, world_size, lengths, by_lengths)
    queries = local_chunks(rank, world_size, sharding, n_q, restricted)
    steps = []
    for step in range(world_size):
        source = (rank - step) % world_size
        keys = local_chunks(source, world_size, sharding, n_k, restricted)
        pairs = []
        for qi, (q_rows, q0) in enumerate(queries):
            for ki, (k_rows, k0) in enumerate(keys):
                rows = slice(q0, q0 + len(q_rows))
                cols = slice(k0, k0 + len(k_rows))
                band = block_band(options, extent, rows, cols)
                if block_is_empty(band):
                    continue
                pairs.append(
                    BlockPair(
                        step,
                        source,
                        qi,
                        ki,
                        q_rows,
                        k_rows,
                        range(rows.start, rows.stop),
                        range(cols.start, cols.stop),
                        band,
                    )
                )
        steps.append(pairs)
    return steps


def ring_schedule(
    rank: int,
    world_size: int,
    query_length: int,
    key_length: int | None = None,
    *,
    sharding: str = "contiguous",
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
) -> list[list[BlockPair]]:
    """The block pairs participant ``rank`` computes at each ring step.

    Parameters
    ----------
    rank, world_size : int
        The participant and the number of participants.
    query_length, key_length : int
        The local slice lengths (``key_length``: ``query_length`` by default).
    sharding, is_causal, window, alignment
        As for :func:`ring_attention`.

    Returns
    -------
    list of list of BlockPair
        One list per step (``world_size`` of them); pairs that the restrictions exclude
        entirely are left out. With causal attention and ``"contiguous"`` sharding,
        participant ``r`` computes ``r + 1`` pairs; with ``"zigzag"`` every participant
        computes ``2 * world_size + 1`` pairs over the same number of admissible entries.
    """
    _check_world(rank, world_size)
    check_sharding(sharding)
    key_length = query_length if key_length is None else key_length
    options = Options(is_causal=is_causal, window=window, alignment=alignment)  # type: ignore[arg-type]
    return schedule_of(options, rank, world_size, sharding, (query_length, key_length))
