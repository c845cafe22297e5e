"""The mods of :mod:`sdpa_array.mods` (one small frozen dataclass each, named by its factory
call) and their helpers: the data a mod captures, gathers, argument checks and the bucket
thresholds of T5's relative position bias.

A mod's data (segment ids, slopes, a bias table, prefix lengths) may come from another array
library than the index arrays the mod is called with. :class:`Captured` hands the data over
in the indices' library: as it is where the libraries match (so JAX tracers closed over
under ``jax.jit`` and lazy Dask arrays work), through a host copy otherwise.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from sdpa_array._arrays.compat import (
    array_namespace,
    device,
    host_values,
    is_array_api_obj,
    namespace_name,
    on_device_of,
)

from .._arrays import inplace
from .mod_parameters import sum_by_head_and_bucket, sum_by_index

__all__ = [
    "AlibiMod",
    "AndMasks",
    "Captured",
    "CausalMod",
    "DocumentMod",
    "NamedMod",
    "OrMasks",
    "PrefixLMMod",
    "RelativePositionBiasMod",
    "SlidingWindowMod",
    "check_index",
    "gather",
    "t5_thresholds",
]

#: What the dtype kinds are called in messages.
_KIND_WORDS = {"integral": "an integer", "real floating": "a real floating"}


#: The largest size or index the functions taking one accept (a size past it could not be
#: allocated, and index arithmetic on it would overflow 64-bit integers).
MAX_SIZE = 2**40


def check_index(
    name: str, value: Any, *, minimum: int | None = None, maximum: int = MAX_SIZE
) -> int:
    """``value`` as a Python int; TypeError (not an integer, or a bool) or ValueError
    (below ``minimum`` or above ``maximum``) naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    if number > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {number}")
    return number


def gather(xp: ModuleType, flat: Any, index: Any) -> Any:
    """``flat[index]`` elementwise, for a 1-D ``flat`` and an integer ``index`` of any shape.

    Only ``take`` on 1-D arrays and ``reshape``: array-api-strict has no indexing with an
    integer array of several axes.
    """
    values = xp.take(flat, xp.reshape(index, (-1,)), axis=0)
    return xp.reshape(values, tuple(index.shape))


class Captured:
    """An array a mod captures, checked once and handed over in the indices' library.

    Parameters
    ----------
    owner : str
        The factory's name, for messages (``"document"``...).
    name : str
        The argument's name, for messages.
    value : array or sequence
        An array of any supported library, or a sequence NumPy turns into one.
    kind : {"integral", "real floating"}
        The dtype kind the array must have. A sequence of integers becomes float64 where a
        floating array is asked for.
    ndims : tuple of int
        The numbers of axes allowed.
    """

    def __init__(
        self, owner: str, name: str, value: Any, *, kind: str, ndims: tuple[int, ...]
    ) -> None:
        self.owner, self.name = owner, name
        if not is_array_api_obj(value):
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
                raise TypeError(
                    f"{owner}: {name} must be an array or a sequence of numbers, "
                    f"got {type(value).__name__}"
                )
            value = np.asarray(value)
            if value.dtype.kind in "iu" and kind == "real floating":
                value = value.astype(np.float64)
        xp = array_namespace({name: value})
        if len(value.shape) not in ndims:
            axes = " or ".join(f"{n}-D" for n in ndims)
            raise ValueError(f"{owner}: {name} must be {axes}, got shape {tuple(value.shape)}")
        if not xp.isdtype(value.dtype, kind):
            raise TypeError(
                f"{owner}: {name} must have {_KIND_WORDS[kind]} dtype, got {value.dtype}"
            )
        self.value = value
        self.shape: tuple[int, ...] = tuple(value.shape)
        self.library = namespace_name(xp)
        self._host: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"<{self.library} {self.value.dtype} array of shape {self.shape}>"

    def host(self, target: str = "numpy") -> np.ndarray:
        """A NumPy copy of the values (made on first use and kept).

        Raises
        ------
        TypeError
            If the values cannot be read on the host (a lazy Dask array, a JAX tracer),
            naming ``target``, the index arrays' library that needs them.
        """
        if self._host is None:
            values = host_values(self.value)
            if values is None:
                raise TypeError(
                    f"{self.owner}: its {self.name} ({self!r}) cannot be read on the host, "
                    f"which index arrays of {target} need (as NumPy ones do when masks are "
                    "classified on the host); pass concrete data, or data of the index "
                    "arrays' library"
                )
            # torch warns on read-only NumPy arrays (JAX's, through DLPack, are)
            self._host = values if values.flags.writeable else values.copy()
        return self._host

    def like(self, xp: ModuleType, index: Any) -> Any:
        """The data as an array of ``xp`` on the device of ``index``."""
        if namespace_name(xp) == self.library:
            return on_device_of(xp, self.value, index)
        return xp.asarray(self.host(namespace_name(xp)), device=device(index))

    def flat(self, xp: ModuleType, index: Any) -> Any:
        """:meth:`like`, flattened to 1-D (for :func:`gather`)."""
        return xp.reshape(self.like(xp, index), (-1,))


