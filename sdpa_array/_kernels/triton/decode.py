"""The decoding kernel: split-KV attention of a few queries over a KV cache, contiguous or paged.

One program per (sequence, key/value head, split). It holds every query row that reads its
key/value head, ``G * L`` rows (``G`` query heads per key/value head, ``L`` new queries), as
one tile, so a cache token is loaded once for all of them. It walks its split's tokens in
blocks of ``BLOCK_N``, finding each token's page through the block table (a contiguous
cache is one page per sequence), and keeps FlashAttention's online softmax: the split's
partial output (normalised) and log-sum-exp go to float32 buffers, which
:func:`~sdpa_array._arrays.merge.merge_attention_states` merges over the splits (flash-decoding).

Token ``t`` of sequence ``b`` is admissible for query ``i`` when ``start_b <= t < n_b`` (the
attended tokens, past the left padding) and it lies in the band around the bottom-right
diagonal ``n_b - L + i``: ``t <= diagonal + upper`` (``upper`` 0 under ``is_causal``, or the
window's right side) and ``t >= diagonal - left``. Tokens outside ``[start_b, n_b)`` are
never loaded, so the cache may hold anything there. A row with no admissible token in a
split gets a zero output and a log-sum-exp of ``-inf``.
"""

from __future__ import annotations

from ._lang import jit, tl
from .device import LN2, matmul, tanh

__all__ = ["decode_kernel"]


@jit
def decode_kernel(
    Q, K, V, Table, Attended, Starts, OutPart, LsePart,
    sq_b, sq_h, sq_m, sq_e,
    sk_p, sk_h, sk_s, sk_e,
    sv_p, sv_h, sv_s, sv_e,
    st_b, st_j,
    so_b, so_h, so_s, so_m, so_e,
    sl_b, sl_h, sl_s, sl_m,
    HKV, G, L, E, EV, PAGE, CHUNK,
    left, upper, qk_scale, cap_scale, cap_log2,
    HAS_LEFT: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_EV: tl.constexpr,
):  # fmt: skip
    """Partial outputs ``(B, HKV, splits, G * L, EV)`` and log-sum-exps ``(B, HKV, splits,
    G * L)`` of each split of ``CHUNK`` tokens.

    ``Q`` is ``(B, HKV * G, L, E)``; ``K``/``V`` are pages ``(P, HKV, PAGE, E|EV)``;
    ``Table`` ``(B, max_pages)`` maps token ``t`` of sequence ``b`` to page ``Table[b, t //
    PAGE]``, row ``t % PAGE``; ``Attended`` ``(B,)`` holds ``n_b`` and ``Starts`` ``(B,)``
    the first token (tokens before it are padding, never loaded). Row ``r`` of a tile is
    query head ``h * G + r // L``, query ``r % L``. ``qk_scale`` is ``scale * log2(e)``;
    with ``SOFTCAP``, scores are ``tanh(qk * cap_scale) * cap_log2`` (base 2).
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh - b * HKV
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    g = rows // L
    i = rows - g * L
    row_ok = rows < G * L
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)

    n = tl.load(Attended + b)
    diag = n - L + i
    start = split * CHUNK
    stop = tl.minimum(start + CHUNK, n)
    lo = tl.maximum(start, tl.load(Starts + b))  # every token walked lies past it
    if HAS_LEFT:  # the first token any row reaches
        lo = tl.maximum(lo, tl.min(tl.where(row_ok, diag - left, n), axis=0))
    if HAS_UPPER:  # one past the last token any row reaches
        stop = tl.minimum(stop, tl.max(tl.where(row_ok, diag + upper + 1, 0), axis=0))

    q_ptrs = (
        Q + b64 * sq_b + (h64 * G + g[:, None]) * sq_h + i[:, None] * sq_m
        + offs_e[None, :] * sq_e
    )  # fmt: skip
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_e[None, :] < E), other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(lo, stop, BLOCK_N):
        t = n0 + offs_n
        t_ok = t < stop
        page = tl.load(Table + b64 * st_b + (t // PAGE) * st_j, mask=t_ok, other=0).to(tl.int64)
        row = (t % PAGE).to(tl.int64)
        k_ptrs = (
            K + page[None, :] * sk_p + h64 * sk_h + row[None, :] * sk_s + offs_e[:, None] * sk_e
        )
        k = tl.load(k_ptrs, mask=t_ok[None, :] & (offs_e[:, None] < E), other=0.0)
        qk = matmul(q, k, None, IEEE)
        if SOFTCAP:  # noqa: SIM108 (a constexpr branch)
            s = tanh(qk * cap_scale) * cap_log2
        else:
            s = qk * qk_scale
        ok = row_ok[:, None] & t_ok[None, :]
        if HAS_UPPER:
            ok = ok & (t[None, :] <= diag[:, None] + upper)
        if HAS_LEFT:
            ok = ok & (t[None, :] >= diag[:, None] - left)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = (
            V + page[:, None] * sv_p + h64 * sv_h + row[:, None] * sv_s + offs_ev[None, :] * sv_e
        )
        v = tl.load(v_ptrs, mask=t_ok[:, None] & (offs_ev[None, :] < EV), other=0.0)
        acc = matmul(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has_keys, (m_ref + tl.log2(l_safe)) * LN2, float("-inf"))
    s64 = split.to(tl.int64)
    o_ptrs = (
        OutPart + b64 * so_b + h64 * so_h + s64 * so_s + rows[:, None] * so_m
        + offs_ev[None, :] * so_e
    )  # fmt: skip
    tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_ev[None, :] < EV))
    tl.store(LsePart + b64 * sl_b + h64 * sl_h + s64 * sl_s + rows * sl_m, lse, mask=row_ok)
