"""Decoding over a KV cache, planned: which kernel attends a checked cache call, and why.

:func:`plan_decode` turns a :class:`~.kv_call.CacheCall` into a :class:`DecodePlan`, whose
:class:`DecodeChoice` names one of :data:`DECODE_KERNELS`:

* ``"triton"``: the Triton split-KV decoding kernel, one launch over (sequence, key/value
  head, split) and one merge (:func:`run_decode_kernel` runs it);
* ``"single"``: one call of the forward over the tokens every sequence attends, a slice
  ``[lo, n)`` of a contiguous cache (:attr:`DecodePlan.span`); the forward's own plan then
  picks its kernel (torch's native kernel, blocked, materialized...), exactly as for
  :func:`~sdpa_array.scaled_dot_product_attention` on that slice;
* ``"split"``: split-KV chunks, each attended by a call of the forward on its keys alone
  and merged by their log-sum-exps (:attr:`DecodePlan.pieces`, :mod:`.splits`).

The face (``sdpa_array._api.kv_cache``) checks the call, asks for the plan and runs the
choice. The rule is one for every call, and the forward's where they meet: the decoding
kernel where the forward's ``"auto"`` would take the Triton kernels (a GPU, the Triton
kernels able to compute the call: :func:`~.dispatch.triton_reason`) or where
``implementation="triton"`` asks for them, and the decoding kernel takes the call
(:func:`~sdpa_array._kernels.triton.decoding.decode_reason`); else one forward call where
the attended tokens are one slice of a contiguous cache, known on the host, and the split
rule cuts them into one chunk; else split-KV chunks.

*Kept plans.* A call whose arrays and options have a signature (:func:`call_signature`:
plain NumPy, torch or CuPy arrays, options that are numbers, strings or tuples of those)
is checked in full once; its checks' findings (:meth:`~.kv_call.CacheCall.setup`) and the
part of the rule that the signature decides (whether the decoding kernel takes it) are kept
in :mod:`.cache`, and a later call of that signature checks only the values of its
lengths, starts and block table (:func:`kept_setup`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._arrays.compat import plain_signature
from .._arrays.typing import Array
from .._kernels.triton.configs import interpreting
from .._kernels.triton.decoding import DecodeCall, decode_reason, triton_decode
from .._kernels.triton.plan import plan_triton
from .._problem.problem import Inputs
from . import cache
from .dispatch import triton_reason
from .kv_call import CacheCall
from .splits import Piece, chunk_target, pieces

__all__ = [
    "DECODE_KERNELS",
    "DecodeChoice",
    "DecodePlan",
    "call_signature",
    "kept_setup",
    "plan_decode",
    "run_decode_kernel",
]

#: The kernels a KV-cache call may run (see the module docstring).
DECODE_KERNELS = ("triton", "single", "split")


@dataclass(frozen=True)
class DecodeChoice:
    """The kernel that attends a KV-cache call, chosen once.

    Attributes
    ----------
    name : str
        One of :data:`DECODE_KERNELS`.
    automatic : bool
        Whether ``implementation="auto"`` was given.
    implementation : str
        The caller's ``implementation``: what every forward call of ``"single"`` and
        ``"split"`` is given.
    why : tuple of str
        Why each kernel the rule prefers to this one was passed over.
    """

    name: str
    automatic: bool
    implementation: str
    why: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """A KV-cache call, planned.

    Attributes
    ----------
    call : CacheCall
        The checked call.
    choice : DecodeChoice
        The kernel, and why.
    span : (int, int) or None
        ``"single"``: the tokens ``[lo, n)`` every sequence attends.
    pieces : tuple of Piece
        ``"split"``: the pieces to attend, sequence by sequence.
    """

    call: CacheCall
    choice: DecodeChoice
    span: tuple[int, int] | None = None
    pieces: tuple[Piece, ...] = ()


#: Types of the option values a signature takes as they are.
_SIMPLE = frozenset({type(None), bool, int, float, str})


def _integers_kind(value: Any) -> Any:
    """What the checks read of an integer argument besides its values: ``list`` and
    ``tuple`` (their values are checked per call), a plain array's signature; ``False``
    where that is more than a signature."""
    if value is None:
        return None
    kind = type(value)
    if kind is list or kind is tuple:
        return kind
    found = plain_signature(value)
    return False if found is None else found


def direct_key(arguments: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The key of a plain cache call (:mod:`.cache`'s KV-cache calls) of the cache
    function's ``arguments``: its signature (:func:`call_signature`) and the lengths'
    values; ``None`` for a call that is not plain (a layout other than ``"BHLE"``, new
    tokens, a block table, ``cache_leftpad``, lengths that are not a list or tuple of ints)
    or whose signature is more than one."""
    if arguments["layout"] != "BHLE" or arguments["new_key"] is not None:
        return None
    if arguments["block_table"] is not None or arguments["cache_leftpad"] is not None:
        return None
    lengths = arguments["cache_lengths"]
    if type(lengths) not in (list, tuple) or not all(type(n) is int for n in lengths):
        return None
    arrays = (arguments["query"], arguments["key_cache"], arguments["value_cache"], None, None)
    found = call_signature(
        arrays, (lengths, None, None), arguments["num_splits"], arguments["options"]
    )
    return None if found is None else (found, tuple(lengths))


