"""Whether and how a KV-cache call goes through the Triton decoding kernel.

:func:`decode_call` describes the call as
:class:`~sdpa_array._kernels.triton.decoding.DecodeCall` (the caches as pages, the lengths
and block table on the device, the band around the bottom-right diagonal), or returns
``None`` where the kernel does not run it.
"""

from __future__ import annotations

import numpy as np

from ..._arrays.typing import Array
from ..._kernels.triton.decoding import DecodeCall, decode_reason
from ..._kernels.triton.plan import CannotUseTritonError, plan_triton
from ..._problem.problem import Inputs
from .args import CacheCall

__all__ = ["decode_call"]


def decode_call(c: CacheCall, caches: tuple[Array, Array]) -> DecodeCall | None:
    """The call as the Triton decoding kernel takes it, or ``None`` where it does not run:
    another ``implementation`` asked for, the maximum scores asked for (the kernel does not
    return them), ``"auto"`` off a GPU, or a call the kernel cannot
    compute (:func:`decode_reason`, :func:`~sdpa_array._kernels.triton.plan_triton`).

    Lengths known only on the device (a torch CUDA graph being captured, where reading them
    would synchronise) stay there: the splits then cover the cache's capacity, and splits
    past a sequence's length read nothing. Nothing is copied from the host then, so the
    call can be captured.
    """
    p = c.problem
    if c.implementation not in ("auto", "triton") or c.return_max_scores:
        return None
    if c.implementation == "auto" and not p.on_gpu:
        return None
    try:
        plan_triton(p, Inputs(c.query, *caches))
    except CannotUseTritonError:
        return None
    arrays = (c.query, *caches, c.new_key, c.new_value)
    grouped = int(c.query.shape[1]) // int(caches[0].shape[1])
    reason = decode_reason(
        grouped * c.L,
        scale_is_array=p.scale_is_array,
        has_terms=c.mask is not None or c.bias is not None,
        requires_grad=any(getattr(a, "requires_grad", False) for a in arrays),
    )
    if reason is not None:
        return None
    xp, dev = c.xp, c.device
    if not c.paged:  # one page per sequence: page b
        table = xp.reshape(xp.arange(c.B, dtype=xp.int32, device=dev), (c.B, 1))
    elif c.host_table is None:
        table = xp.astype(c.table, xp.int32, copy=False)
    else:
        table = xp.asarray(c.host_table.astype(np.int32), device=dev)
    if c.host_lengths is None:
        attended = xp.astype(c.lengths, xp.int32) + c.new_tokens
        longest = c.capacity
    else:
        host = np.asarray(c.host_lengths, dtype=np.int64) + c.new_tokens
        attended = xp.asarray(host.astype(np.int32), device=dev)
        longest = int(host.max(initial=0))
    if c.starts is None:
        starts = xp.zeros((c.B,), dtype=xp.int32, device=dev)
    elif isinstance(c.starts, tuple):
        starts = xp.asarray(np.asarray(c.starts, dtype=np.int32), device=dev)
    else:
        starts = xp.astype(c.starts, xp.int32)
    left, right = c.window if c.window is not None else (None, None)
    uppers = [u for u in (0 if c.is_causal else None, right) if u is not None]
    return DecodeCall(
        query=c.query,
        key_pages=caches[0],
        value_pages=caches[1],
        table=table,
        attended=attended,
        starts=starts,
        longest=longest,
        scale=float(p.scale),
        softcap=p.softcap,
        left=left,
        upper=min(uppers) if uppers else None,
        splits=c.num_splits,
    )
