"""Device functions shared by the forward and backward kernels (inlined by triton).

Everything here works on one tile, or on the scalars of one program: the bit-exact dropout
hash of :mod:`sdpa_array._kernels.dropout`, the per-sequence ends and diagonal offset, the
key blocks a query block reaches (and the query blocks a key block is reached by), and the
final scores of a tile in base 2 (``log2(e) * score``, so that ``exp2`` computes ``exp``).

Tiles are oriented either way: the forward and ``dQ`` kernels hold queries on rows, the
``dK``/``dV`` kernel holds keys on rows. The index arguments ``qi`` (query positions) and
``kj`` (key positions) are broadcastable 2-D tensors of either orientation, and the masks
are written element-wise in them, so the same functions serve both.
"""

from __future__ import annotations

from ..dropout import C1 as _C1
from ..dropout import C2 as _C2
from ..dropout import C3 as _C3
from ..dropout import MASK31 as _MASK31
from ._lang import constant, jit, tl

#: ``log2(e)``: scores times it are exponentiated with ``exp2``.
LOG2E = constant(1.4426950408889634)
#: ``ln(2)``: a base-2 log-sum-exp times it is the natural one.
LN2 = constant(0.6931471805599453)
#: The dropout hash's constants (:mod:`sdpa_array._kernels.dropout`).
MASK31 = constant(_MASK31)
C1 = constant(_C1)
C2 = constant(_C2)
C3 = constant(_C3)


