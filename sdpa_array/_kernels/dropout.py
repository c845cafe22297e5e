r"""Dropout of the attention weights: a counter-based keep mask, the same bits everywhere.

Whether weight ``p[b, h, i, j]`` is kept is a function of ``(seed, b, h, i, j)`` only, ``b``
being the flattened index of the batch axes before the heads axis and ``h`` the query head.
So every implementation, tile size, Dask chunking, backend, device and dtype draws the same
mask, and the backward pass regenerates it instead of storing it.

The hash uses integer operations whose every value stays below ``2**31``, so it gives the
same bits with 64-bit integers (NumPy, torch, CuPy, Dask, array-api-strict) and with 32-bit
ones (JAX without x64), where products are formed from 15-bit limbs (:func:`_mul`):

* ``mix(x)``, on 31-bit ``x``: ``x ^= x >> 16; x = x * C1 mod 2**31; x ^= x >> 15;
  x = x * C2 mod 2**31; x ^= x >> 16`` (a bijection of ``[0, 2**31)``: xorshifts and odd
  multipliers, the shape of the "lowbias32" integer hash);
* a key per batch element and head: ``key = mix(mix(s ^ b) ^ h)`` with ``s = mix(mix(seed_hi)
  ^ seed_lo)`` from the seed's two 31-bit halves (``seed mod 2**62``), computed on the
  host;
* a row hash ``r_i = mix(key ^ i)``, a column hash ``c_j = mix(mix(key ^ C3) ^ j)``, and per
  weight ``x = r_i ^ c_j; x = x * C1 mod 2**31; x ^= x >> 15; x = x * C2 mod 2**31``
  (:func:`_finish`, the middle of ``mix``: the weight's decision reads the top bits, which
  the multiplications fill from every bit): two hashes of length ``L`` and ``S`` per tile,
  and eight integer operations per weight;
* the weight is kept iff ``x >= floor(dropout_p * 2**31)``, so it is kept with probability
  ``1 - floor(dropout_p * 2**31) / 2**31``; a kept weight is multiplied by
  ``1 / (1 - dropout_p)``.

On NumPy the per-weight half runs in ``int32`` (NumPy's products wrap modulo ``2**32``, whose
low 31 bits are the products modulo ``2**31``), and the forward kernels' tiles are masked in
place chunk by chunk (:func:`_numpy_keep_chunks`): the same bits at half the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays import inplace
from .._arrays.slicing import at_batch
from .._arrays.typing import Array

__all__ = ["Dropout", "keep_mask", "keep_tile", "key_grid", "threshold"]

MASK31 = 2**31 - 1
C1 = 0x2D51_8E4B  # odd, < 2**31
C2 = 0x4B5A_D1E3  # odd, < 2**31
C3 = 0x5BD1_E995 & MASK31

#: Integers per step of :func:`keep_tile` (512 KiB in int64).
CHUNK = 2**16


def _mix_int(x: int) -> int:
    """:func:`_mix` on a Python int (the host half of the hash)."""
    x &= MASK31
    x ^= x >> 16
    x = (x * C1) & MASK31
    x ^= x >> 15
    x = (x * C2) & MASK31
    x ^= x >> 16
    return x


def seed_word(seed: int) -> int:
    """The 31-bit word of ``seed`` (any int, taken modulo ``2**62``)."""
    seed %= 2**62
    return _mix_int(_mix_int(seed >> 31) ^ (seed & MASK31))


def threshold(dropout_p: float) -> int:
    """Hashes below this are dropped: ``floor(dropout_p * 2**31)``."""
    return math.floor(dropout_p * 2**31)


def _wide(xp: ModuleType) -> bool:
    """Whether the namespace's default integers have 64 bits (else 31-bit products by limbs)."""
    info = getattr(xp, "__array_namespace_info__", None)
    if info is None:
        return True
    return bool(xp.iinfo(info().default_dtypes()["integral"]).bits >= 64)


def _int_dtype(xp: ModuleType) -> Any:
    return xp.int64 if _wide(xp) else xp.int32


def _mul(xp: ModuleType, x: Array, c: int, wide: bool) -> Array:
    """``x * c mod 2**31`` for ``0 <= x, c < 2**31``, with every value below ``2**31`` or 2**62.

    With 32-bit integers: ``x = xh 2**15 + xl`` and ``c = ch 2**15 + cl`` (``xl, cl < 2**15``,
    ``xh, ch < 2**16``), so ``x c mod 2**31 = xl cl + 2**15 (xh cl + xl ch mod 2**16)
    + 2**30 xh ch mod 2**31``, each product below ``2**31``.
    """
    if wide:
        return (x * c) & MASK31
    ch, cl = c >> 15, c & 0x7FFF
    xh, xl = x >> 15, x & 0x7FFF
    low = xl * cl
    mid = ((xh * cl) & 0xFFFF) + ((xl * ch) & 0xFFFF) + (low >> 15)
    if ch & 1:  # the 2**30 xh ch term, modulo 2**31
        mid = mid + ((xh & 1) << 15)
    return ((mid & 0xFFFF) << 15) | (low & 0x7FFF)