def call_signature(
    arrays: tuple[Any, ...], integers: tuple[Any, ...], num_splits: Any, options: dict[str, Any]
) -> tuple[Any, ...] | None:
    """What a cache call's checks and the static part of its plan depend on: the arrays'
    signatures (query, caches, new tokens), the kinds of the integer arguments (lengths,
    starts, block table), ``num_splits``, whether triton's interpreter runs (where the
    Triton kernels may be asked: arrays off the CPU, or ``implementation="triton"``), and
    the options with their types; ``None`` where
    that is more than a signature (an array or a function among the options, arrays whose
    checks are not kept) or a required array is missing."""
    if any(a is None for a in arrays[:3]):  # the checks name what is missing
        return None
    found: list[Any] = []
    for a in arrays:
        one = None if a is None else plain_signature(a)
        if one is None and a is not None:
            return None
        found.append(one)
    for value in integers:
        kind = _integers_kind(value)
        if kind is False:
            return None
        found.append(kind)
    if type(num_splits) not in _SIMPLE:
        return None
    found.append((type(num_splits), num_splits))
    device = getattr(found[0][3], "type", found[0][3])  # NumPy: "cpu"; torch: its device's
    if device != "cpu" or options.get("implementation") == "triton":
        found.append(interpreting())  # which arrays the Triton kernels take then
    for name, value in options.items():
        kind = type(value)
        if kind is tuple:  # a window
            if not all(type(side) in _SIMPLE for side in value):
                return None
            value = (value, tuple(map(type, value)))
        elif kind not in _SIMPLE:
            return None
        found.append((name, kind, value))
    return tuple(found)


def kept_setup(signature: tuple[Any, ...] | None) -> dict[str, Any] | None:
    """The checks' findings kept for a call of ``signature`` (:meth:`CacheCall.setup`),
    if a call of it was planned before."""
    if signature is None:
        return None
    kept = cache.lookup_decode(signature)
    return None if kept is None else kept[0]


def _kernel_reason(c: CacheCall) -> str | None:
    """Why the Triton decoding kernel does not attend the call (``None``: it does); what
    the call's signature decides.

    Raises
    ------
    CannotUseTritonError
        ``implementation="triton"`` where the Triton kernels cannot run the call.
    """
    p = c.problem
    if c.implementation not in ("auto", "triton"):
        return f"triton: implementation={c.implementation!r} was asked for"
    if c.return_max_scores:
        return "triton: the decoding kernel does not return the maximum scores"
    x = Inputs(c.query, c.key_cache, c.value_cache)
    if c.implementation == "auto":
        reason = triton_reason(p, x)
        if reason is not None:
            return reason
    else:  # raises CannotUseTritonError where the Triton kernels cannot run here
        plan_triton(p, x)
    arrays = (c.query, c.key_cache, c.value_cache, c.new_key, c.new_value)
    grouped = int(c.query.shape[1]) // max(1, int(c.key_cache.shape[1]))
    reason = decode_reason(
        grouped * c.L,
        scale_is_array=p.scale_is_array,
        has_terms=c.mask is not None or c.bias is not None,
        requires_grad=any(getattr(a, "requires_grad", False) for a in arrays),
    )
    return None if reason is None else f"triton: {reason}"


