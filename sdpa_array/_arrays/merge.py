"""Merging partial attention results over disjoint key sets: the log-sum-exp rescaling.

:func:`merge_attention_states` is the public face: it checks every argument before any array
work and then calls :func:`_merge`, the generic Array-API arithmetic, which knows nothing of
particular libraries. None of the supported libraries has a merge of its own, so there is
nothing to delegate to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .compat import array_namespace, device
from .typing import Array

__all__ = ["merge_attention_states"]


@dataclass(frozen=True)
class _Parts:
    """One argument (``outs`` or ``lses``): its arrays and the shape they stand for."""

    name: str
    arrays: dict[str, Array]  # label ("outs", or "outs[2]" for a sequence) -> array
    sequence: bool

    @property
    def first(self) -> Array:
        return next(iter(self.arrays.values()))

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked shape ``(n, ...)``, without stacking anything."""
        shape = tuple(self.first.shape)
        return (len(self.arrays), *shape) if self.sequence else shape

    def describe(self) -> str:
        """``outs`` and its shape, for messages (a sequence says how many parts it holds)."""
        if self.sequence:
            return (
                f"{self.name} (a sequence of {len(self.arrays)} parts of shape "
                f"{tuple(self.first.shape)}, so shape {self.shape})"
            )
        return f"{self.name} of shape {self.shape}"


def _parts(name: str, value: Any) -> _Parts:
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(
                f"{name} must hold at least one part (n >= 1), got an empty {type(value).__name__}"
            )
        return _Parts(name, {f"{name}[{i}]": a for i, a in enumerate(value)}, sequence=True)
    return _Parts(name, {name: value}, sequence=False)


def _namespace(outs: _Parts, lses: _Parts) -> ModuleType:
    named = {**outs.arrays, **lses.arrays}
    for label, value in named.items():
        if value is None:
            raise TypeError(f"{label} must be an array, got None")
        array_namespace({label: value})  # raises a TypeError naming the label
    try:
        return array_namespace(named)
    except TypeError:
        kinds: dict[str, list[str]] = {}
        for label, value in named.items():
            kinds.setdefault(f"{type(value).__module__}.{type(value).__qualname__}", []).append(
                label
            )
        found = "; ".join(f"{', '.join(labels)}: {kind}" for kind, labels in kinds.items())
        raise TypeError(f"outs and lses must come from one array library; got {found}") from None


def _check_sequence(parts: _Parts) -> None:
    """The parts of a sequence share one dtype and one shape (so that they stack)."""
    first_label, first = next(iter(parts.arrays.items()))
    for label, a in parts.arrays.items():
        if a.dtype != first.dtype:
            raise TypeError(
                f"the parts of {parts.name} must share one dtype, got {first_label} "
                f"{first.dtype} and {label} {a.dtype}"
            )
        if tuple(a.shape) != tuple(first.shape):
            raise ValueError(
                f"the parts of {parts.name} must share one shape, got {first_label} "
                f"{tuple(first.shape)} and {label} {tuple(a.shape)}"
            )


def _check_dtypes(xp: ModuleType, outs: _Parts, lses: _Parts) -> Any:
    """Check the dtypes and return the compute dtype."""
    for parts in (outs, lses):
        dtype = parts.first.dtype
        if not xp.isdtype(dtype, "real floating"):
            raise TypeError(
                f"{parts.name} must have a real floating dtype (float16, bfloat16, float32, "
                f"float64), got {dtype}"
            )
    dtype = outs.first.dtype
    wide = xp.finfo(dtype).bits >= 32
    compute, compute_name = (dtype, str(dtype)) if wide else (xp.float32, "float32")
    lse_dtype = lses.first.dtype
    if xp.finfo(lse_dtype).bits < xp.finfo(compute).bits:
        raise TypeError(
            f"lses must be at least as wide as the compute dtype {compute_name} of outs {dtype} "
            f"(float32 for float16/bfloat16 outs, else the outs' dtype), got {lse_dtype}; "
            "a narrower log-sum-exp would lose the precision of the rescaling"
        )
    return compute


