"""Running the decoding kernel: what it takes, the splits, the launch and the merge.

:func:`decode_reason` says why a KV-cache call cannot go through the decoding kernel of
:mod:`.decode` (``None``: it can); :func:`triton_decode` runs it: one launch over (sequence,
key/value head, split) and one merge of the splits' parts by their log-sum-exps. The
caller (:mod:`sdpa_array._api.kv_cache.decode`) has written the new tokens and describes a
contiguous cache as pages of one sequence each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..._arrays.merge import merge_attention_states
from ..._arrays.typing import Array
from .configs import feature_block, interpreting
from .operands import strided

__all__ = ["MAX_DECODE_ROWS", "DecodeCall", "decode_reason", "decode_splits", "triton_decode"]

#: Most query rows (query heads per key/value head times new queries, ``G * L``) one
#: program holds; calls with more (a long prefill) attend chunk by chunk instead.
MAX_DECODE_ROWS = 64

#: Key block of the decoding kernel (tokens per step).
BLOCK_N = 64

#: Programs the automatic number of splits aims at on a GPU: a few per multiprocessor
#: (132 on an H100 or H200), so that one sequence's long cache keeps the GPU busy.
TARGET_PROGRAMS = 512

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class DecodeCall:
    """A KV-cache call as the decoding kernel reads it.

    Attributes
    ----------
    query : array, shape (B, Hq, L, E)
    key_pages, value_pages : array, shape (P, Hkv, page_size, E|Ev)
        The caches as pages (a contiguous cache: ``P = B``, ``page_size = S_max``).
    table : array, shape (B, max_pages)
        int32 on the query's device: the page of each block of ``page_size`` tokens.
    attended : array, shape (B,)
        int32 on the query's device: the tokens each sequence attends, ``n_b``.
    starts : array, shape (B,)
        int32 on the query's device: each sequence's first token (``cache_leftpad``; the
        tokens before it are padding, never loaded).
    longest : int
        An upper bound of every ``n_b``: the largest where the lengths are known on the
        host, else the cache's capacity.
    scale : float
    softcap : float or None
    left, upper : int or None
        The band around the bottom-right diagonal (``upper``: 0 under ``is_causal``, or the
        window's right side, whichever is smaller; ``None``: no bound on that side).
    splits : int or None
        The caller's ``num_splits`` (``None``: :func:`decode_splits` chooses).
    """

    query: Array
    key_pages: Array
    value_pages: Array
    table: Array
    attended: Array
    starts: Array
    longest: int
    scale: float
    softcap: float | None
    left: int | None
    upper: int | None
    splits: int | None

    @property
    def groups(self) -> int:
        return int(self.query.shape[1]) // int(self.key_pages.shape[1])


def decode_reason(
    rows: int, *, scale_is_array: bool, has_terms: bool, requires_grad: bool
) -> str | None:
    """Why the decoding kernel does not take a call the Triton kernels could otherwise run
    (``None``: it does): ``rows`` (``G * L``) above :data:`MAX_DECODE_ROWS`, a 0-d array
    ``scale``, a dense ``mask`` or ``bias``, or torch tensors that require grad (the kernel
    has no backward)."""
    if rows > MAX_DECODE_ROWS:
        return (
            f"the decoding kernel holds at most {MAX_DECODE_ROWS} query rows per key/value "
            f"head (query heads per group x new queries), got {rows}"
        )
    if scale_is_array:
        return "the decoding kernel takes scale as a number, got a 0-d array"
    if has_terms:
        return "the decoding kernel takes no dense mask or bias"
    if requires_grad:
        return "the decoding kernel has no backward, and the inputs require grad"
    return None


def decode_splits(call: DecodeCall) -> tuple[int, int]:
    """``(splits, chunk)``: how many splits of how many tokens (a multiple of the key
    block) cover the longest sequence. The caller's ``num_splits`` where given; else
    about :data:`TARGET_PROGRAMS` programs on a GPU, one split under the interpreter."""
    blocks = max(1, math.ceil(call.longest / BLOCK_N))
    if call.splits is not None:
        wanted = call.splits
    elif interpreting():
        wanted = 1
    else:
        B, Hkv = int(call.query.shape[0]), int(call.key_pages.shape[1])
        wanted = math.ceil(TARGET_PROGRAMS / max(1, B * Hkv))
    splits = max(1, min(wanted, blocks))
    chunk = math.ceil(blocks / splits) * BLOCK_N
    return math.ceil(blocks * BLOCK_N / chunk), chunk


def _block_m(rows: int) -> int:
    return max(16, 1 << max(0, rows - 1).bit_length())


def triton_decode(xp: Any, call: DecodeCall) -> tuple[Array, Array]:
    """Output ``(B, Hq, L, Ev)`` in the query's dtype and log-sum-exp ``(B, Hq, L)`` in
    float32 of the call, through the decoding kernel."""
    q, kp, vp = call.query, call.key_pages, call.value_pages
    B, Hq, L = (int(n) for n in q.shape[:3])
    Hkv, Ev = int(kp.shape[1]), int(vp.shape[3])
    G = call.groups
    dev = q.device
    splits, chunk = decode_splits(call)
    rows = G * L
    out_parts = xp.empty((B, Hkv, splits, rows, Ev), dtype=xp.float32, device=dev)
    lse_parts = xp.empty((B, Hkv, splits, rows), dtype=xp.float32, device=dev)
    if B and Hq and L:
        _launch(xp, call, out_parts, lse_parts, splits, chunk)
    if splits == 1:
        out, lse = out_parts[:, :, 0, ...], lse_parts[:, :, 0, ...]
    else:
        out, lse = merge_attention_states(
            xp.permute_dims(out_parts, (2, 0, 1, 3, 4)), xp.permute_dims(lse_parts, (2, 0, 1, 3))
        )
    out = xp.astype(xp.reshape(out, (B, Hq, L, Ev)), q.dtype)
    return out, xp.reshape(lse, (B, Hq, L))


def _launch(
    xp: Any, call: DecodeCall, out_parts: Array, lse_parts: Array, splits: int, chunk: int
) -> None:
    from .decode import decode_kernel  # imports triton: only when a call launches it
    from .launch import device_context

    q, kp, vp = call.query, call.key_pages, call.value_pages
    B, _, L, E = (int(n) for n in q.shape)
    Hkv, page, Ev = int(kp.shape[1]), int(kp.shape[2]), int(vp.shape[3])
    G = call.groups
    sq = strided(xp, q, tuple(q.shape), 1)
    sk = strided(xp, kp, tuple(kp.shape), 1)
    sv = strided(xp, vp, tuple(vp.shape), 1)
    st = strided(xp, call.table, tuple(call.table.shape), 1)
    so = strided(xp, out_parts, tuple(out_parts.shape), 1)
    sl = strided(xp, lse_parts, tuple(lse_parts.shape), 1)
    sa = strided(xp, call.attended, tuple(call.attended.shape), 1)
    s0 = strided(xp, call.starts, tuple(call.starts.shape), 1)
    softcap = call.softcap
    ieee = q.dtype == xp.float32
    with device_context(q):
        decode_kernel[(B * Hkv, splits)](
            sq.arg, sk.arg, sv.arg, st.arg, sa.arg, s0.arg, so.arg, sl.arg,
            *sq.strides, *sk.strides, *sv.strides, *st.strides, *so.strides, *sl.strides,
            Hkv, G, L, E, Ev, page, chunk,
            call.left or 0, call.upper or 0,
            call.scale * _LOG2E,
            call.scale / softcap if softcap else 0.0,
            softcap * _LOG2E if softcap else 0.0,
            HAS_LEFT=call.left is not None,
            HAS_UPPER=call.upper is not None,
            SOFTCAP=bool(softcap),
            IEEE=ieee,
            BLOCK_M=_block_m(G * L),
            BLOCK_N=BLOCK_N,
            BLOCK_E=feature_block(E),
            BLOCK_EV=feature_block(Ev),
            num_warps=4,
            num_stages=2,
        )  # fmt: skip