def _single_span(c: CacheCall, target: int) -> tuple[tuple[int, int] | None, str]:
    """``([lo, n), "")`` where one forward call over the cache's tokens ``[lo, n)`` attends
    every sequence exactly as the split rule's one chunk would (``target``: its
    :func:`~.splits.chunk_target`); else ``(None, why not)``."""
    if c.paged:
        return None, "single: the cache is paged"
    lengths = c.host_lengths
    if lengths is None:
        return None, "single: the lengths are not known on the host"
    if not lengths or c.L == 0:
        return None, "single: no sequence or no query"
    starts = c.starts
    if starts is not None and not isinstance(starts, tuple):
        return None, "single: cache_leftpad is not known on the host"
    first = lengths[0]
    if any(n != first for n in lengths):
        return None, "single: the sequences' lengths differ"
    start = 0 if starts is None else starts[0]
    if starts is not None and any(s != start for s in starts):
        return None, "single: the sequences' starts (cache_leftpad) differ"
    n = first + c.new_tokens
    if n <= start:
        return None, "single: no token to attend"
    left = None if c.window is None else c.window[0]
    lo = start if left is None else max(start, n - c.L - left)
    splits = c.num_splits or math.ceil((n - lo) / target)
    if splits > 1:
        return None, f"single: the {n - lo} attended tokens are split {splits} ways"
    return (lo, n), ""


def plan_decode(c: CacheCall) -> DecodePlan:
    """The plan of a checked KV-cache call (the rule in the module docstring).

    Raises
    ------
    CannotUseTritonError
        ``implementation="triton"`` where the Triton kernels cannot run the call, before
        any work.
    """
    kept = None if c.signature is None else cache.lookup_decode(c.signature)
    if kept is None:
        reason, target = _kernel_reason(c), chunk_target(c)
        if c.signature is not None:
            cache.store_decode(c.signature, (c.setup(), reason, target))
    else:
        _, reason, target = kept
    automatic = c.implementation == "auto"
    if reason is None:
        return DecodePlan(c, DecodeChoice("triton", automatic, c.implementation))
    span, passed = _single_span(c, target)
    if span is not None:
        return DecodePlan(c, DecodeChoice("single", automatic, c.implementation, (reason,)), span)
    choice = DecodeChoice("split", automatic, c.implementation, (reason, passed))
    return DecodePlan(c, choice, pieces=pieces(c) if c.L else ())


def _decode_call(c: CacheCall, caches: tuple[Array, Array]) -> DecodeCall:
    """The call as the decoding kernel takes it: the caches as pages, the lengths, starts
    and block table as int32 arrays on the device, the band around the bottom-right
    diagonal.

    Lengths known only on the device (a torch CUDA graph being captured, where reading them
    would synchronise) stay there: the splits then cover the cache's capacity, and splits
    past a sequence's length read nothing. Nothing is copied from the host then, so the
    call can be captured.
    """
    p = c.problem
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


def run_decode_kernel(plan: DecodePlan, caches: tuple[Array, Array]) -> tuple[Array, ...]:
    """Output, log-sum-exp and ``None`` (the kernel computes no maximum scores) of a plan
    whose choice is ``"triton"``, over the caches holding the new tokens."""
    out, lse = triton_decode(plan.call.xp, _decode_call(plan.call, caches))
    return out, lse, None
