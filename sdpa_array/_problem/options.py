"""The options of one attention call, declared once.

The public functions keep their keyword signatures (users and type checkers see every
option) and turn them into one :class:`Options` record at once; validation
(:func:`~sdpa_array._problem.problem.validate`) and everything below take the record, never the
options one by one. A new option is a new field here, with its default; its meaning is
documented on :func:`sdpa_array.scaled_dot_product_attention`.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace, is_dask_array
from .._arrays.typing import Alignment, Array, BiasMod, MaskMod, PaddingSide, ScoreMod
from .peer_keywords import unexpected_keywords

__all__ = ["Options", "check_dropout"]


@dataclass(frozen=True, eq=False)
class Options:
    """The 18 options of an attention call, as given (validation happens once, in
    :func:`~sdpa_array._problem.problem.validate`, which turns them into a ``Problem``).

    Attributes
    ----------
    mask, bias, is_causal, window, alignment, scale, softcap, enable_gqa
        The restrictions and score terms of :func:`sdpa_array.scaled_dot_product_attention`.
    query_lengths, key_lengths, padding_side, segment_ids
        Sequences: lengths (padded on the right or the left) and packed documents.
    sinks, dropout_p, dropout_seed
        Attention sinks and same-bits dropout.
    mask_mod, bias_mod, score_mod
        Mask, bias and score functions.
    """

    mask: Array | None = None
    bias: Array | None = None
    is_causal: bool = False
    window: tuple[int | None, int | None] | None = None
    alignment: Alignment = "top_left"
    scale: float | Array | None = None
    softcap: float | None = None
    enable_gqa: bool = False
    query_lengths: int | Array | None = None
    key_lengths: int | Array | None = None
    padding_side: PaddingSide = "right"
    segment_ids: tuple[Array, Array] | None = None
    sinks: Array | None = None
    dropout_p: float = 0.0
    dropout_seed: int | Array | None = None
    mask_mod: MaskMod | None = None
    bias_mod: BiasMod | None = None
    score_mod: ScoreMod | None = None

    @classmethod
    def of(cls, options: dict[str, Any], *, where: str) -> Options:
        """The record of keyword arguments ``options``; an unknown name is a ``TypeError``
        naming the function ``where`` that received it and the options there are."""
        unknown = options.keys() - NAMES
        if unknown:
            raise TypeError(unexpected_keywords(where, unknown, NAMES))
        return cls(**options)

    @classmethod
    def gather(cls, names: Mapping[str, Any]) -> Options:
        """The record of the options among ``names``: a public function's ``locals()``,
        whose keywords are the options one by one (its other names are left out)."""
        return cls(**{name: names[name] for name in NAMES if name in names})

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def scalar_signature(self) -> tuple[Any, ...] | None:
        """Every option with its type, when each is ``None``, a number, a string or a
        tuple of those (a window): what a call's validation depends on besides its arrays'
        shapes, dtypes and devices. ``None`` when an option holds an array or a function,
        whose values or behaviour validation reads."""
        values = _get_fields(self)
        kinds = tuple(map(type, values))
        if not _SIMPLE.issuperset(kinds):
            return None
        if tuple in kinds:  # a window: its sides' types too
            inner = tuple(tuple(map(type, v)) for v in values if type(v) is tuple)
            if not all(_SIMPLE.issuperset(t) and tuple not in t for t in inner):
                return None
            return values, kinds, inner
        return values, kinds

    def keywords(self) -> dict[str, Any]:
        """The options as the public functions' keyword arguments (the values themselves,
        not copies)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES}


#: Types of the option values that :meth:`Options.scalar_signature` takes as they are.
_SIMPLE = frozenset({type(None), bool, int, float, str, tuple})

#: The options' names, in the order of the record's fields.
_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(Options))
NAMES = frozenset(_FIELD_NAMES)
_get_fields = operator.attrgetter(*_FIELD_NAMES)


def check_dropout(dropout_p: Any, dropout_seed: Any) -> tuple[float, int | Array | None]:
    """Validated ``(dropout_p, dropout_seed)``; raise naming the argument otherwise.

    The seed is a Python int (NumPy integers, 0-d or not, become one), or a 0-d integer
    array of another library, kept as it is (traced under ``jax.jit``, on a device): its
    library is checked against the inputs' in :func:`~sdpa_array._problem.problem.validate`.
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):  # NumPy's too
        raise TypeError(
            f"dropout_p must be a real number in [0, 1), got {type(dropout_p).__name__} "
            f"{dropout_p!r}"
        )
    value = float(dropout_p)
    if not (0.0 <= value < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if value == 0.0:
        return 0.0, None
    if dropout_seed is None:
        raise ValueError(
            f"dropout_p={dropout_p!r} needs dropout_seed (an int, or a 0-d integer array): "
            "the keep mask is a function of the seed, so that the backward pass can "
            "regenerate it"
        )
    if isinstance(dropout_seed, bool | np.bool_):
        raise TypeError("dropout_seed must be an int, got bool")
    if isinstance(dropout_seed, np.ndarray | np.generic):
        if dropout_seed.shape != () or dropout_seed.dtype.kind not in "iu":
            raise TypeError(
                "dropout_seed must be an int or a 0-d integer array, got a NumPy array of "
                f"shape {dropout_seed.shape} and dtype {dropout_seed.dtype}"
            )
        return value, int(dropout_seed)
    if hasattr(dropout_seed, "shape") and hasattr(dropout_seed, "dtype"):
        return value, _seed_array(dropout_seed)
    try:
        seed = operator.index(dropout_seed)
    except TypeError:
        raise TypeError(
            f"dropout_seed must be an int or a 0-d integer array, got {type(dropout_seed).__name__}"
        ) from None
    return value, seed


def _seed_array(seed: Any) -> Array:
    """A seed given as an array of a library other than NumPy: 0-d, integer, not lazy."""
    if is_dask_array(seed):
        raise TypeError("dropout_seed must be an int or a 0-d integer array, not a lazy Dask array")
    xp = array_namespace({"dropout_seed": seed})
    if tuple(seed.shape) != () or not xp.isdtype(seed.dtype, "integral"):
        raise TypeError(
            "dropout_seed must be an int or a 0-d integer array, got an array of shape "
            f"{tuple(seed.shape)} and dtype {seed.dtype}"
        )
    return seed