@functools.lru_cache(maxsize=64)
def t5_thresholds(num_buckets: int, max_distance: int) -> tuple[int, tuple[int, ...]]:
    """``max_exact`` and the smallest distance of each logarithmic bucket of T5.

    For ``num_buckets`` buckets (those of one direction), distances below
    ``max_exact = num_buckets // 2`` have their own bucket; a distance ``d >= max_exact``
    goes to ``max_exact + int(log(d / max_exact) / log(max_distance / max_exact) *
    (num_buckets - max_exact))``, at most ``num_buckets - 1``. That bucket is
    ``max_exact`` plus the number of thresholds at most ``d``: comparing integers instead of
    rounding a logarithm in the arrays' dtype gives the same buckets (those of the formula
    in Python's float64) in every library and dtype.
    """
    max_exact = num_buckets // 2
    scale = math.log(max_distance / max_exact)

    def bucket(d: int) -> int:
        large = max_exact + int(math.log(d / max_exact) / scale * (num_buckets - max_exact))
        return min(large, num_buckets - 1)

    thresholds = []
    for k in range(max_exact + 1, num_buckets):
        lo, hi = max_exact, max_distance  # bucket(max_distance) is the last one
        while lo < hi:  # the formula grows with d: the smallest d with bucket(d) >= k
            mid = (lo + hi) // 2
            if bucket(mid) >= k:
                hi = mid
            else:
                lo = mid + 1
        thresholds.append(lo)
    return max_exact, tuple(thresholds)


