"""Validation of ``mask_mod`` and ``bias_mod``, before any array work.

Each mod must be callable (``mask_mod`` may also be a :class:`~._block_mask.BlockMask` made
for the call's sizes), and is probed once on one index of the inputs' library and device
(``batch = head = q_idx = kv_idx = 0``), so that a function that raises, returns another
library's array, the wrong dtype or a shape that does not follow its index arrays fails here
with an error naming the argument, not inside a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .block_mask import BlockMask
from .mod_calls import call_mod, check_mod_callable, index_grid

__all__ = ["check_mods"]


def _check_block_mask(bm: BlockMask, batch: int, heads: int, L: int, S: int) -> None:
    problems = [
        f"{name}={got} (the call has {want})"
        for name, got, want in (("L", bm.L, L), ("S", bm.S, S))
        if got != want
    ]
    problems += [
        f"{name}={got} (the call has {want}; None evaluates index 0 for every one)"
        for name, got, want in (("batch_size", bm.batch_size, batch), ("heads", bm.heads, heads))
        if got is not None and got != want
    ]
    if problems:
        raise ValueError("mask_mod is a BlockMask made for other sizes: " + ", ".join(problems))


def check_mods(
    xp: ModuleType,
    device: Any,
    mask_mod: Any,
    bias_mod: Any,
    batch_shape: tuple[int, ...],
    L: int,
    S: int,
) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """Check ``mask_mod`` and ``bias_mod`` for scores of ``(*batch_shape, L, S)``.

    ``batch_shape`` is the broadcast batch shape with the heads axis last (``()`` for 2-D
    inputs). Returns the two unchanged.
    """
    seq, heads = batch_shape[:-1], batch_shape[-1:]
    if isinstance(mask_mod, BlockMask):
        _check_block_mask(mask_mod, math.prod(seq), math.prod(heads), L, S)
    named = (("mask_mod", mask_mod), ("bias_mod", bias_mod))
    for name, mod in named:
        check_mod_callable(name, mod)
    if isinstance(bias_mod, BlockMask):
        raise TypeError("bias_mod must be a bias function, got a BlockMask (a mask_mod)")
    if mask_mod is None and bias_mod is None:
        return mask_mod, bias_mod
    probe = index_grid(xp, device, (1,) * len(seq), (1,) * len(heads), slice(0, 1), slice(0, 1))
    for name, mod in named:
        if mod is not None:
            call_mod(name, mod, probe, (1,) * (len(batch_shape) + 2))
    return mask_mod, bias_mod
