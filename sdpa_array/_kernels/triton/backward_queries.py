"""The backward pass's query-side kernel: :func:`dq_kernel`, which also writes the bias's
gradient (see :mod:`.backward`)."""

from __future__ import annotations

from ._lang import jit, tl
from .backward import load_rows, row_values
from .device import (
    LOG2E,
    column_key,
    data_mask,
    keep_mask,
    key_span,
    matmul,
    mix,
    row_hashes,
    scores,
    sequence_ends,
)

__all__ = ["dq_kernel"]


@jit
def _queries_tile(
    dq,
    count,
    q,
    do,
    lse2,
    delta,
    n0,
    qi,
    rows_ok,
    q_end,
    k_end,
    off,
    left,
    upper,
    S,
    k_ptrs,
    v_ptrs,
    sk_n,
    sv_n,
    e_ok,
    ev_ok,
    qk_scale,
    cap_scale,
    cap_log2,
    bias_ptrs,
    sb_n,
    dbias_ptrs,
    sdb_n,
    mask_ptrs,
    sm_n,
    q_seg,
    kseg_ptrs,
    sks_n,
    row_hash,
    col_key,
    drop_limit,
    drop_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_E: tl.constexpr,
    EVEN_EV: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DATA_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    COUNT: tl.constexpr,
):
    """One key block ``[n0, n0 + BLOCK_N)`` of a query block's ``dQ`` (and ``dZ`` into
    ``dbias_ptrs`` when there is a bias); returns the updated ``(dq, count)``."""
    cols = n0 + tl.arange(0, BLOCK_N)
    kj = cols[None, :]
    cols_ok = kj < S
    k = load_rows(k_ptrs, n0, sk_n, cols[:, None], S, e_ok, MASKED, EVEN_E)
    v = load_rows(v_ptrs, n0, sv_n, cols[:, None], S, ev_ok, MASKED, EVEN_EV)
    if DATA_MASK:
        k_seg = tl.load(kseg_ptrs + cols * sks_n, mask=cols < S, other=0)[None, :]
        allowed = data_mask(
            qi, kj, mask_ptrs + n0 * sm_n, rows_ok & cols_ok, q_seg, k_seg,
            HAS_MASK, HAS_SEG,
        )  # fmt: skip
        run = tl.max(allowed.to(tl.int32)) > 0
    else:
        allowed = cols_ok
        run = True
    if run:
        qk = matmul(q, tl.trans(k), None, IEEE)
        t, factor = scores(
            qk, qi, kj, q_end, k_end, off, left, upper, qk_scale, cap_scale,
            cap_log2, bias_ptrs + n0 * sb_n, rows_ok & cols_ok, allowed,
            MASKED, HAS_LEFT, HAS_UPPER, HAS_BIAS, SOFTCAP, DATA_MASK,
        )  # fmt: skip
        p = tl.exp2(t - lse2[:, None])
        dp = matmul(do, tl.trans(v), None, IEEE)
        if HAS_DROPOUT:
            col_hash = mix(col_key ^ cols.to(tl.uint32))
            keep = keep_mask(row_hash[:, None], col_hash[None, :], drop_limit)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_BIAS:
            tl.store(dbias_ptrs + n0 * sdb_n, ds, mask=rows_ok & cols_ok)
        if SOFTCAP:
            ds = ds * factor
        dq = matmul(ds.to(k.dtype), k, dq, IEEE)
        if COUNT:
            count += 1
    return dq, count