@jit
def matmul(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` in float32 (``acc``: a float32 tile or ``None``); ``IEEE``: float32
    operands are multiplied exactly (a GPU would otherwise round them to TF32)."""
    return tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)


@jit
def tanh(x):
    """``tanh(x)`` from ``exp2(-2 log2(e) |x|)``, which never overflows."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@jit
def mix(x):
    """The dropout hash's ``mix`` on 31-bit values in uint32 lanes.

    Products wrap modulo ``2**32``; masking with ``2**31 - 1`` leaves them modulo ``2**31``
    as in :func:`sdpa_array._kernels.dropout._mix`, and every shifted value is below
    ``2**31``, so signedness never matters.
    """
    x = x ^ (x >> 16)
    x = (x * C1) & MASK31
    x = x ^ (x >> 15)
    x = (x * C2) & MASK31
    return x ^ (x >> 16)


@jit
def row_hashes(key, rows):
    """``mix(key ^ i)`` for the query positions ``rows`` (a vector)."""
    return mix(key ^ rows.to(tl.uint32))


@jit
def column_key(key, BLOCK: tl.constexpr):
    """``mix(key ^ C3)`` as a vector of ``BLOCK`` lanes (kept out of scalar arithmetic)."""
    return mix((tl.zeros([BLOCK], dtype=tl.uint32) + key) ^ C3)


@jit
def keep_mask(r, c, limit):
    """Whether each weight is kept, from row hashes ``r`` and column hashes ``c``
    (broadcastable): ``x = r ^ c``, multiply, xorshift, multiply, ``x >= limit``."""
    x = r ^ c
    x = (x * C1) & MASK31
    x = x ^ (x >> 15)
    x = (x * C2) & MASK31
    return x >= limit


@jit
def sequence_ends(
    z,
    QLen,
    KLen,
    L,
    S,
    offset,
    HAS_QLEN: tl.constexpr,
    HAS_KLEN: tl.constexpr,
    SHIFTED: tl.constexpr,
):
    """``(q_end, k_end, off)`` of sequence ``z``: its valid queries ``[0, q_end)``, keys
    ``[0, k_end)`` and the key index of query 0's diagonal (``SHIFTED``: bottom-right
    alignment with lengths, ``k_end - q_end``)."""
    q_end = L + 0 * z
    k_end = S + 0 * z
    if HAS_QLEN:
        q_end = tl.load(QLen + z)
    if HAS_KLEN:
        k_end = tl.load(KLen + z)
    off = offset + 0 * z
    if SHIFTED:
        off = k_end - q_end
    return q_end, k_end, off


@jit
def key_span(
    m0,
    row_end,
    k_end,
    off,
    left,
    upper,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
):
    """Key blocks that the queries ``[m0, row_end)`` reach: ``(start, full_start, full_stop,
    stop)``.

    Keys ``[start, stop)`` hold every admissible key of the rows (``start`` rounded down to
    a block); the blocks ``[full_start, full_stop)`` are admissible for every row, so they
    need no positional mask. Without such blocks ``full_start == full_stop == start``.
    """
    lo = 0 * k_end
    hi = k_end
    full_lo = lo
    full_hi = hi
    if HAS_LEFT:  # key j >= i + off - left
        lo = tl.maximum(m0 + off - left, 0)
        full_lo = tl.maximum(row_end - 1 + off - left, 0)
    if HAS_UPPER:  # key j <= i + off + upper
        hi = tl.minimum(hi, row_end + off + upper)
        full_hi = tl.minimum(k_end, m0 + off + upper + 1)
    rows = row_end > m0
    hi = tl.where(rows, hi, 0)
    start = (lo // BLOCK_N) * BLOCK_N
    full_start = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    full_stop = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    has_full = rows & (full_stop > full_start)
    full_start = tl.where(has_full, full_start, start)
    full_stop = tl.where(has_full, full_stop, start)
    return start, full_start, full_stop, hi


@jit
def query_span(
    n0,
    key_stop,
    q_end,
    off,
    left,
    upper,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
):
    """Query blocks that reach the keys ``[n0, key_stop)``: ``(start, full_start, full_stop,
    stop)`` as in :func:`key_span`, with queries and keys exchanged.

    A full query block needs the whole key block valid (``key_stop == n0 + BLOCK_N``).
    """
    lo = 0 * q_end
    hi = q_end
    full_lo = lo
    full_hi = hi
    if HAS_UPPER:  # query i >= j - off - upper
        lo = tl.maximum(n0 - off - upper, 0)
        full_lo = tl.maximum(key_stop - 1 - off - upper, 0)
    if HAS_LEFT:  # query i <= j - off + left
        hi = tl.minimum(hi, key_stop - off + left)
        full_hi = tl.minimum(q_end, n0 - off + left + 1)
    keys = key_stop > n0
    hi = tl.where(keys, hi, 0)
    start = (lo // BLOCK_M) * BLOCK_M
    full_start = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    full_stop = (tl.maximum(full_hi, 0) // BLOCK_M) * BLOCK_M
    has_full = keys & (key_stop == n0 + BLOCK_N) & (full_stop > full_start)
    full_start = tl.where(has_full, full_start, start)
    full_stop = tl.where(has_full, full_stop, start)
    return start, full_start, full_stop, hi


@jit
def data_mask(
    qi,
    kj,
    mask_ptrs,
    mask_ok,
    q_seg,
    k_seg,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
):
    """The tile's admissible pairs by data: the dense ``mask`` and equal segment ids
    (``q_seg``, ``k_seg`` broadcastable to the tile); only called when one of them is on."""
    ok = (qi >= 0) & (kj >= 0)
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptrs, mask=mask_ok, other=0) != 0)
    if HAS_SEG:
        ok = ok & (q_seg == k_seg)
    return ok


@jit
def scores(
    qk,
    qi,
    kj,
    q_end,
    k_end,
    off,
    left,
    upper,
    qk_scale,
    cap_scale,
    cap_log2,
    bias_ptrs,
    bias_ok,
    allowed,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DATA_MASK: tl.constexpr,
):
    """Final scores of a tile in base 2 (``-inf`` where excluded), and ``1 - tanh²`` of the
    soft-cap (``1.0`` without one): the derivative of the capped score by the scaled one.

    ``qk`` is ``q kᵀ`` (float32). Without a soft-cap the scores are ``qk * qk_scale`` with
    ``qk_scale = scale * log2(e)``; with one, ``tanh(qk * cap_scale) * cap_log2`` with
    ``cap_scale = scale / softcap`` and ``cap_log2 = softcap * log2(e)``. The bias is added
    (times ``log2(e)``); ``MASKED`` tiles exclude the keys past ``k_end``, the queries past
    ``q_end`` and the pairs outside the band; ``allowed`` (when ``DATA_MASK``) is the data
    mask of :func:`data_mask`.
    """
    if SOFTCAP:
        th = tanh(qk * cap_scale)
        t = th * cap_log2
        factor = 1.0 - th * th
    else:
        t = qk * qk_scale
        factor = 1.0
    if HAS_BIAS:
        t += tl.load(bias_ptrs, mask=bias_ok, other=0.0).to(tl.float32) * LOG2E
    t = restricted(
        t, qi, kj, q_end, k_end, off, left, upper, allowed,
        MASKED, HAS_LEFT, HAS_UPPER, DATA_MASK,
    )  # fmt: skip
    return t, factor


@jit
def restricted(
    t,
    qi,
    kj,
    q_end,
    k_end,
    off,
    left,
    upper,
    allowed,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    DATA_MASK: tl.constexpr,
):
    """``t`` with ``-inf`` at the pairs the restrictions exclude: on ``MASKED`` tiles the
    keys past ``k_end``, the queries past ``q_end`` and the pairs outside the band; the
    data mask ``allowed`` (when ``DATA_MASK``) on every tile."""
    if MASKED:
        ok = (kj < k_end) & (qi < q_end)
        if HAS_UPPER:
            ok = ok & (kj <= qi + off + upper)
        if HAS_LEFT:
            ok = ok & (kj >= qi + off - left)
        if DATA_MASK:
            ok = ok & allowed
        t = tl.where(ok, t, float("-inf"))
    elif DATA_MASK:
        t = tl.where(allowed, t, float("-inf"))
    return t
