"""Block sizes and launch settings of the kernels: fixed under the interpreter and for small
calls, autotuned on a GPU for large ones.

The interpreter runs a kernel one program at a time, at a cost per interpreted operation
that hardly depends on the block size: large fixed blocks make it fast, and autotuning
would only repeat every launch. On a GPU, calls whose longer side reaches
:data:`AUTOTUNE_FROM` are autotuned over a few configurations per kernel (cached per GPU,
per power-of-two bucket of the lengths, head dims, dtypes and features); smaller calls use
one configuration, so that each new feature combination compiles once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..._problem.problem import Problem

__all__ = [
    "AUTOTUNE_FROM",
    "BACKWARD_KEYS_CONFIGS",
    "BACKWARD_QUERIES_CONFIGS",
    "FORWARD_CONFIGS",
    "WIDE_CONFIGS",
    "Blocks",
    "autotuned",
    "bucket",
    "default_blocks",
    "feature_block",
    "interpreting",
    "tuning_configs",
]

#: Longest side (``max(L, S)``) from which a GPU autotunes the block sizes.
AUTOTUNE_FROM = 512


@dataclass(frozen=True)
class Blocks:
    """Block sizes and launch settings of one kernel launch.

    ``block_m`` is the query block and ``block_n`` the key block (both powers of two, at
    least 16); ``num_warps`` and ``num_stages`` are triton's launch options.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def meta(self) -> dict[str, int]:
        """The launch keywords."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


#: Autotuned configurations (``block_m``, ``block_n``, warps, stages) of the forward and
#: ``dQ`` kernels (a query block per program) and of the ``dK``/``dV`` kernel (a key block per
#: program: long key blocks amortise the loads of ``Q`` and ``dO``), for padded head dims up
#: to 128; :data:`WIDE_CONFIGS` for wider heads, whose tiles need smaller blocks to fit
#: shared memory.
FORWARD_CONFIGS = (
    Blocks(128, 64, 4, 3),
    Blocks(128, 64, 8, 3),
    Blocks(128, 128, 8, 3),
    Blocks(128, 128, 8, 2),
    Blocks(128, 64, 4, 4),
    Blocks(64, 64, 4, 3),
)
BACKWARD_QUERIES_CONFIGS = (
    Blocks(128, 32, 4, 3),
    Blocks(128, 64, 8, 3),
    Blocks(64, 64, 4, 3),
    Blocks(128, 64, 8, 2),
)
BACKWARD_KEYS_CONFIGS = (
    Blocks(32, 128, 4, 3),
    Blocks(64, 128, 8, 3),
    Blocks(64, 64, 4, 3),
    Blocks(64, 128, 8, 2),
)
WIDE_CONFIGS = {
    "forward": (Blocks(64, 64, 4, 2), Blocks(64, 32, 4, 2)),
    "queries": (Blocks(64, 32, 4, 2), Blocks(32, 32, 4, 2)),
    "keys": (Blocks(32, 64, 4, 2), Blocks(32, 32, 4, 2)),
}


def tuning_configs(p: Problem, kind: str) -> tuple[Blocks, ...]:
    """The autotuned configurations of a kernel kind (``"forward"``, ``"queries"``: the
    ``dQ`` kernel, ``"keys"``: the ``dK``/``dV`` kernel) for ``p``'s head dims."""
    if max(feature_block(p.E), feature_block(p.Ev)) > 128:
        return WIDE_CONFIGS[kind]
    return {
        "forward": FORWARD_CONFIGS,
        "queries": BACKWARD_QUERIES_CONFIGS,
        "keys": BACKWARD_KEYS_CONFIGS,
    }[kind]


def interpreting() -> bool:
    """Whether triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def feature_block(n: int) -> int:
    """The padded feature width of a head dim ``n``: the next power of two, at least 16."""
    return max(16, 1 << max(0, n - 1).bit_length())


def bucket(n: int) -> int:
    """The autotuning bucket of a length: its next power of two."""
    return 1 << max(0, n - 1).bit_length()


def autotuned(p: Problem) -> bool:
    """Whether the launch is autotuned (on a GPU, from :data:`AUTOTUNE_FROM`)."""
    return not interpreting() and max(p.L, p.S) >= AUTOTUNE_FROM


def default_blocks(p: Problem) -> Blocks:
    """The fixed configuration: 64 x 64 blocks (32 x 32 for head dims above 128, whose
    tiles would not fit shared memory with two pipeline stages)."""
    if interpreting():
        return Blocks(64, 64)
    if max(feature_block(p.E), feature_block(p.Ev)) > 128:
        return Blocks(32, 32, 4, 1)
    return Blocks(64, 64, 4, 2)
