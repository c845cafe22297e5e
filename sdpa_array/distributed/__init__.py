"""Context parallelism: attention over a sequence split among processes or devices.

:func:`ring_attention` is called by every participant with its slice of the sequence;
the key/value slices travel round a ring of ``torch.distributed`` ranks (point-to-point
sends) or of ``shard_map`` devices (``lax.ppermute``), and each participant merges its
partial results by their log-sum-exp. :func:`shard_sequence`, :func:`unshard_sequence`,
:func:`reorder_for_sharding` and :func:`restore_order` cut a full array into the slices of
the ``"contiguous"`` and ``"zigzag"`` shardings and put them back; :func:`ring_schedule`
lists the block pairs each participant computes. torch and JAX are imported on first use.
"""

from ._api import ring_attention
from ._schedule import (
    SHARDINGS,
    BlockPair,
    reorder_for_sharding,
    restore_order,
    ring_schedule,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "SHARDINGS",
    "BlockPair",
    "RingStats",
    "reorder_for_sharding",
    "restore_order",
    "ring_attention",
    "ring_schedule",
    "shard_sequence",
    "unshard_sequence",
]


def __getattr__(name: str) -> object:
    """``RingStats`` (torch's statistics record; imports torch on first use)."""
    if name == "RingStats":
        from ._torch import RingStats

        return RingStats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