def _check_shapes(outs: _Parts, lses: _Parts) -> None:
    shape = outs.shape
    if len(shape) < 3:
        raise ValueError(
            f"outs must have shape (n, ..., L, Ev) (or be a sequence of n arrays of shape "
            f"(..., L, Ev)), at least 3 dimensions; got {outs.describe()}"
        )
    if shape[0] == 0:
        raise ValueError(f"outs must hold at least one part (n >= 1), got {outs.describe()}")
    if lses.shape != shape[:-1]:
        raise ValueError(
            f"lses must have the shape (n, ..., L) = {shape[:-1]} of outs without its last "
            f"axis; got {lses.describe()} for {outs.describe()}"
        )


def _check_devices(outs: _Parts, lses: _Parts) -> Any:
    """Check that every array is on one device and return it."""
    named = {**outs.arrays, **lses.arrays}
    labels = iter(named)
    first = next(labels)
    where = device(named[first])
    for label in labels:
        if device(named[label]) != where:
            raise ValueError(
                f"outs and lses must be on one device, got {first} on {where} and {label} on "
                f"{device(named[label])}"
            )
    return where


@dataclass(frozen=True)
class _MergeCall:
    """A validated call: the namespace, device and dtypes, and the stacked arrays."""

    xp: ModuleType
    device: Any
    dtype: Any
    compute_dtype: Any
    outs: Array
    lses: Array


def _stacked(xp: ModuleType, parts: _Parts) -> Array:
    return xp.stack(list(parts.arrays.values()), axis=0) if parts.sequence else parts.first


def _validate(outs_arg: Any, lses_arg: Any) -> _MergeCall:
    outs, lses = _parts("outs", outs_arg), _parts("lses", lses_arg)
    xp = _namespace(outs, lses)
    for parts in (outs, lses):
        _check_sequence(parts)
    compute = _check_dtypes(xp, outs, lses)
    _check_shapes(outs, lses)
    where = _check_devices(outs, lses)
    return _MergeCall(xp, where, outs.first.dtype, compute, _stacked(xp, outs), _stacked(xp, lses))


def _merge(c: _MergeCall) -> tuple[Array, Array]:
    """The rescaling, in the compute dtype, with no ``inf - inf`` and no ``log(0)``.

    Every ``where`` that hides ``-inf`` also gets its argument replaced (the "double where"),
    so the branch not taken holds finite numbers and carries a gradient of exactly zero.
    """
    xp = c.xp
    o = xp.astype(c.outs, c.compute_dtype, copy=False)  # (n, ..., L, Ev)
    s = xp.astype(c.lses, c.compute_dtype, copy=False)  # (n, ..., L)
    zero = xp.zeros((), dtype=c.compute_dtype, device=c.device)
    one = xp.ones((), dtype=c.compute_dtype, device=c.device)
    neg_inf = xp.full((), -math.inf, dtype=c.compute_dtype, device=c.device)

    m = xp.max(s, axis=0)  # (..., L)
    some = m != neg_inf  # the row has a non-empty part (NaN stays NaN)
    shift = xp.where(some, m, zero)  # an all-empty row subtracts 0: exp(-inf - 0) = 0
    w = xp.exp(s - shift)  # (n, ..., L); 1 for the largest part, 0 for empty parts
    total = xp.where(some, xp.sum(w, axis=0), one)  # >= 1 where some, else 1
    lse = xp.where(some, shift + xp.log(total), neg_inf)
    # An empty part's output is ignored, whatever it holds (some kernels give NaN there).
    o = xp.where(xp.expand_dims(s != neg_inf, axis=-1), o, zero)
    out = xp.sum(xp.expand_dims(w, axis=-1) * o, axis=0) / xp.expand_dims(total, axis=-1)
    return xp.astype(out, c.dtype, copy=False), lse


