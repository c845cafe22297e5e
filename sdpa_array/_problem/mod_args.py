"""Validation of ``mask_mod``, ``bias_mod`` and ``score_mod``, before any array work.

Each mod must be callable (``mask_mod`` may also be a :class:`~._block_mask.BlockMask` made
for the call's sizes), and is probed once on one index of the inputs' library and device
(``batch = head = q_idx = kv_idx = 0``; a ``score_mod`` and its ``derivative`` method,
where it has one, also get a zero score in the compute dtype), so that a function that
raises, returns another library's array, the wrong dtype or a shape that does not follow its
index arrays fails here with an error naming the argument, not inside a kernel.
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


def _check_head_rows(named: tuple[tuple[str, Any], ...], heads: int) -> None:
    """``ValueError`` for a ready-made mod whose per-head data (``head_rows``: ALiBi's
    slopes, T5's table, the temperatures) covers fewer than the call's ``heads`` query
    heads (a gather past its end would raise inside a kernel, or give NaN in JAX)."""
    for name, mod in named:
        rows = getattr(mod, "head_rows", None)
        if isinstance(rows, int) and rows < heads:
            raise ValueError(
                f"{name} {mod!r} holds data for {rows} query heads, but the call has {heads}"
            )


def check_mods(
    xp: ModuleType,
    device: Any,
    mask_mod: Any,
    bias_mod: Any,
    score_mod: Any,
    dtype: Any,
    batch_shape: tuple[int, ...],
    L: int,
    S: int,
) -> tuple[Callable[..., Any] | None, ...]:
    """Check ``mask_mod``, ``bias_mod`` and ``score_mod`` for scores of
    ``(*batch_shape, L, S)`` computed in ``dtype``.

    ``batch_shape`` is the broadcast batch shape with the heads axis last (``()`` for 2-D
    inputs). Returns the three unchanged.
    """
    seq, heads = batch_shape[:-1], batch_shape[-1:]
    if isinstance(mask_mod, BlockMask):
        _check_block_mask(mask_mod, math.prod(seq), math.prod(heads), L, S)
    derivative = getattr(score_mod, "derivative", None)
    named = (("mask_mod", mask_mod), ("bias_mod", bias_mod), ("score_mod", score_mod))
    for name, mod in (*named, ("score_mod.derivative", derivative)):
        check_mod_callable(name, mod)
    for name, mod in named[1:]:
        if isinstance(mod, BlockMask):
            kind = name.removesuffix("_mod")
            raise TypeError(f"{name} must be a {kind} function, got a BlockMask (a mask_mod)")
    if mask_mod is None and bias_mod is None and score_mod is None:
        return mask_mod, bias_mod, score_mod
    _check_head_rows(named, math.prod(heads))
    probe = index_grid(xp, device, (1,) * len(seq), (1,) * len(heads), slice(0, 1), slice(0, 1))
    shape = (1,) * (len(batch_shape) + 2)
    for name, mod in named[:2]:
        if mod is not None:
            call_mod(name, mod, probe, shape)
    if score_mod is not None:
        # up to 2 x 2 scores: a result that is not one score per score shows in its shape
        rows, cols = max(1, min(L, 2)), max(1, min(S, 2))
        grid = index_grid(
            xp, device, (1,) * len(seq), (1,) * len(heads), slice(0, rows), slice(0, cols)
        )
        shape = (*shape[:-2], rows, cols)
        zero = xp.zeros(shape, dtype=dtype, device=device)
        for name, mod in (("score_mod", score_mod), ("score_mod.derivative", derivative)):
            if mod is not None:
                call_mod(name, mod, grid, shape, score=zero)
    return mask_mod, bias_mod, score_mod
