"""The oracle's dropout keep mask, written from the specification alone.

Whether weight ``[b, h, i, j]`` is kept depends on ``(seed, b, h, i, j)`` only (``b``: the
flattened index of the batch axes before the heads axis, ``h``: the query head; inputs
without a heads axis count as one head). With ``mix(x)`` the 31-bit integer hash

    ``x ^= x >> 16; x = x * C1 mod 2**31; x ^= x >> 15; x = x * C2 mod 2**31; x ^= x >> 16``

the seed word is ``s = mix(mix(seed_hi) ^ seed_lo)`` (the two 31-bit halves of
``seed mod 2**62``), each (batch element, head) has the key ``mix(mix(s ^ b) ^ h)``, each
row the hash ``r_i = mix(key ^ i)``, each column ``c_j = mix(mix(key ^ C3) ^ j)``, and a
weight is kept iff ``finish(r_i ^ c_j) >= floor(p * 2**31)``, ``finish`` being ``mix``
without its first and last xorshifts.

Every value is held in ``uint64`` and reduced modulo ``2**31`` after each product (the
products of two 31-bit numbers stay below ``2**62``): none of the library's 32-bit limb
arithmetic or in-place chunking is reused here.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["keep_mask"]

_M31 = np.uint64(2**31 - 1)
_C1 = np.uint64(0x2D51_8E4B)
_C2 = np.uint64(0x4B5A_D1E3)
_C3 = np.uint64(0x5BD1_E995 & (2**31 - 1))


def _mulmod(x: np.ndarray, c: np.uint64) -> np.ndarray:
    return np.asarray((x * c) & _M31)


def _finish(x: np.ndarray) -> np.ndarray:
    x = _mulmod(x, _C1)
    x = np.asarray(x ^ (x >> np.uint64(15)))
    return _mulmod(x, _C2)


def _mix(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint64) & _M31
    x = x ^ (x >> np.uint64(16))
    x = _finish(x)
    return np.asarray(x ^ (x >> np.uint64(16)))


def keep_mask(seed: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Boolean keep mask of weights of ``shape`` (``(..., L, S)``) for ``dropout_p = p``."""
    *batch, L, S = shape
    heads = batch[-1] if batch else 1
    outer = math.prod(batch[:-1])
    seed %= 2**62
    s = _mix(_mix(np.uint64(seed >> 31)) ^ np.uint64(seed & (2**31 - 1)))
    b = np.arange(outer, dtype=np.uint64)[:, None]
    h = np.arange(heads, dtype=np.uint64)[None, :]
    key = _mix(_mix(s ^ b) ^ h)[:, :, None, None]  # (outer, heads, 1, 1)
    i = np.arange(L, dtype=np.uint64)[:, None]
    j = np.arange(S, dtype=np.uint64)[None, :]
    rows = _mix(key ^ i)
    cols = _mix(_mix(key ^ _C3) ^ j)
    keep = _finish(rows ^ cols) >= np.uint64(math.floor(p * 2**31))
    return np.asarray(keep.reshape(shape))