def merge_attention_states(
    outs: Array | Sequence[Array], lses: Array | Sequence[Array], /
) -> tuple[Array, Array]:
    r"""Merge partial attention results over disjoint key sets into attention over their union.

    Part ``i`` is the output ``outs[i]`` and log-sum-exp ``lses[i]`` of attention over one
    set of keys, as :func:`scaled_dot_product_attention` returns them with
    ``return_lse=True``; the sets are disjoint. The result is what attention over all the
    keys together returns: with ``m`` the maximum of the ``lses[i]`` and
    ``w_i = exp(lses[i] - m)``,

    .. math::

        \mathrm{lse} = m + \log \sum_i w_i, \qquad
        \mathrm{out} = \frac{\sum_i w_i \, \mathrm{outs}[i]}{\sum_i w_i}.

    Parameters
    ----------
    outs : array, shape (n, ..., L, Ev), or sequence of n arrays of shape (..., L, Ev)
        The parts' outputs, ``n >= 1``, real floating. A list or tuple (as FlashInfer and
        xFormers users hold the parts) is stacked on a new first axis; its arrays must share
        one shape and dtype.
    lses : array, shape (n, ..., L), or sequence of n arrays of shape (..., L)
        The parts' log-sum-exps; ``-inf`` marks a row with no key in that part. Real
        floating and at least as wide as the compute dtype (float32 for float16/bfloat16
        ``outs``, else the ``outs``' dtype): float32 log-sum-exps go with float16 or
        bfloat16 outputs, as FlashAttention returns them; a wider dtype is rounded to the
        compute dtype. Same library and device as ``outs``.

    Returns
    -------
    out : array, shape (..., L, Ev)
        The merged output, in the dtype, library and device of ``outs``.
    lse : array, shape (..., L)
        The merged log-sum-exp, in the compute dtype.

    Raises
    ------
    TypeError
        An argument (or a part of a sequence) that is not an array, arrays of different
        libraries, a dtype that is not real floating, parts of a sequence with different
        dtypes, ``lses`` narrower than the compute dtype.
    ValueError
        No part (``n == 0`` or an empty sequence), ``outs`` with fewer than 3 dimensions,
        ``lses.shape != outs.shape[:-1]``, parts of a sequence with different shapes,
        arrays on different devices.

    Notes
    -----
    Everything runs in the compute dtype with differentiable Array-API operations, so torch
    autograd and JAX transforms (``jit``, ``vmap``, ``grad``) see through it, and Dask stays
    lazy. A part with ``lse = -inf`` contributes exactly nothing, and its output is ignored
    whatever it holds; a row whose every part is empty gets an output of zeros and a
    log-sum-exp of ``-inf``. Neither gives NaN, in the result or in the gradients (the
    ``-inf`` are replaced before ``exp`` and ``log``, not after). NaN in the inputs of a
    non-empty part propagates; so does an ``lse`` of ``+inf``.

    Merging is exact in exact arithmetic: splitting the keys, attending to each part and
    merging gives attention over all keys, so a long key sequence can be processed in
    pieces, on different devices or at different times (KV-cache prefixes, ring attention,
    split-K decoding).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import merge_attention_states, scaled_dot_product_attention
    >>> q = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> k = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
    >>> v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    >>> first = scaled_dot_product_attention(q, k[:1], v[:1], return_lse=True)
    >>> rest = scaled_dot_product_attention(q, k[1:], v[1:], return_lse=True)
    >>> out, lse = merge_attention_states([first[0], rest[0]], [first[1], rest[1]])
    >>> out.round(3)
    array([[0.424, 0.716],
           [0.86 , 0.716]])
    >>> full, full_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, full) and np.allclose(lse, full_lse))
    True

    A part with no key for a row (``lse = -inf``) contributes nothing:

    >>> outs = np.array([[[2.0, 4.0]], [[0.0, 0.0]]])  # (n=2, L=1, Ev=2)
    >>> merge_attention_states(outs, np.array([[0.5], [-np.inf]]))
    (array([[2., 4.]]), array([0.5]))
    """
    return _merge(_validate(outs, lses))
