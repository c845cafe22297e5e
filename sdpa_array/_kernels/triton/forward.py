"""The forward kernel: FlashAttention-2's online softmax, one program per query block.

A program holds ``BLOCK_M`` queries of one (batch element, query head) and visits the key
blocks they can reach (:func:`~.device.key_span`): first the blocks before the band's full
part, then the full blocks (every query may attend every key: no positional mask), then the
blocks after it, so that the masks cost only on the band's edges. For each key block it
forms ``q kᵀ`` (float32 accumulation), the final scores in base 2, and updates the running
maximum ``m``, the running sum ``l`` of ``exp2(t - m)`` and the output ``acc``; the
probabilities are rounded to the inputs' dtype before ``P V`` (as FlashAttention does).
Tiles that a dense mask or the segment ids empty are skipped after their mask is formed.

With the maximum scores asked for, each row also keeps the largest ``scale · q·k`` over its
admissible keys (the restrictions applied to the scaled products, before softcap and bias).
Sinks start each row with ``m = sink``, ``l = 1``; dropout zeroes weights after ``l`` has
summed them (the log-sum-exp ignores dropout) and multiplies the output by ``1 / (1 - p)``.
A row with no admissible key gets a zero output and a log-sum-exp of ``-inf`` (the sink
with sinks), never NaN.
"""

from __future__ import annotations

from ._lang import jit, tl
from .device import (
    LN2,
    LOG2E,
    column_key,
    data_mask,
    keep_mask,
    key_span,
    matmul,
    mix,
    restricted,
    row_hashes,
    scores,
    sequence_ends,
)

__all__ = ["forward_kernel"]


