"""A fixed softmax reference: ``exp(score)`` without each row's maximum, where that is safe.

The online softmax subtracts each row's running maximum before ``exp`` so that nothing
overflows, which costs a maximum and a subtraction over every score tile and a rescaling
whenever a later tile raises the maximum. When every score of a call is known to lie in
``[-T, T]`` with ``T = log(finfo.max) / 4`` (22.2 in float32, 177 in float64), ``exp(score)``
is finite and normal for every admissible pair, and a reference of 0 gives the same
softmax: :func:`fixed_reference` decides it once per call, from a bound read on the host.

The bound is Cauchy-Schwarz's: ``|scale · q·k| <= |scale| · max‖q_i‖ · max‖k_j‖``, at most
the soft-cap where there is one, and every sink must lie in ``[-T, T]`` too. The values
must also keep their digits once multiplied by weights in ``[e^-T, e^T]``: the largest
``|v|`` times ``S e^T`` stays below a quarter of the largest float, and the smallest
non-zero ``|v|`` times ``e^-T · eps`` above the smallest normal one. Where the terms are not
known (a bias or a caller's function, which may add anything), where a value cannot be read
without waiting for a device or computing a lazy graph (:func:`known_value`), or where a
check fails (a NaN fails them all), the kernels keep the running maximum.

The same bound (the soft-cap's where smaller) decides where the kernels on NumPy and
array-api-strict cut the scores' contraction into chunks (:func:`chunks_from_bound`: the
blocked kernels and the materialized VJP): above the limit the scores' own rounding is most
of the output's error (:mod:`sdpa_array._arrays.products`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .._arrays.compat import known_value
from .._arrays.typing import Array
from .._problem.problem import Problem

if TYPE_CHECKING:
    from .operands import Operands

__all__ = [
    "beyond_limit",
    "chunks_from_bound",
    "exponent_limit",
    "fixed_reference",
    "product_bound",
]


def exponent_limit(p: Problem) -> float:
    """``T = log(finfo(compute dtype).max) / 4``: the largest score bound for which the
    kernels take ``exp(score)`` without a row maximum."""
    return math.log(float(p.xp.finfo(p.compute_dtype).max)) / 4


def _largest(p: Problem, x: Array) -> float | None:
    return known_value(p.xp.max(x))


def _largest_norm(p: Problem, x: Array) -> float | None:
    """An upper bound on the largest Euclidean norm of ``x``'s rows (last axis), read on
    the host (``None`` where it is not finite: a NaN or an infinity in ``x``).

    The rows' squared norms ``vecdot(x, x)`` in ``x``'s dtype, whose largest is grown by
    their rounding (a sum of ``E`` non-negative terms, each rounded: relative error below
    ``(E + 1) u``, taken as ``2 E eps``) and by what squares below the smallest normal
    number may have lost (``E`` times it). The largest ``|x|`` is read first (no
    temporary), so that no square overflows: where ``E`` squares of it could, the rows are
    divided by it first.
    """
    xp = p.xp
    high, low = _largest(p, x), known_value(xp.min(x))
    if high is None or low is None:
        return None
    top = max(high, -low)
    if not math.isfinite(top):  # NaN too
        return None
    finfo = xp.finfo(x.dtype)
    n = int(x.shape[-1])
    growth = 1.0 + 2.0 * n * float(finfo.eps)
    if top * top * n * growth <= float(finfo.max):
        squares = _largest(p, xp.vecdot(x, x))
        if squares is None:
            return None
        return math.sqrt(squares * growth + n * float(finfo.smallest_normal))
    unit = x / top
    squares = _largest(p, xp.vecdot(unit, unit))
    return None if squares is None else top * math.sqrt(squares * growth)


def product_bound(p: Problem, ops: Operands) -> float:
    """Cauchy-Schwarz's bound on ``|scale · q·k|``, ``|scale| · max‖q_i‖ · max‖k_j‖``, read
    on the host (``inf`` where the product overflows): NaN where it cannot be read (a NaN or
    an infinity among the operands, a lazy array), 0 where there are no scores."""
    if any(math.prod(a.shape) == 0 for a in (ops.q, ops.k)):
        return 0.0
    scale = 1.0 if ops.terms.scale_in_query else known_value(ops.terms.scale)
    if scale is None:
        return math.nan
    q_norm = _largest_norm(p, ops.q)
    k_norm = None if q_norm is None else _largest_norm(p, ops.k)
    if q_norm is None or k_norm is None:
        return math.nan
    return abs(scale) * q_norm * k_norm


def beyond_limit(p: Problem, magnitude: float, softcap: float | None) -> bool:
    """Whether scores whose magnitude is at most ``magnitude`` (the soft-cap's where
    smaller) may lie outside ``±T`` (:func:`exponent_limit`); a NaN (not read) may."""
    capped = magnitude if softcap is None or math.isnan(magnitude) else min(magnitude, softcap)
    return not capped <= exponent_limit(p)


def chunks_from_bound(p: Problem, ops: Operands) -> tuple[Operands, float | None]:
    """``ops`` with one product per tile's scores where :func:`product_bound` keeps them
    within ``±T`` (:func:`exponent_limit`), and the bound (``None`` where the operands
    take one product anyway and it was not read): the scores' contraction is cut
    (:func:`~sdpa_array._arrays.products.score_chunks`) only where they may be large."""
    if ops.score_chunks == 1:
        return ops, None
    bound = product_bound(p, ops)
    if not beyond_limit(p, bound, ops.terms.softcap):
        ops = dataclasses.replace(ops, score_chunks=1)
    return ops, bound


#: Rows of the values read at a time by :func:`_value_magnitudes` (per batch element and
#: head): a slice's magnitudes stay in cache and need no large allocation.
VALUE_ROWS = 256


def _value_magnitudes(p: Problem, v: Array) -> tuple[float, float] | None:
    """The largest ``|v|`` and the smallest non-zero one (``inf`` where all are zeros),
    read slice by slice along the rows; ``None`` where they cannot be read."""
    xp = p.xp
    largest = smallest = None
    inf = xp.asarray(math.inf, dtype=v.dtype, device=p.device)
    rows = int(v.shape[-2])
    for start in range(0, rows, VALUE_ROWS):
        m = xp.abs(v[..., start : min(start + VALUE_ROWS, rows), :])
        high, low = xp.max(m), xp.min(m)
        nonzero = xp.min(xp.where(m == 0, inf, m)) if known_value(low) == 0 else low
        if largest is None:
            largest, smallest = high, nonzero
        else:
            largest, smallest = xp.maximum(largest, high), xp.minimum(smallest, nonzero)
    read = [known_value(largest), known_value(smallest)]
    if read[0] is None or read[1] is None:
        return None
    return read[0], read[1]


def fixed_reference(p: Problem, ops: Operands, bound: float | None = None) -> bool:
    """Whether every score of the call lies within ``±T`` (:func:`exponent_limit`) and the
    values keep their digits under weights in ``[e^-T, e^T]``: the softmax may then take
    ``exp(score)`` with a reference of 0 for every row. ``bound``: :func:`product_bound`,
    where the caller has read it."""
    terms = ops.terms
    if terms.bias is not None or terms.bias_mod is not None or terms.score_mod is not None:
        return False
    if any(math.prod(a.shape) == 0 for a in (ops.q, ops.k, ops.v)):
        return False  # nothing to bound (an empty batch, no features)
    xp = p.xp
    limit = exponent_limit(p)
    if beyond_limit(p, product_bound(p, ops) if bound is None else bound, terms.softcap):
        return False
    if terms.sink is not None:
        sink = _largest(p, xp.abs(terms.sink))
        if sink is None or not sink <= limit:
            return False
    magnitudes = _value_magnitudes(p, ops.v)
    if magnitudes is None:
        return False
    largest, smallest_nonzero = magnitudes
    finfo = xp.finfo(p.compute_dtype)
    fits = largest * p.S * math.exp(limit) <= float(finfo.max) / 4
    # every non-zero |v| times e^-T eps stays normal: at least this
    threshold = float(finfo.smallest_normal) / (math.exp(-limit) * float(finfo.eps))
    keeps_digits = smallest_nonzero >= threshold
    return bool(fits and keeps_digits)
