r"""The backward kernels: FlashAttention-2's backward pass in three launches, no atomics.

With ``Z`` the final scores, ``P = exp(Z - lse)`` recomputed from the forward's log-sum-exp
and ``D = rowsum(dO * O) - grad_lse`` (:func:`delta_kernel`), the gradients are
``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dZ = P * (dP - D)``, ``dS = dZ`` (times ``1 - tanh²`` under a
soft-cap) and ``dQ = scale dS K``, ``dK = scale dSᵀ Q`` (see
:mod:`sdpa_array._kernels.gradients`). Dropout multiplies ``P`` (for ``dV``) and ``dP`` by
``keep / (1 - p)``, with the keep mask regenerated from the seed.

* :func:`~.backward_keys.dkdv_kernel`: a program per key block and key/value head holds
  ``K``, ``V`` and the ``dK``, ``dV`` accumulators, and visits the query blocks that reach
  its keys (:func:`~.device.query_span`), for each query head of its group;
* :func:`~.backward_queries.dq_kernel`: a program per query block and query head holds
  ``Q``, ``dO`` and the ``dQ`` accumulator and visits the key blocks its queries reach (as
  the forward does); it also writes ``dZ``, the bias's gradient, where there is a bias.

This module holds :func:`delta_kernel` and the row loads both of them share.

Tiles are transposed in the key-side kernel (keys on rows). ``P`` and ``dS`` are rounded to
the inputs' dtype before their products (``dV``, ``dK``, ``dQ``), as FlashAttention does.
Rows with no admissible key (``lse = -inf``) and padding queries get ``P = 0`` through a
log-sum-exp of ``+inf``, so their gradients are exact zeros.
"""

from __future__ import annotations

from ._lang import jit, tl
from .device import (
    LOG2E,
)

__all__ = ["delta_kernel", "load_rows", "row_values"]


@jit
def delta_kernel(
    O,  # noqa: E741
    DO,
    GradLse,
    Delta,
    so_z,
    so_h,
    so_m,
    so_e,
    sd_z,
    sd_h,
    sd_m,
    sd_e,
    sg_z,
    sg_h,
    sg_m,
    sD_z,
    sD_h,
    sD_m,
    H,
    L,
    EV,
    BLOCK_M: tl.constexpr,
    BLOCK_EV: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr,
):
    """``D = rowsum(dO * O) - grad_lse`` in float32, ``(Z, H, L)``; a program per query
    block of one batch element and head."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(L, BLOCK_M)
    zh = pid // n_m
    rows = (pid - zh * n_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    z64 = (zh // H).to(tl.int64)
    h64 = (zh - (zh // H) * H).to(tl.int64)
    cols = tl.arange(0, BLOCK_EV)
    ok = (rows[:, None] < L) & (cols[None, :] < EV)
    o = tl.load(
        O + z64 * so_z + h64 * so_h + rows[:, None] * so_m + cols[None, :] * so_e,
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO + z64 * sd_z + h64 * sd_h + rows[:, None] * sd_m + cols[None, :] * sd_e,
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_GRAD_LSE:
        g = tl.load(GradLse + z64 * sg_z + h64 * sg_h + rows * sg_m, mask=rows < L, other=0.0)
        delta -= g.to(tl.float32)
    tl.store(Delta + z64 * sD_z + h64 * sD_h + rows * sD_m, delta, mask=rows < L)


@jit
def row_values(
    ptrs,
    m0,
    stride,
    rows,
    L,
    q_end,
    delta_ptrs,
    delta_stride,
    MASKED: tl.constexpr,
):
    """Base-2 log-sum-exp (``+inf`` for padding queries and rows without keys, so that
    their ``P`` is 0) and ``D`` of the rows ``m0 + rows``."""
    if MASKED:
        lse = tl.load(ptrs + m0 * stride, mask=rows < L, other=0.0)
        delta = tl.load(delta_ptrs + m0 * delta_stride, mask=rows < L, other=0.0)
    else:
        lse = tl.load(ptrs + m0 * stride)
        delta = tl.load(delta_ptrs + m0 * delta_stride)
    lse2 = tl.where((rows < q_end) & (lse > float("-inf")), lse * LOG2E, float("inf"))
    return lse2, delta


@jit
def load_rows(ptrs, start, stride, index, n, feature_ok, MASKED: tl.constexpr, EVEN: tl.constexpr):
    """A ``(rows, features)`` tile at rows ``start + index`` (``index`` a column vector):
    masked past ``n`` in ``MASKED`` tiles and past the features unless ``EVEN``."""
    if MASKED:
        x = tl.load(ptrs + start * stride, mask=(index < n) & feature_ok, other=0.0)
    else:
        if EVEN:
            x = tl.load(ptrs + start * stride)
        else:
            x = tl.load(ptrs + start * stride, mask=feature_ok, other=0.0)
    return x
