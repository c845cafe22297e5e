"""Type names shared by the package.

``Array`` stands for an array of any Array-API library (NumPy, CuPy, torch, JAX, Dask,
array-api-strict): the standard defines a protocol, not a class, so static checkers see
``Any``; the alias says in every signature what is meant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeAlias

__all__ = [
    "Alignment",
    "Array",
    "BiasMod",
    "ImplementationName",
    "Layout",
    "MaskMod",
    "PaddingSide",
    "ScoreMod",
    "VJPImplementationName",
]

#: An array of any Array-API library.
Array: TypeAlias = Any

#: Where query ``i``'s diagonal sits when ``L != S``.
Alignment: TypeAlias = Literal["top_left", "bottom_right"]

#: How the inputs and outputs hold their axes: ``"BHLE"`` (batch..., heads, length,
#: features), or ``"BLHE"`` (batch..., length, heads, features: transformers, Flax and
#: FlashAttention's layout).
Layout: TypeAlias = Literal["BHLE", "BLHE"]

#: Where each row's padding sits when lengths are given: after its valid tokens, or before.
PaddingSide: TypeAlias = Literal["right", "left"]

#: The ``implementation=`` choices of the forward pass.
ImplementationName: TypeAlias = Literal[
    "auto", "materialized", "blocked", "native", "triton", "dask"
]

#: The ``implementation=`` choices of the VJP.
VJPImplementationName: TypeAlias = Literal[
    "auto", "materialized", "blocked", "native", "triton", "dask"
]

#: A mask function ``mask_mod(batch, head, q_idx, kv_idx) -> boolean array``.
MaskMod: TypeAlias = Callable[[Any, Any, Any, Any], Any]

#: A bias function ``bias_mod(batch, head, q_idx, kv_idx) -> floating array``.
BiasMod: TypeAlias = Callable[[Any, Any, Any, Any], Any]

#: A score function ``score_mod(score, batch, head, q_idx, kv_idx) -> floating array``.
ScoreMod: TypeAlias = Callable[[Any, Any, Any, Any, Any], Any]
