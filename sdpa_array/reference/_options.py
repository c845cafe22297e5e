"""The oracle's options, gathered once into one record.

The public functions keep their keywords one by one (the same as the library's); each
gathers them with :meth:`OracleOptions.gather` and hands the record on, so that no
function inside the oracle takes the options one by one. This record is the oracle's own:
it shares nothing with the library's options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["OracleOptions"]


@dataclasses.dataclass(frozen=True)
class OracleOptions:
    """Every option of the oracle's attention call but its ``return_*`` flags and layout
    (documented on :func:`sdpa_array.reference.scaled_dot_product_attention`)."""

    mask: Any = None
    bias: Any = None
    is_causal: bool = False
    window: tuple[int | None, int | None] | None = None
    alignment: str = "top_left"
    scale: Any = None
    softcap: float | None = None
    enable_gqa: bool = False
    query_lengths: Any = None
    key_lengths: Any = None
    padding_side: str = "right"
    segment_ids: tuple[Any, Any] | None = None
    sinks: Any = None
    dropout_p: float = 0.0
    dropout_seed: Any = None
    mask_mod: Callable[..., Any] | None = None
    bias_mod: Callable[..., Any] | None = None
    score_mod: Callable[..., Any] | None = None

    @classmethod
    def gather(cls, names: Mapping[str, Any]) -> OracleOptions:
        """The record of the options among ``names`` (a public function's ``locals()``:
        its other arguments are left out)."""
        return cls(**{f.name: names[f.name] for f in dataclasses.fields(cls) if f.name in names})