def _mix(xp: ModuleType, x: Array, wide: bool) -> Array:
    x = x ^ (x >> 16)
    x = _mul(xp, x, C1, wide)
    x = x ^ (x >> 15)
    x = _mul(xp, x, C2, wide)
    return x ^ (x >> 16)


def seed_word_array(xp: ModuleType, seed: Array) -> Array:
    """:func:`seed_word` of a 0-d integer array, with the library's integer operations (the
    same bits as the int, for every value of its dtype).

    ``seed mod 2**62`` is split into its 31-bit halves: the low half is the seed's low 31
    bits (two's complement), the high half ``(seed mod 2**62) >> 31`` (for a 32-bit seed:
    0, or ``2**31 - 1`` when it is negative).
    """
    wide = _wide(xp)
    if wide:  # 64-bit values wrap modulo 2**64, a multiple of 2**62
        seed = xp.astype(seed, xp.int64)
        high, low = (seed % 2**62) >> 31, seed & MASK31
    elif xp.isdtype(seed.dtype, "unsigned integer"):  # below 2**32: the high half is 0 or 1
        high, low = (xp.astype(seed >> 31, xp.int32), xp.astype(seed & MASK31, xp.int32))
    else:
        seed = xp.astype(seed, xp.int32)
        minus = xp.asarray(MASK31, dtype=xp.int32)
        high, low = xp.where(seed < 0, minus, xp.zeros_like(seed)), seed & MASK31
    return _mix(xp, _mix(xp, high, wide) ^ low, wide)


def key_grid(
    xp: ModuleType,
    seed: int | Array,
    batch_shape: tuple[int, ...],
    device: Any,
    start: int = 0,
) -> Array:
    """The per-(batch element, head) keys, shape ``batch_shape`` (``(..., Hq)``), as ints.

    ``seed`` is an int or a 0-d integer array of ``xp`` (the same keys for the same value).
    ``batch_shape`` may lack the heads axis (2-D inputs: ``()``), which then counts as one
    head; the batch index is flattened over ``batch_shape[:-1]`` in row-major order and
    starts at ``start`` (a slice of a larger batch: the packed layout's sequences).
    """
    wide = _wide(xp)
    dtype = _int_dtype(xp)
    heads = batch_shape[-1] if batch_shape else 1
    outer = batch_shape[:-1]
    n_outer = math.prod(outer)
    if isinstance(seed, int):
        s = xp.asarray(seed_word(seed), dtype=dtype, device=device)
    else:
        s = xp.astype(seed_word_array(xp, seed), dtype)
    b = xp.reshape(xp.arange(start, start + n_outer, dtype=dtype, device=device), (n_outer, 1))
    h = xp.reshape(xp.arange(heads, dtype=dtype, device=device), (1, heads))
    keys = _mix(xp, _mix(xp, s ^ b, wide) ^ h, wide)
    return xp.reshape(keys, batch_shape)


def keep_tile(
    xp: ModuleType, keys: Array, rows: slice, cols: slice, limit: int, device: Any
) -> Array:
    """Boolean keep mask ``(..., rows, cols)`` for keys ``(..., 1, 1)`` and absolute indices.

    The per-weight integers are formed :data:`CHUNK` at a time (whole rows), so that they stay
    in cache: for a 256 x 1024 tile in NumPy this is 4x faster than one pass.
    """
    if _is_numpy(keys):
        n, m = rows.stop - rows.start, cols.stop - cols.start
        out = np.empty((*keys.shape[:-2], n, m), dtype=bool)
        for a, b, keep in _numpy_keep_chunks(keys, rows, cols, limit):
            out[..., a:b, :] = keep
        return out
    wide = _wide(xp)
    dtype = keys.dtype
    j = xp.reshape(xp.arange(cols.start, cols.stop, dtype=dtype, device=device), (1, -1))
    c = _mix(xp, _mix(xp, keys ^ C3, wide) ^ j, wide)
    i = xp.reshape(xp.arange(rows.start, rows.stop, dtype=dtype, device=device), (-1, 1))
    r = _mix(xp, keys ^ i, wide)
    step = _chunk_rows(keys, cols)
    n = rows.stop - rows.start
    parts = [
        _finish(xp, r[..., a : min(a + step, n), :] ^ c, wide) >= limit for a in range(0, n, step)
    ]
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-2)


