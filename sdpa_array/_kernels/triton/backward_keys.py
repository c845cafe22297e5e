"""The backward pass's key-side kernel: :func:`dkdv_kernel` (see :mod:`.backward`)."""

from __future__ import annotations

from ._lang import jit, tl
from .backward import load_rows, row_values
from .device import (
    LOG2E,
    column_key,
    data_mask,
    keep_mask,
    matmul,
    mix,
    query_span,
    row_hashes,
    scores,
    sequence_ends,
)

__all__ = ["dkdv_kernel"]


@jit
def _keys_tile(
    dk,
    dv,
    count,
    k,
    v,
    m0,
    kj,
    cols_ok,
    q_end,
    k_end,
    off,
    left,
    upper,
    L,
    q_ptrs,
    do_ptrs,
    lse_ptrs,
    delta_ptrs,
    sq_m,
    sd_m,
    sl_m,
    sD_m,
    e_ok,
    ev_ok,
    qk_scale,
    cap_scale,
    cap_log2,
    bias_ptrs,
    sb_m,
    mask_ptrs,
    sm_m,
    qseg_ptrs,
    sqs_m,
    k_seg,
    drop_key,
    col_hash,
    drop_limit,
    drop_scale,
    BLOCK_M: tl.constexpr,
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
    """One query block ``[m0, m0 + BLOCK_M)`` of a key block's ``dK``, ``dV`` (keys on rows,
    queries on columns); returns the updated ``(dk, dv, count)``."""
    rows = m0 + tl.arange(0, BLOCK_M)
    qi = rows[None, :]
    rows_ok = qi < L
    q = load_rows(q_ptrs, m0, sq_m, rows[:, None], L, e_ok, MASKED, EVEN_E)
    do = load_rows(do_ptrs, m0, sd_m, rows[:, None], L, ev_ok, MASKED, EVEN_EV)
    lse2, delta = row_values(lse_ptrs, m0, sl_m, rows, L, q_end, delta_ptrs, sD_m, MASKED)
    if DATA_MASK:
        q_seg = tl.load(qseg_ptrs + rows * sqs_m, mask=rows < L, other=0)[None, :]
        allowed = data_mask(
            qi, kj, mask_ptrs + m0 * sm_m, rows_ok & cols_ok, q_seg, k_seg,
            HAS_MASK, HAS_SEG,
        )  # fmt: skip
        run = tl.max(allowed.to(tl.int32)) > 0
    else:
        allowed = rows_ok
        run = True
    if run:
        qk = matmul(k, tl.trans(q), None, IEEE)
        t, factor = scores(
            qk, qi, kj, q_end, k_end, off, left, upper, qk_scale, cap_scale,
            cap_log2, bias_ptrs + m0 * sb_m, rows_ok & cols_ok, allowed,
            MASKED, HAS_LEFT, HAS_UPPER, HAS_BIAS, SOFTCAP, DATA_MASK,
        )  # fmt: skip
        p = tl.exp2(t - lse2[None, :])
        dp = matmul(v, tl.trans(do), None, IEEE)
        if HAS_DROPOUT:
            keep = keep_mask(col_hash[:, None], row_hashes(drop_key, rows)[None, :], drop_limit)
            p_kept = tl.where(keep, p * drop_scale, 0.0)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        else:
            p_kept = p
        dv = matmul(p_kept.to(do.dtype), do, dv, IEEE)
        ds = p * (dp - delta[None, :])
        if SOFTCAP:
            ds = ds * factor
        dk = matmul(ds.to(q.dtype), q, dk, IEEE)
        if COUNT:
            count += 1
    return dk, dv, count


@jit
def dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
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
    sdk_z,
    sdk_h,
    sdk_n,
    sdk_e,
    sdv_z,
    sdv_h,
    sdv_n,
    sdv_e,
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
    HK,
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
    """``dK`` ``(Z, HK, S, E)`` and ``dV`` ``(Z, HK, S, EV)`` (float32 accumulation, summed
    over the ``G`` query heads of each key/value head); operands as in
    :func:`~.forward.forward_kernel`, plus ``DO`` ``(Z, H, L, EV)``, the forward's ``Lse``
    and ``Delta`` ``(Z, H, L)``. One program per (key block, batch element and key/value
    head)."""
    pid = tl.program_id(0)
    n_n = tl.cdiv(S, BLOCK_N)
    zk = pid // n_n
    n0 = (pid - zk * n_n) * BLOCK_N
    z = zk // HK
    kvh = zk - z * HK
    z64 = z.to(tl.int64)
    kv64 = kvh.to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    kj = cols[:, None]
    cols_ok = kj < S
    e_ok = offs_e[None, :] < E
    ev_ok = offs_ev[None, :] < EV

    q_end, k_end, off = sequence_ends(z, QLen, KLen, L, S, offset, HAS_QLEN, HAS_KLEN, SHIFTED)
    key_stop = tl.minimum(n0 + BLOCK_N, k_end)
    start, full_start, full_stop, stop = query_span(
        n0, key_stop, q_end, off, left, upper, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_UPPER
    )

    k = tl.load(
        K + z64 * sk_z + kv64 * sk_h + kj * sk_n + offs_e[None, :] * sk_e,
        mask=cols_ok & e_ok,
        other=0.0,
    )
    v = tl.load(
        V + z64 * sv_z + kv64 * sv_h + kj * sv_n + offs_ev[None, :] * sv_e,
        mask=cols_ok & ev_ok,
        other=0.0,
    )
    k_seg = kj
    if HAS_SEG:
        k_seg = tl.load(KSeg + z64 * sks_z + cols * sks_n, mask=cols < S, other=0)[:, None]
    sc = scale
    if SCALE_PTR:
        sc = tl.load(Scale).to(tl.float32)
    qk_scale = sc * LOG2E
    cap_scale = sc / softcap
    cap_log2 = softcap * LOG2E

    dk = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_EV], dtype=tl.float32)
    count = 0 * pid
    for g in range(G):
        h64 = (kvh * G + g).to(tl.int64)
        q_ptrs = Q + z64 * sq_z + h64 * sq_h + offs_m[:, None] * sq_m + offs_e[None, :] * sq_e
        do_ptrs = DO + z64 * sd_z + h64 * sd_h + offs_m[:, None] * sd_m + offs_ev[None, :] * sd_e
        lse_ptrs = Lse + z64 * sl_z + h64 * sl_h + offs_m * sl_m
        delta_ptrs = Delta + z64 * sD_z + h64 * sD_h + offs_m * sD_m
        bias_ptrs = Bias + z64 * sb_z + h64 * sb_h + offs_m[None, :] * sb_m + kj * sb_n
        mask_ptrs = Mask + z64 * sm_z + h64 * sm_h + offs_m[None, :] * sm_m + kj * sm_n
        qseg_ptrs = QSeg + z64 * sqs_z
        drop_key = (0 * pid).to(tl.uint32)
        col_hash = cols.to(tl.uint32)
        if HAS_DROPOUT:
            drop_key = tl.load(DropKeys + z64 * H + h64).to(tl.uint32)
            col_hash = mix(column_key(drop_key, BLOCK_N) ^ cols.to(tl.uint32))
        # the query blocks before the band's full part, the full ones, those after it
        for m0 in range(start, full_start, BLOCK_M):
            dk, dv, count = _keys_tile(
                dk, dv, count, k, v, m0, kj, cols_ok, q_end, k_end, off, left, upper, L,
                q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, sq_m, sd_m, sl_m, sD_m, e_ok, ev_ok,
                qk_scale, cap_scale, cap_log2, bias_ptrs, sb_m, mask_ptrs, sm_m, qseg_ptrs,
                sqs_m, k_seg, drop_key, col_hash, drop_limit, drop_scale, BLOCK_M, True,
                EVEN_E, EVEN_EV, HAS_LEFT, HAS_UPPER, HAS_BIAS, HAS_MASK, HAS_SEG,
                DATA_MASK, HAS_DROPOUT, SOFTCAP, IEEE, COUNT,
            )  # fmt: skip
        for m0 in range(full_start, full_stop, BLOCK_M):
            dk, dv, count = _keys_tile(
                dk, dv, count, k, v, m0, kj, cols_ok, q_end, k_end, off, left, upper, L,
                q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, sq_m, sd_m, sl_m, sD_m, e_ok, ev_ok,
                qk_scale, cap_scale, cap_log2, bias_ptrs, sb_m, mask_ptrs, sm_m, qseg_ptrs,
                sqs_m, k_seg, drop_key, col_hash, drop_limit, drop_scale, BLOCK_M, False,
                EVEN_E, EVEN_EV, HAS_LEFT, HAS_UPPER, HAS_BIAS, HAS_MASK, HAS_SEG,
                DATA_MASK, HAS_DROPOUT, SOFTCAP, IEEE, COUNT,
            )  # fmt: skip
        for m0 in range(full_stop, stop, BLOCK_M):
            dk, dv, count = _keys_tile(
                dk, dv, count, k, v, m0, kj, cols_ok, q_end, k_end, off, left, upper, L,
                q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, sq_m, sd_m, sl_m, sD_m, e_ok, ev_ok,
                qk_scale, cap_scale, cap_log2, bias_ptrs, sb_m, mask_ptrs, sm_m, qseg_ptrs,
                sqs_m, k_seg, drop_key, col_hash, drop_limit, drop_scale, BLOCK_M, True,
                EVEN_E, EVEN_EV, HAS_LEFT, HAS_UPPER, HAS_BIAS, HAS_MASK, HAS_SEG,
                DATA_MASK, HAS_DROPOUT, SOFTCAP, IEEE, COUNT,
            )  # fmt: skip

    dk = dk * sc
    tl.store(
        DK + z64 * sdk_z + kv64 * sdk_h + kj * sdk_n + offs_e[None, :] * sdk_e,
        dk.to(DK.dtype.element_ty),
        mask=cols_ok & e_ok,
    )
    tl.store(
        DV + z64 * sdv_z + kv64 * sdv_h + kj * sdv_n + offs_ev[None, :] * sdv_e,
        dv.to(DV.dtype.element_ty),
        mask=cols_ok & ev_ok,
    )
    if COUNT:
        tl.store(Count + pid, count)
