"""The keyword arguments of :func:`sdpa_array.scaled_dot_product_attention`, as one type.

Its overloads differ only in the three ``return_*`` flags; every other keyword is typed
once here and spelled in them as ``**options: Unpack[AttentionKeywords]``, so a new option
is one more line here and in the implementation's signature, not one per overload.
``tests/test_structure.py`` checks these keys against the options record.
"""

from __future__ import annotations

from typing import TypedDict

from .._arrays.typing import (
    Alignment,
    Array,
    BiasMod,
    ImplementationName,
    Layout,
    MaskMod,
    PaddingSide,
    ScoreMod,
)

__all__ = ["AttentionKeywords"]


class AttentionKeywords(TypedDict, total=False):
    """The keyword options of the forward call but ``return_weights``, ``return_lse`` and
    ``return_max_scores`` (documented on :func:`sdpa_array.scaled_dot_product_attention`)."""

    mask: Array | None
    bias: Array | None
    is_causal: bool
    window: tuple[int | None, int | None] | None
    alignment: Alignment
    scale: float | Array | None
    softcap: float | None
    enable_gqa: bool
    query_lengths: int | Array | None
    key_lengths: int | Array | None
    padding_side: PaddingSide
    segment_ids: tuple[Array, Array] | None
    sinks: Array | None
    dropout_p: float
    dropout_seed: int | Array | None
    mask_mod: MaskMod | None
    bias_mod: BiasMod | None
    score_mod: ScoreMod | None
    implementation: ImplementationName
    block_q: int | None
    block_k: int | None
    layout: Layout