@jit
def dq_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DQ,
    DBias,
    Bias,
    Mask,
    QLen,
    KLen,
    QSeg,
    KSeg,
    DropKeys,
    Scale,
    Count,
    sq_z,
    sq_h,
    sq_m,
    sq_e,
    sk_z,
    sk_h,
    sk_n,
    sk_e,
    sv_z,
    sv_h,
    sv_n,
    sv_e,
    sd_z,
    sd_h,
    sd_m,
    sd_e,
    sl_z,
    sl_h,
    sl_m,
    sD_z,
    sD_h,
    sD_m,
    sdq_z,
    sdq_h,
    sdq_m,
    sdq_e,
    sdb_z,
    sdb_h,
    sdb_m,
    sdb_n,
    sb_z,
    sb_h,
    sb_m,
    sb_n,
    sm_z,
    sm_h,
    sm_m,
    sm_n,
    sqs_z,
    sqs_m,
    sks_z,
    sks_n,
    H,
    G,
    L,
    S,
    E,
    EV,
    scale,
    softcap,
    offset,
    left,
    upper,
    drop_limit,
    drop_scale,
    L_BUCKET,
    S_BUCKET,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_EV: tl.constexpr,
    EVEN_E: tl.constexpr,
    EVEN_EV: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    SHIFTED: tl.constexpr,
    HAS_QLEN: tl.constexpr,
    HAS_KLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DATA_MASK: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    IEEE: tl.constexpr,
    COUNT: tl.constexpr,
):
    """``dQ`` ``(Z, H, L, E)`` and, with a bias, ``dZ`` into ``DBias`` ``(Z, H, L, S)``
    (float32; the caller zeroes it, the tiles no query reaches stay zero); one program per
    (query block, batch element and head), visiting key blocks as the forward does."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(L, BLOCK_M)
    zh = pid // n_m
    m_block = n_m - 1 - (pid - zh * n_m)
    z = zh // H
    h = zh - z * H
    z64 = z.to(tl.int64)
    h64 = h.to(tl.int64)
    kv64 = (h // G).to(tl.int64)
    m0 = m_block * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    qi = rows[:, None]
    rows_ok = qi < L
    e_ok = offs_e[None, :] < E
    ev_ok = offs_ev[None, :] < EV

    q_end, k_end, off = sequence_ends(z, QLen, KLen, L, S, offset, HAS_QLEN, HAS_KLEN, SHIFTED)
    row_end = tl.minimum(m0 + BLOCK_M, q_end)
    start, full_start, full_stop, stop = key_span(
        m0, row_end, k_end, off, left, upper, BLOCK_N, HAS_LEFT, HAS_UPPER
    )

    q = tl.load(
        Q + z64 * sq_z + h64 * sq_h + qi * sq_m + offs_e[None, :] * sq_e,
        mask=rows_ok & e_ok,
        other=0.0,
    )
    do = tl.load(
        DO + z64 * sd_z + h64 * sd_h + qi * sd_m + offs_ev[None, :] * sd_e,
        mask=rows_ok & ev_ok,
        other=0.0,
    )
    lse2, delta = row_values(
        Lse + z64 * sl_z + h64 * sl_h + rows * sl_m, 0, 0, rows, L, q_end,
        Delta + z64 * sD_z + h64 * sD_h + rows * sD_m, 0, True,
    )  # fmt: skip
    k_ptrs = K + z64 * sk_z + kv64 * sk_h + offs_n[:, None] * sk_n + offs_e[None, :] * sk_e
    v_ptrs = V + z64 * sv_z + kv64 * sv_h + offs_n[:, None] * sv_n + offs_ev[None, :] * sv_e
    bias_ptrs = Bias + z64 * sb_z + h64 * sb_h + qi * sb_m + offs_n[None, :] * sb_n
    dbias_ptrs = DBias + z64 * sdb_z + h64 * sdb_h + qi * sdb_m + offs_n[None, :] * sdb_n
    mask_ptrs = Mask + z64 * sm_z + h64 * sm_h + qi * sm_m + offs_n[None, :] * sm_n
    kseg_ptrs = KSeg + z64 * sks_z
    q_seg = qi
    if HAS_SEG:
        q_seg = tl.load(QSeg + z64 * sqs_z + rows * sqs_m, mask=rows < L, other=0)[:, None]
    row_hash = rows.to(tl.uint32)
    col_key = offs_n.to(tl.uint32)
    if HAS_DROPOUT:
        key = tl.load(DropKeys + zh).to(tl.uint32)
        row_hash = row_hashes(key, rows)
        col_key = column_key(key, BLOCK_N)
    sc = scale
    if SCALE_PTR:
        sc = tl.load(Scale).to(tl.float32)
    qk_scale = sc * LOG2E
    cap_scale = sc / softcap
    cap_log2 = softcap * LOG2E

    dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    count = 0 * pid
    for n0 in range(start, full_start, BLOCK_N):
        dq, count = _queries_tile(
            dq, count, q, do, lse2, delta, n0, qi, rows_ok, q_end, k_end, off, left, upper,
            S, k_ptrs, v_ptrs, sk_n, sv_n, e_ok, ev_ok, qk_scale, cap_scale, cap_log2,
            bias_ptrs, sb_n, dbias_ptrs, sdb_n, mask_ptrs, sm_n, q_seg, kseg_ptrs, sks_n,
            row_hash, col_key, drop_limit, drop_scale, BLOCK_N, True, EVEN_E, EVEN_EV,
            HAS_LEFT, HAS_UPPER, HAS_BIAS, HAS_MASK, HAS_SEG, DATA_MASK, HAS_DROPOUT, SOFTCAP,
            IEEE, COUNT,
        )  # fmt: skip
    for n0 in range(full_start, full_stop, BLOCK_N):
        dq, count = _queries_tile(
            dq, count, q, do, lse2, delta, n0, qi, rows_ok, q_end, k_end, off, left, upper,
            S, k_ptrs, v_ptrs, sk_n, sv_n, e_ok, ev_ok, qk_scale, cap_scale, cap_log2,
            bias_ptrs, sb_n, dbias_ptrs, sdb_n, mask_ptrs, sm_n, q_seg, kseg_ptrs, sks_n,
            row_hash, col_key, drop_limit, drop_scale, BLOCK_N, False, EVEN_E, EVEN_EV,
            HAS_LEFT, HAS_UPPER, HAS_BIAS, HAS_MASK, HAS_SEG, DATA_MASK, HAS_DROPOUT, SOFTCAP,
            IEEE, COUNT,
        )  # fmt: skip
    for n0 in range(full_stop, stop, BLOCK_N):
        dq, count = _queries_tile(
            dq, count, q, do, lse2, delta, n0, qi, rows_ok, q_end, k_end, off, left, upper,
            S, k_ptrs, v_ptrs, sk_n, sv_n, e_ok, ev_ok, qk_scale, cap_scale, cap_log2,
            bias_ptrs, sb_n, dbias_ptrs, sdb_n, mask_ptrs, sm_n, q_seg, kseg_ptrs, sks_n,
            row_hash, col_key, drop_limit, drop_scale, BLOCK_N, True, EVEN_E, EVEN_EV,
            HAS_LEFT, HAS_UPPER, HAS_BIAS, HAS_MASK, HAS_SEG, DATA_MASK, HAS_DROPOUT, SOFTCAP,
            IEEE, COUNT,
        )  # fmt: skip

    dq = dq * sc
    tl.store(
        DQ + z64 * sdq_z + h64 * sdq_h + qi * sdq_m + offs_e[None, :] * sdq_e,
        dq.to(DQ.dtype.element_ty),
        mask=rows_ok & e_ok,
    )
    if COUNT:
        tl.store(Count + pid, count)