def _namespace(batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
    return array_namespace({"batch": batch, "head": head, "q_idx": q_idx, "kv_idx": kv_idx})


class NamedMod:
    """A mod: callable with ``(batch, head, q_idx, kv_idx)``, named by its factory call."""

    factory: ClassVar[str]

    def arguments(self) -> str:
        raise NotImplementedError

    @property
    def host_equivalent(self) -> bool:
        """Whether the mod gives on NumPy indices what it gives on any library's (its
        data, if any, copied to the host), so its blocks may be classified there."""
        return True

    def __repr__(self) -> str:
        return f"{self.factory}({self.arguments()})"

    @property
    def __name__(self) -> str:
        return self.factory


def _segments(xp: Any, data: Captured, batch: Any, position: Any) -> Any:
    index = position if len(data.shape) == 1 else batch * data.shape[-1] + position
    return gather(xp, data.flat(xp, position), index)


@dataclass(frozen=True, repr=False)
class CausalMod(NamedMod):
    factory: ClassVar[str] = "causal"
    offset: int

    def arguments(self) -> str:
        return f"offset={self.offset}"

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        _namespace(batch, head, q_idx, kv_idx)
        return kv_idx <= q_idx + self.offset


@dataclass(frozen=True, repr=False)
class SlidingWindowMod(NamedMod):
    factory: ClassVar[str] = "sliding_window"
    left: int | None
    right: int | None
    offset: int

    def arguments(self) -> str:
        return f"left={self.left}, right={self.right}, offset={self.offset}"

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _namespace(batch, head, q_idx, kv_idx)
        centre = q_idx + self.offset
        if self.left is None and self.right is None:
            return xp.ones_like(kv_idx - centre, dtype=xp.bool)
        if self.left is None:
            return kv_idx <= centre + self.right
        if self.right is None:
            return kv_idx >= centre - self.left
        return (kv_idx >= centre - self.left) & (kv_idx <= centre + self.right)


@dataclass(frozen=True, repr=False)
class PrefixLMMod(NamedMod):
    factory: ClassVar[str] = "prefix_lm"
    prefix: int | Captured

    def arguments(self) -> str:
        return f"prefix_lengths={self.prefix!r}"

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _namespace(batch, head, q_idx, kv_idx)
        if isinstance(self.prefix, Captured):
            lengths = xp.astype(self.prefix.flat(xp, kv_idx), kv_idx.dtype)
            prefix = gather(xp, lengths, batch)
        else:
            prefix = self.prefix
        return (kv_idx < prefix) | (kv_idx <= q_idx)


@dataclass(frozen=True, repr=False)
class DocumentMod(NamedMod):
    factory: ClassVar[str] = "document"
    query: Captured
    key: Captured

    def arguments(self) -> str:
        return f"query_segments={self.query!r}, key_segments={self.key!r}"

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _namespace(batch, head, q_idx, kv_idx)
        return _segments(xp, self.query, batch, q_idx) == _segments(xp, self.key, batch, kv_idx)


@dataclass(frozen=True, repr=False)
class AlibiMod(NamedMod):
    factory: ClassVar[str] = "alibi"
    slopes: Captured

    def arguments(self) -> str:
        return f"slopes={self.slopes!r}"

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _namespace(batch, head, q_idx, kv_idx)
        slopes = gather(xp, self.slopes.flat(xp, head), head)
        distance = xp.astype(-xp.abs(q_idx - kv_idx), slopes.dtype)  # -0 would be -0.0
        return slopes * distance

    @property
    def head_rows(self) -> int:
        """How many query heads the slopes cover (checked against the call's)."""
        return self.slopes.shape[0]

    def in_dtype(self, dtype: Any) -> AlibiInDtype:
        """The same bias computed in ``dtype`` (the kernels' compute dtype)."""
        return AlibiInDtype(self, dtype)

    @property
    def parameters(self) -> tuple[Any, ...]:
        """The trainable slopes (:mod:`~sdpa_array._problem.mod_parameters`)."""
        return (self.slopes.value,)

    def with_parameters(self, slopes: Any) -> AlibiMod:
        """The same mod with other slopes (traced ones, under autodiff)."""
        return AlibiMod(Captured("alibi", "slopes", slopes, kind="real floating", ndims=(1,)))

    def parameter_cotangents(
        self, cotangent: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any
    ) -> tuple[Any, ...]:
        """``d slopes[h] = -sum(cotangent * |q_idx - kv_idx|)`` over head ``h``'s entries."""
        xp = _namespace(batch, head, q_idx, kv_idx)
        distance = xp.astype(xp.abs(q_idx - kv_idx), cotangent.dtype)
        return (-sum_by_index(xp, cotangent * distance, head, self.slopes.shape[0]),)


@dataclass(frozen=True, repr=False)
class AlibiInDtype(NamedMod):
    """:class:`AlibiMod` computed in one floating dtype: the positions and the slopes are
    cast to it first, so a tile costs one difference, one ``abs`` and one product there.

    Positions below ``2**24`` are exact in float32; each slope is rounded once (exact for
    the power-of-two slopes of a power-of-two head count), so the values are those of the
    mod rounded to ``dtype``, or one rounding away.
    """

    factory: ClassVar[str] = "alibi"
    base: AlibiMod
    dtype: Any

    def arguments(self) -> str:
        return self.base.arguments()

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _namespace(batch, head, q_idx, kv_idx)
        slopes = -xp.astype(gather(xp, self.base.slopes.flat(xp, head), head), self.dtype)
        distance = xp.abs(xp.astype(q_idx, self.dtype) - xp.astype(kv_idx, self.dtype))
        return inplace.multiply(distance, slopes)  # no third tile-sized array where allowed

    @property
    def parameters(self) -> tuple[Any, ...]:
        return self.base.parameters

    def parameter_cotangents(
        self, cotangent: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any
    ) -> tuple[Any, ...]:
        return self.base.parameter_cotangents(cotangent, batch, head, q_idx, kv_idx)


@dataclass(frozen=True, repr=False)
class RelativePositionBiasMod(NamedMod):
    factory: ClassVar[str] = "relative_position_bias"
    table: Captured
    num_buckets: int
    max_distance: int
    bidirectional: bool

    def arguments(self) -> str:
        return (
            f"table={self.table!r}, num_buckets={self.num_buckets}, "
            f"max_distance={self.max_distance}, bidirectional={self.bidirectional}"
        )

    @property
    def head_rows(self) -> int:
        """How many query heads the table covers (checked against the call's)."""
        return self.table.shape[0]

    @property
    def parameters(self) -> tuple[Any, ...]:
        """The trainable table (:mod:`~sdpa_array._problem.mod_parameters`)."""
        return (self.table.value,)

    def with_parameters(self, table: Any) -> RelativePositionBiasMod:
        """The same mod with another table (a traced one, under autodiff)."""
        captured = Captured("relative_position_bias", "table", table, kind="real floating",
                            ndims=(2,))  # fmt: skip
        return RelativePositionBiasMod(
            captured, self.num_buckets, self.max_distance, self.bidirectional
        )

    def parameter_cotangents(
        self, cotangent: Any, batch: Any, head: Any, q_idx: Any, kv_idx: Any
    ) -> tuple[Any, ...]:
        """``d table[h, n] = sum(cotangent)`` over head ``h``'s entries in bucket ``n``."""
        xp = _namespace(batch, head, q_idx, kv_idx)
        bucket = self._bucket(xp, kv_idx - q_idx)
        heads = self.table.shape[0]
        grad = sum_by_head_and_bucket(xp, cotangent, head, bucket, heads, self.num_buckets)
        return (grad,)

    def offset_cotangents(self, sums: Any, head: Any, offsets: Any) -> tuple[Any, ...]:
        """:meth:`parameter_cotangents` from sums by relative position: ``sums[..., m]`` is
        the cotangent summed over the entries with ``kv_idx - q_idx = offsets[m]`` (the
        bias depends on nothing else), ``head`` the heads of the leading axes ``(..., 1)``."""
        xp = array_namespace({"sums": sums, "offsets": offsets})
        bucket = self._bucket(xp, offsets)
        heads = self.table.shape[0]
        grad = sum_by_head_and_bucket(
            xp, sums[..., None, :], head[..., None], bucket[None, :], heads, self.num_buckets
        )
        return (grad,)

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _namespace(batch, head, q_idx, kv_idx)
        bucket = self._bucket(xp, kv_idx - q_idx)
        return gather(xp, self.table.flat(xp, q_idx), head * self.num_buckets + bucket)

    def _bucket(self, xp: ModuleType, relative: Any) -> Any:
        """The bucket of each relative position ``kv_idx - q_idx``."""
        if self.bidirectional:
            buckets = self.num_buckets // 2
            base = xp.astype(relative > 0, relative.dtype) * buckets
            distance = xp.abs(relative)
        else:
            buckets = self.num_buckets
            base = None
            distance = xp.where(relative < 0, -relative, xp.zeros_like(relative))
        max_exact, thresholds = t5_thresholds(buckets, self.max_distance)
        large = xp.full_like(distance, max_exact)
        for threshold in thresholds:
            large = large + xp.astype(distance >= threshold, distance.dtype)
        bucket = xp.where(distance < max_exact, distance, large)
        return bucket if base is None else bucket + base


@dataclass(frozen=True, repr=False)
class AndMasks(NamedMod):
    factory: ClassVar[str] = "and_masks"
    mods: tuple[Callable[[Any, Any, Any, Any], Any], ...]

    def arguments(self) -> str:
        return ", ".join(repr(mod) for mod in self.mods)

    def combine(self, a: Any, b: Any) -> Any:
        return a & b

    @property
    def host_equivalent(self) -> bool:
        return all(isinstance(mod, NamedMod) and mod.host_equivalent for mod in self.mods)

    def __call__(self, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = self.mods[0](batch, head, q_idx, kv_idx)
        for mod in self.mods[1:]:
            result = self.combine(result, mod(batch, head, q_idx, kv_idx))
        return result


@dataclass(frozen=True, repr=False)
class OrMasks(AndMasks):
    factory: ClassVar[str] = "or_masks"

    def combine(self, a: Any, b: Any) -> Any:
        return a | b