@jit
def _forward_tile(
    acc,
    m_i,
    l_i,
    count,
    best,
    q,
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
    mask_ptrs,
    sm_n,
    q_seg,
    kseg_ptrs,
    sks_n,
    row_hash,
    col_key,
    drop_limit,
    sc,
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
    MAX_SCORES: tl.constexpr,
):
    """One key block ``[n0, n0 + BLOCK_N)`` of the online softmax; returns the updated
    ``(acc, m_i, l_i, count, best)``: ``best`` the rows' largest ``sc * q·k`` over their
    admissible keys so far (with ``MAX_SCORES``). ``k_ptrs`` address ``Kᵀ``
    ``(BLOCK_E, BLOCK_N)`` and ``v_ptrs`` ``V`` ``(BLOCK_N, BLOCK_EV)`` at key 0;
    ``MASKED``: a block on the band's edge or past ``S``."""
    cols = n0 + tl.arange(0, BLOCK_N)
    kj = cols[None, :]
    cols_ok = kj < S
    if MASKED:
        k_t = tl.load(k_ptrs + n0 * sk_n, mask=cols_ok & e_ok, other=0.0)
        v = tl.load(v_ptrs + n0 * sv_n, mask=(cols[:, None] < S) & ev_ok, other=0.0)
    else:
        if EVEN_E:
            k_t = tl.load(k_ptrs + n0 * sk_n)
        else:
            k_t = tl.load(k_ptrs + n0 * sk_n, mask=e_ok, other=0.0)
        if EVEN_EV:
            v = tl.load(v_ptrs + n0 * sv_n)
        else:
            v = tl.load(v_ptrs + n0 * sv_n, mask=ev_ok, other=0.0)
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
        qk = matmul(q, k_t, None, IEEE)
        if MAX_SCORES:  # before softcap and bias, over the pairs the restrictions admit
            raw = restricted(
                qk * sc, qi, kj, q_end, k_end, off, left, upper, allowed,
                MASKED, HAS_LEFT, HAS_UPPER, DATA_MASK,
            )  # fmt: skip
            best = tl.maximum(best, tl.max(raw, 1))
        t, _ = scores(
            qk, qi, kj, q_end, k_end, off, left, upper, qk_scale, cap_scale,
            cap_log2, bias_ptrs + n0 * sb_n, rows_ok & cols_ok, allowed,
            MASKED, HAS_LEFT, HAS_UPPER, HAS_BIAS, SOFTCAP, DATA_MASK,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(t - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            col_hash = mix(col_key ^ cols.to(tl.uint32))
            p = tl.where(keep_mask(row_hash[:, None], col_hash[None, :], drop_limit), p, 0.0)
        acc = matmul(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new
        if COUNT:
            count += 1
    return acc, m_i, l_i, count, best


@jit
def forward_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    RowMax,
    Bias,
    Mask,
    Sinks,
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
    so_z,
    so_h,
    so_m,
    so_e,
    sl_z,
    sl_h,
    sl_m,
    sb_z,
    sb_h,
    sb_m,
    sb_n,
    sm_z,
    sm_h,
    sm_m,
    sm_n,
    ss_z,
    ss_h,
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
    HAS_SINKS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    IEEE: tl.constexpr,
    COUNT: tl.constexpr,
    MAX_SCORES: tl.constexpr,
):
    """Output ``(Z, H, L, EV)`` and log-sum-exp ``(Z, H, L)`` of attention, and with
    ``MAX_SCORES`` each row's largest ``scale * q·k`` over its admissible keys into
    ``RowMax`` (``-inf`` without any; laid out as ``Lse``, with its strides).

    Every operand comes as a pointer and its strides over ``(Z, H, rows, columns)`` (zero
    along broadcast axes): ``Q`` ``(Z, H, L, E)``, ``K``/``V`` ``(Z, H // G, S, E|EV)``
    (query head ``h`` reads head ``h // G``), ``Bias``/``Mask`` ``(Z, H, L, S)`` (the mask
    as uint8), ``Sinks`` ``(Z, H)``, ``QSeg``/``KSeg`` ``(Z, L|S)``, ``QLen``/``KLen`` and
    ``DropKeys`` contiguous ``(Z,)`` and ``(Z * H,)`` int32. The ``HAS_*`` flags say which
    are present (the others are never read); ``EVEN_E``/``EVEN_EV``: ``E == BLOCK_E`` and
    ``EV == BLOCK_EV`` (no feature padding to mask). ``L_BUCKET`` and ``S_BUCKET`` only key the
    autotuner's cache. One program per (query block, batch element and head), the last
    query blocks (the most work under a causal mask) first.
    """
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
    e_ok = offs_e[:, None] < E
    ev_ok = offs_ev[None, :] < EV

    q_end, k_end, off = sequence_ends(z, QLen, KLen, L, S, offset, HAS_QLEN, HAS_KLEN, SHIFTED)
    row_end = tl.minimum(m0 + BLOCK_M, q_end)
    start, full_start, full_stop, stop = key_span(
        m0, row_end, k_end, off, left, upper, BLOCK_N, HAS_LEFT, HAS_UPPER
    )

    q_ptrs = Q + z64 * sq_z + h64 * sq_h + qi * sq_m + offs_e[None, :] * sq_e
    q = tl.load(q_ptrs, mask=rows_ok & (offs_e[None, :] < E), other=0.0)
    k_ptrs = K + z64 * sk_z + kv64 * sk_h + offs_n[None, :] * sk_n + offs_e[:, None] * sk_e
    v_ptrs = V + z64 * sv_z + kv64 * sv_h + offs_n[:, None] * sv_n + offs_ev[None, :] * sv_e
    bias_ptrs = Bias + z64 * sb_z + h64 * sb_h + qi * sb_m + offs_n[None, :] * sb_n
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

    acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(Sinks + z64 * ss_z + h64 * ss_h).to(tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink * LOG2E
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    count = 0 * pid
    best = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")

    # the blocks before the band's full part, the full blocks, the blocks after it
    for n0 in range(start, full_start, BLOCK_N):
        acc, m_i, l_i, count, best = _forward_tile(
            acc, m_i, l_i, count, best, q, n0, qi, rows_ok, q_end, k_end, off, left, upper, S,
            k_ptrs, v_ptrs, sk_n, sv_n, e_ok, ev_ok, qk_scale, cap_scale, cap_log2,
            bias_ptrs, sb_n, mask_ptrs, sm_n, q_seg, kseg_ptrs, sks_n, row_hash, col_key,
            drop_limit, sc, BLOCK_N, True, EVEN_E, EVEN_EV, HAS_LEFT, HAS_UPPER,
            HAS_BIAS, HAS_MASK, HAS_SEG, DATA_MASK, HAS_DROPOUT, SOFTCAP, IEEE, COUNT,
            MAX_SCORES,
        )  # fmt: skip
    for n0 in range(full_start, full_stop, BLOCK_N):
        acc, m_i, l_i, count, best = _forward_tile(
            acc, m_i, l_i, count, best, q, n0, qi, rows_ok, q_end, k_end, off, left, upper, S,
            k_ptrs, v_ptrs, sk_n, sv_n, e_ok, ev_ok, qk_scale, cap_scale, cap_log2,
            bias_ptrs, sb_n, mask_ptrs, sm_n, q_seg, kseg_ptrs, sks_n, row_hash, col_key,
            drop_limit, sc, BLOCK_N, False, EVEN_E, EVEN_EV, HAS_LEFT, HAS_UPPER,
            HAS_BIAS, HAS_MASK, HAS_SEG, DATA_MASK, HAS_DROPOUT, SOFTCAP, IEEE, COUNT,
            MAX_SCORES,
        )  # fmt: skip
    for n0 in range(full_stop, stop, BLOCK_N):
        acc, m_i, l_i, count, best = _forward_tile(
            acc, m_i, l_i, count, best, q, n0, qi, rows_ok, q_end, k_end, off, left, upper, S,
            k_ptrs, v_ptrs, sk_n, sv_n, e_ok, ev_ok, qk_scale, cap_scale, cap_log2,
            bias_ptrs, sb_n, mask_ptrs, sm_n, q_seg, kseg_ptrs, sks_n, row_hash, col_key,
            drop_limit, sc, BLOCK_N, True, EVEN_E, EVEN_EV, HAS_LEFT, HAS_UPPER,
            HAS_BIAS, HAS_MASK, HAS_SEG, DATA_MASK, HAS_DROPOUT, SOFTCAP, IEEE, COUNT,
            MAX_SCORES,
        )  # fmt: skip

    # normalise; rows with no admissible key (l = 0) and padding queries get zeros
    valid = rows < q_end
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc * (drop_scale / l_safe)[:, None]
    out = tl.where(valid[:, None], out, 0.0)
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has_keys, (m_ref + tl.log2(l_safe)) * LN2, float("-inf"))
    lse = tl.where(valid, lse, sink if HAS_SINKS else float("-inf"))
    o_ptrs = Out + z64 * so_z + h64 * so_h + qi * so_m + offs_ev[None, :] * so_e
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rows_ok & ev_ok)
    tl.store(Lse + z64 * sl_z + h64 * sl_h + rows * sl_m, lse, mask=rows < L)
    if MAX_SCORES:
        best = tl.where(valid, best, float("-inf"))
        tl.store(RowMax + z64 * sl_z + h64 * sl_h + rows * sl_m, best, mask=rows < L)
    if COUNT:
        tl.store(Count + pid, count)
