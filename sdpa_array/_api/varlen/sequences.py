"""The sequences of a packed variable-length call, each a call of its own.

A packed call (:mod:`sdpa_array._api.varlen`) is split by its offsets
(:func:`~sdpa_array._problem.packed.check_packed`) into ``N`` sequences; :func:`sequences`
validates every one as a heads-first call before any of them runs. Sequence ``n`` is batch
element ``n`` of the padded call: its problem's ``dropout_batch_start`` is ``n`` (the same
dropout bits) and its mask, bias and score functions are called with ``batch + n``
(:class:`ShiftedMod`, :class:`ShiftedScoreMod`), positions counting from the sequence's
start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..._arrays.typing import Array
from ..._problem.block_mask import BlockMask
from ..._problem.mods_data import NamedMod
from ..._problem.options import Options
from ..._problem.packed import Packed
from ..._problem.problem import Problem, validate
from ..layout import swap_heads_and_length

__all__ = [
    "OPTION_NAMES",
    "Sequence",
    "ShiftedMod",
    "ShiftedScoreMod",
    "keywords_of",
    "sequences",
    "static_offsets",
]

#: The options of :func:`scaled_dot_product_attention` that a packed call takes.
OPTION_NAMES = (
    "is_causal", "window", "alignment", "scale", "softcap", "enable_gqa", "sinks",
    "dropout_p", "dropout_seed", "mask_mod", "bias_mod", "score_mod",
)  # fmt: skip


@dataclass(frozen=True, repr=False)
class ShiftedMod(NamedMod):
    """``mod`` called with ``batch + start``: sequence ``start`` of a packed call, run alone
    (batch index 0), gets the batch index it has in the padded call."""

    factory = "shifted"
    mod: Any
    start: int

    def arguments(self) -> str:
        return f"{self.mod!r}, start={self.start}"

    @property
    def host_equivalent(self) -> bool:
        return isinstance(self.mod, NamedMod) and self.mod.host_equivalent

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.mod(batch + self.start, head, q_idx, kv_idx)

    def __getattr__(self, name: str) -> Any:
        # ``in_dtype`` (the ready-made bias functions' form in a compute dtype) where the
        # wrapped function has one, shifted the same way
        if name == "in_dtype" and hasattr(self.mod, "in_dtype"):
            return lambda dtype: ShiftedMod(self.mod.in_dtype(dtype), self.start)
        raise AttributeError(name)


@dataclass(frozen=True, repr=False)
class ShiftedScoreMod(NamedMod):
    """A ``score_mod`` (and its ``derivative``, where it has one) called with
    ``batch + start``, as :class:`ShiftedMod`."""

    factory = "shifted"
    mod: Any
    start: int

    def arguments(self) -> str:
        return f"{self.mod!r}, start={self.start}"

    def __call__(self, score: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.mod(score, batch + self.start, head, q_idx, kv_idx)

    def __getattr__(self, name: str) -> Any:
        if name == "derivative" and hasattr(self.mod, "derivative"):
            slope = self.mod.derivative
            return lambda score, batch, *rest: slope(score, batch + self.start, *rest)
        raise AttributeError(name)


def shifted(mod: Any, start: int, *, score: bool = False) -> Any:
    """``mod`` for sequence ``start`` (itself for the first sequence, or without a mod);
    ``score``: a score function."""
    if mod is None or start == 0:
        return mod
    return ShiftedScoreMod(mod, start) if score else ShiftedMod(mod, start)


def check_mods(mask_mod: Any) -> None:
    """Refuse a ``BlockMask``: it is made for one ``(L, S)``."""
    if isinstance(mask_mod, BlockMask):
        raise TypeError(
            "mask_mod must be a mask function for the packed layout, not a BlockMask: a "
            "BlockMask is made for one (L, S), and the packed sequences have their own; "
            "pass its mask function (BlockMask.mask_mod)"
        )


@dataclass(frozen=True)
class Sequence:
    """One sequence of a packed call: its heads-first arrays, options and problem."""

    query: Array
    key: Array
    value: Array
    options: Options
    problem: Problem


def sequences(
    query: Array,
    key: Array,
    value: Array,
    packed: Packed,
    options: Options,
    limit: int | None = None,
) -> list[Sequence]:
    """Every sequence of the call (the first ``limit``), validated before any of them runs;
    with no sequence, one empty one, on which the options are checked."""
    check_mods(options.mask_mod)
    out = []
    count = max(packed.count, 1)
    for n in range(count if limit is None else min(limit, count)):
        rows = packed.rows(n) if packed.count else slice(0, 0)
        keys = packed.keys(n) if packed.count else slice(0, 0)
        q, k, v = swap_heads_and_length(query[rows, ...], key[keys, ...], value[keys, ...])
        mine = options.replace(
            mask_mod=shifted(options.mask_mod, n),
            bias_mod=shifted(options.bias_mod, n),
            score_mod=shifted(options.score_mod, n, score=True),
        )
        problem = replace(validate(q, k, v, mine), dropout_batch_start=n)
        out.append(Sequence(q, k, v, mine, problem))
    return out


def static_offsets(keywords: dict[str, Any], packed: Packed) -> dict[str, Any]:
    """The keywords with the offsets as tuples of ints: static under ``jax.jit``."""
    return {
        **keywords,
        "cu_seqlens_q": tuple(int(o) for o in packed.query_offsets),
        "cu_seqlens_k": tuple(int(o) for o in packed.key_offsets),
    }


def keywords_of(options: Options) -> dict[str, Any]:
    """The options of a packed call as its keyword arguments."""
    return {name: getattr(options, name) for name in OPTION_NAMES}