def _chunk_rows(keys: Array, cols: slice) -> int:
    """Rows per step of :data:`CHUNK` integers."""
    per_row = max(1, math.prod(keys.shape[:-2]) * (cols.stop - cols.start))
    return max(1, CHUNK // int(per_row))


def _is_numpy(keys: Array) -> bool:
    """Whether ``keys`` (and so the tiles) are NumPy arrays: the 32-bit wrapping path."""
    return type(keys) is np.ndarray


def _numpy_keep_chunks(
    keys: Array, rows: slice, cols: slice, limit: int
) -> Iterator[tuple[int, int, Any]]:
    """``(a, b, keep)``: the keep mask of rows ``a:b`` (relative) of the tile, in NumPy.

    The same bits as the portable path, in ``int32``: NumPy's integer products wrap modulo
    ``2**32``, and ``x * C mod 2**31`` is their low 31 bits (``& MASK31``), so no limbs and no
    64-bit integers are needed. Half the bytes of ``int64`` per weight, no ``concat``: about
    2x faster on a 256 x 1024 tile.
    """
    i = np.arange(rows.start, rows.stop, dtype=keys.dtype)[:, None]
    j = np.arange(cols.start, cols.stop, dtype=keys.dtype)
    r = _mix(np, keys ^ i, True).astype(np.int32)  # (..., n, 1)
    c = _mix(np, _mix(np, keys ^ C3, True) ^ j, True).astype(np.int32)  # (..., 1, m)
    step = _chunk_rows(keys, cols)
    n = rows.stop - rows.start
    for a in range(0, n, step):
        b = min(a + step, n)
        x = r[..., a:b, :] ^ c
        x *= C1
        x &= MASK31
        x ^= x >> 15
        x *= C2
        x &= MASK31
        yield a, b, x >= limit


def _finish(xp: ModuleType, x: Array, wide: bool) -> Array:
    """The per-weight half of the hash: multiply, xorshift, multiply (mod ``2**31``).

    ``x`` is a fresh array of the caller's: with 64-bit integers it is updated in place
    where the library allows it (immutable JAX and Dask arrays rebind), which saves a
    temporary of the tile's size per step.
    """
    if not wide:
        x = _mul(xp, x, C1, wide)
        x = x ^ (x >> 15)
        return _mul(xp, x, C2, wide)
    x *= C1
    x &= MASK31
    x ^= x >> 15
    x *= C2
    x &= MASK31
    return x


@dataclass(frozen=True)
class Dropout:
    """Dropout of one call in the kernel layout.

    Attributes
    ----------
    p : float
        Probability of dropping a weight (``0 < p < 1``).
    keys : array
        Per (batch element, head) keys ``(..., 1, 1)`` (integers) in the kernel layout.
    """

    p: float
    keys: Array

    @property
    def limit(self) -> int:
        return threshold(self.p)

    @property
    def factor(self) -> float:
        """The multiplier ``1 / (1 - p)`` of kept weights."""
        return 1.0 / (1.0 - self.p)

    def at(self, index: tuple[int, ...]) -> Dropout:
        return self if not index else Dropout(self.p, at_batch(self.keys, index))

    def keep(self, xp: ModuleType, rows: slice, cols: slice, device: Any) -> Array:
        """The keep mask ``(..., rows, cols)`` of a tile, from its absolute indices."""
        return keep_tile(xp, self.keys, rows, cols, self.limit, device)

    def apply(
        self, xp: ModuleType, x: Array, keep: Array, *, scaled: bool = True, own: bool = False
    ) -> Array:
        """``x`` (a tile of weights or their cotangents) with dropped entries zeroed and kept
        ones multiplied by ``1 / (1 - p)`` (``scaled=False``: left for the caller to apply
        to a smaller array). ``own``: ``x`` is the caller's own array, which may be
        overwritten.

        A product with the mask as 0/1 (``where`` with a scalar costs 20x more in NumPy);
        weights and their cotangents are finite, so no ``0 * inf`` arises.
        """
        factor = xp.astype(keep, x.dtype)
        if scaled:
            factor *= self.factor
        return inplace.multiply(x, factor) if own else x * factor

    def tile(
        self, xp: ModuleType, x: Array, rows: slice, cols: slice, device: Any, *, scaled: bool
    ) -> Array:
        """:meth:`apply` to the caller's own ``x`` with the keep mask of the tile.

        A writable NumPy ``x`` whose shape holds the mask's is masked in place chunk by chunk
        as the hash forms each chunk's mask (:func:`_numpy_keep_chunks`): no tile-sized mask,
        cast or temporary product.
        """
        if _is_numpy(self.keys) and _is_numpy(x) and inplace._in_place(x, self.keys):
            for a, b, keep in _numpy_keep_chunks(self.keys, rows, cols, self.limit):
                part = x[..., a:b, :]
                part *= keep
            if scaled:
                x *= self.factor
            return x
        return self.apply(xp, x, self.keep(xp, rows, cols, device), scaled=scaled, own=True)


def keep_mask(
    xp: ModuleType, seed: int | Array, shape: tuple[int, ...], p: float, device: Any
) -> Array:
    """The keep mask of attention dropout for a full ``(..., Hq, L, S)`` grid of a
    validated call (:func:`sdpa_array.dropout_keep_mask` checks the arguments): ``True``
    where the weight is kept."""
    L, S = shape[-2:]
    keys = key_grid(xp, seed, shape[:-2], device)[..., None, None]
    keep = keep_tile(xp, keys, slice(0, L), slice(0, S), threshold(p), device)
    return xp.broadcast_to(keep, shape)
