"""What every native delegation shares: the request, the planned call, and the steps that
give a kernel's result exactly the library's semantics (see :mod:`sdpa_array._kernels.native`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..._arrays.typing import Array
from ..._errors import CannotDelegateError
from ..._problem.outputs import Outputs
from ..._problem.problem import Inputs, Problem
from ..layout import leading_axes, ungroup
from ..operands import kernel_scale, prepare, tile_scores
from ..result import AttentionResult
from ..softmax import exp_shift

__all__ = [
    "CannotDelegateError",
    "Delegation",
    "Layout",
    "NativeKernel",
    "Request",
    "Terms",
    "builds_mask",
    "cast",
    "common_checks",
    "finish",
    "fix_empty_rows",
    "fix_nan_rows",
    "four_d",
    "four_d_term",
    "from_four_d",
    "kernel_causal",
    "kernel_dtype",
    "length_checks",
    "length_terms",
    "nan_rows",
    "refuse",
    "scale_option",
    "score_terms",
    "weights_from_lse",
]


@dataclass(frozen=True)
class Request:
    """The caller's arrays and the outputs asked for, beside the validated :class:`Problem`."""

    inputs: Inputs
    outputs: Outputs = field(default_factory=Outputs)

    @property
    def return_weights(self) -> bool:
        return self.outputs.weights

    @property
    def return_lse(self) -> bool:
        return self.outputs.lse

    @property
    def mask(self) -> Array:
        return self.inputs.mask

    @property
    def bias(self) -> Array:
        return self.inputs.bias


@dataclass(frozen=True)
class Delegation:
    """A call that a native kernel will compute exactly, ready to run.

    Attributes
    ----------
    kernel : str
        Qualified name of the kernel.
    memory_efficient : bool
        Whether the kernel avoids forming the ``(L, S)`` score matrix.
    builds_mask : bool
        Whether an ``(L, S)`` mask the caller did not pass is built to express the call.
    run : callable
        Computes the call.
    twice_differentiable : bool
        Whether the library can differentiate the kernel's own backward pass (double
        backward); where it cannot, :mod:`sdpa_array._plan.autograd` differentiates a call that
        returns the log-sum-exp through our backward kernels instead.
    lse_differentiable : bool
        Whether the library's autodiff carries a gradient through the kernel's log-sum-exp
        (torch's kernels that return it mark it non-differentiable, so a loss on it would
        silently lose that part of the gradient: :mod:`sdpa_array._plan.autograd` then
        differentiates the call through our backward kernels).
    direct : callable or None
        The kernel as a function of ``(query, key, value)`` alone that returns the public
        function's output as it is, where the call needs nothing else (no mask, bias, cast,
        padding, broadcast or row without an admissible key); it holds no array of the
        call, so that a later call of the same signature may use it
        (:mod:`sdpa_array._plan.cache`). ``None`` otherwise.
    """

    kernel: str
    memory_efficient: bool
    builds_mask: bool
    run: Callable[[], AttentionResult]
    twice_differentiable: bool = True
    lse_differentiable: bool = True
    direct: Callable[[Any, Any, Any], Any] | None = None


@dataclass(frozen=True)
class NativeKernel:
    """One row of the delegation table.

    Attributes
    ----------
    kernel : str
        Qualified name of the kernel (shown in messages).
    library : str
        Array library whose arrays it takes (as :func:`namespace_name` spells it).
    plan : callable
        ``plan(problem, request) -> Delegation``; raises :class:`CannotDelegateError`.
    optional : str or None
        The optional kernel (``sdpa_array.set_optional_kernels``) the caller must allow for
        the row to be tried; ``None``: always tried.
    """

    kernel: str
    library: str
    plan: Callable[[Problem, Request], Delegation]
    optional: str | None = None


# --- shared, library-independent pieces ---------------------------------------------------


def refuse(reason: str) -> CannotDelegateError:
    return CannotDelegateError(reason)


def common_checks(p: Problem, req: Request, *, lengths: bool = False) -> None:
    """Refuse what no native kernel computes; ``lengths``: the kernel takes query and key
    lengths as a key mask beside its own ``is_causal`` (:func:`length_checks`)."""
    if lengths:
        length_checks(p, req)
    for refused, reason in (
        (req.outputs.max_scores, "no native kernel returns the maximum scores"),
        (
            p.has_sequences and not lengths,
            "query/key lengths and segment ids are not delegated to it",
        ),
        (p.softcap is not None, "no native kernel applies a softcap"),
        (p.has_sinks, "no native kernel adds attention sinks"),
        (p.dropout_p > 0, "native dropout does not draw dropout_keep_mask's bits"),
        (p.has_mods, "mask_mod/bias_mod/score_mod are not delegated (see docs: implementations)"),
        (p.E == 0, "E == 0 (empty feature axis)"),
        (
            p.scale_is_array and kernel_dtype(p) != p.compute_dtype,
            "an array scale would be rounded into the half-precision query (the kernels "
            "take a Python float)",
        ),
    ):
        if refused:
            raise refuse(reason)


def length_checks(p: Problem, req: Request) -> None:
    """Refuse the sequence arguments that a key mask beside ``is_causal`` cannot express:
    segment ids, lengths beside a mask or bias, per-sequence diagonals (``"bottom_right"``
    with right padding, ``"top_left"`` with left padding) and lengths whose batch axes
    broadcast partially."""
    if p.segments is not None:
        raise refuse("segment ids are not delegated")
    if not p.has_sequences:
        return
    if req.mask is not None or req.bias is not None:
        raise refuse("lengths beside a mask or bias are not delegated")
    if p.diagonal_per_sequence:
        raise refuse(
            f"alignment={p.alignment!r} with {'left' if p.left_padded else 'right'} padding "
            "puts each sequence's diagonal elsewhere, which no kernel's is_causal expresses"
        )
    seq = p.sequence_batch
    for lengths in (p.query_lengths, p.key_lengths):
        if lengths is None:
            continue
        shape = (1,) * (len(seq) - lengths.array.ndim) + tuple(lengths.array.shape)
        if shape != seq and any(n != 1 for n in shape):
            raise refuse(f"lengths of shape {tuple(lengths.array.shape)} broadcast partially")


def _lengths_as(p: Problem, lengths: Any, tail: tuple[int, int]) -> Any:
    """``lengths`` (sequence batch) shaped ``(*sequence batch, 1, *tail)``."""
    xp, seq = p.xp, p.sequence_batch
    shape = (1,) * (len(seq) - lengths.ndim) + tuple(lengths.shape)
    return xp.reshape(lengths, (*shape, 1, *tail))


def length_terms(p: Problem, is_causal: bool) -> tuple[Any, Any]:
    """Query and key lengths as a key mask ``(..., 1, 1, S)`` and the rows that keep an
    admissible key ``(..., 1, L|1, 1)``, under the kernel's top-left ``is_causal`` where
    ``is_causal`` (else of the lengths alone); ``(None, None)`` without lengths.

    No ``(L, S)`` array is formed: a row is padding by its query length, and it reaches a
    valid key when its key length is positive and, under causal attention with left
    padding, when it lies at or after the first valid key.
    """
    ql, kl = p.query_lengths, p.key_lengths
    if ql is None and kl is None:
        return None, None
    xp, dev, left = p.xp, p.device, p.left_padded
    i = xp.reshape(xp.arange(p.L, device=dev), (p.L, 1))
    j = xp.arange(p.S, device=dev)
    keys = rows = None
    if ql is not None:
        n = _lengths_as(p, ql.array, (1, 1))
        rows = i >= p.L - n if left else i < n
    if kl is not None:
        n = _lengths_as(p, kl.array, (1, 1))
        keys = (j >= p.S - n) if left else (j < n)
        reach = n > 0
        if left and is_causal:
            reach = xp.logical_and(reach, i >= p.S - n)
        rows = reach if rows is None else xp.logical_and(rows, reach)
    return keys, rows


def kernel_dtype(p: Problem) -> Any:
    """The dtype a native kernel computes in: the caller's on a CUDA device, else the compute
    dtype (float32 for float16/bfloat16 inputs)."""
    return p.dtype if p.on_gpu else p.compute_dtype


@dataclass(frozen=True)
class Terms:
    """Mask and bias as a kernel takes them, and which rows keep an admissible key."""

    is_causal: bool
    mask: Any
    bias: Any
    row_ok: Any


def kernel_causal(p: Problem, has_terms: bool) -> bool:
    """Whether the kernel's own (top-left) ``is_causal`` expresses all positional rules.

    Only without a mask or bias: torch refuses ``is_causal`` beside a mask, and with one,
    the rows left with no admissible key must be known (:func:`fix_empty_rows`), which
    needs the positional restriction as a mask anyway.
    """
    pos = p.band
    top_left_causal = pos.is_causal and pos.left is None and pos.right is None and pos.offset == 0
    return top_left_causal and not has_terms


def builds_mask(p: Problem, has_terms: bool) -> bool:
    """Whether :func:`score_terms` will build an ``(L, S)`` positional mask."""
    return p.band.restricts and not kernel_causal(p, has_terms)


def score_terms(p: Problem, mask: Any, bias: Any, *, merge: bool) -> Terms:
    """Express mask, bias and positions with the kernel's arguments.

    ``merge``: fold every boolean restriction into one additive float mask (``-inf`` where
    excluded); needed when a kernel takes only one mask argument, or treats a boolean mask
    with a large finite negative instead of ``-inf``.
    """
    xp, dtype = p.xp, kernel_dtype(p)
    has_terms = mask is not None or bias is not None
    is_causal = kernel_causal(p, has_terms)
    positional = None
    if builds_mask(p, has_terms):
        positional = p.band.tile_mask(xp, p.device, slice(0, p.L), slice(0, p.S))
    keys, rows = length_terms(p, is_causal)  # only beside no mask or bias (length_checks)
    if keys is not None or rows is not None:
        if positional is None:
            return _length_only_terms(p, is_causal, keys, rows, merge=merge)
        # with a positional mask built, the lengths join it in one (L, S) mask
        mask = keys if rows is None else rows if keys is None else xp.logical_and(rows, keys)
    allowed = mask
    if positional is not None:
        allowed = positional if allowed is None else xp.logical_and(allowed, positional)
    if allowed is None and bias is None:  # nothing to express: the kernel's own causal
        return Terms(is_causal, None, None, None)
    if bias is not None:
        bias = xp.astype(bias, dtype, copy=False)
    neg_inf = xp.asarray(-math.inf, dtype=dtype, device=p.device)
    row_ok = None
    if allowed is not None or bias is not None:
        ok = allowed
        if bias is not None:
            finite = bias != neg_inf
            ok = finite if ok is None else xp.logical_and(ok, finite)
        row_ok = xp.any(ok, axis=-1, keepdims=True)
        # A row with no admissible key would give the kernels' softmax (and its backward)
        # 0/0: such rows attend every key with a zero bias instead, so that no NaN arises,
        # and :func:`fix_empty_rows` replaces their output; their cotangent is then zero,
        # and so are their contributions to every gradient.
        if allowed is not None:
            allowed = xp.logical_or(allowed, xp.logical_not(row_ok))
        if bias is not None:
            bias = xp.where(row_ok, bias, xp.asarray(0.0, dtype=dtype, device=p.device))
    if merge and allowed is not None:
        zero = xp.asarray(0.0, dtype=dtype, device=p.device)
        bias, allowed = xp.where(allowed, zero if bias is None else bias, neg_inf), None
    return Terms(is_causal, allowed, bias, row_ok)


def _length_only_terms(p: Problem, is_causal: bool, keys: Any, rows: Any, *, merge: bool) -> Terms:
    """Lengths under the kernel's own ``is_causal`` (or no positional rule): the key mask
    broadcasts over the rows, and the rows without an admissible key, known from the
    lengths, are fixed afterwards (the kernels give such rows zeros, not NaN)."""
    xp = p.xp
    if keys is None:  # query lengths only: every key
        return Terms(is_causal, None, None, rows)
    if merge:
        dtype = kernel_dtype(p)
        zero = xp.asarray(0.0, dtype=dtype, device=p.device)
        neg_inf = xp.asarray(-math.inf, dtype=dtype, device=p.device)
        return Terms(is_causal, None, xp.where(keys, zero, neg_inf), rows)
    return Terms(is_causal, keys, None, rows)


def nan_rows(p: Problem, q: Any, k: Any, *, first_key: bool) -> Any:
    """Rows ``(..., L, 1)`` that must come out NaN because every score of theirs is NaN:
    the query holds a NaN (its row sum is NaN) and, with ``first_key`` (a call whose every
    row admits key 0: no mask, bias or lengths beside the kernel's own ``is_causal``), the
    first key holds one. Some kernels give such rows zeros (torch's CPU kernels, whose
    row maximum skips NaN); a row with a finite score among its NaN ones they give NaN.

    ``q`` and ``k`` are the arrays the kernel took, heads first: cheap row reductions, no
    host synchronisation. A row the mask, bias or lengths leave without an admissible key
    stays zeros (:func:`fix_empty_rows` comes after).
    """
    xp = p.xp
    bad = xp.isnan(xp.sum(q, axis=-1, keepdims=True))
    if first_key and p.S > 0:
        first = xp.isnan(xp.sum(k[..., :1, :], axis=-1, keepdims=True))  # (..., Hkv, 1, 1)
        if p.grouped:  # each key/value head for its group of query heads
            shape = tuple(first.shape)
            first = xp.broadcast_to(first[..., None, :, :], (*shape[:-2], p.groups, 1, 1))
            first = xp.reshape(first, (*shape[:-3], shape[-3] * p.groups, 1, 1))
        bad = xp.logical_or(bad, first)
    return bad


def fix_nan_rows(p: Problem, bad: Any, out: Any, lse: Any) -> tuple[Any, Any]:
    """NaN output and log-sum-exp for the rows of :func:`nan_rows`, whatever the kernel
    gave (the other rows' values are kept as they are)."""
    xp = p.xp
    out = xp.where(bad, xp.asarray(math.nan, dtype=out.dtype, device=p.device), out)
    if lse is not None:
        lse = xp.where(bad[..., 0], xp.asarray(math.nan, dtype=lse.dtype, device=p.device), lse)
    return out, lse


def fix_empty_rows(p: Problem, terms: Terms, out: Any, lse: Any) -> tuple[Any, Any]:
    """Zeros and ``-inf`` for rows with no admissible key, whatever the kernel gave."""
    if terms.row_ok is None:
        return out, lse
    xp = p.xp
    out = xp.where(terms.row_ok, out, xp.asarray(0.0, dtype=out.dtype, device=p.device))
    if lse is not None:
        neg_inf = xp.asarray(-math.inf, dtype=lse.dtype, device=p.device)
        lse = xp.where(terms.row_ok[..., 0], lse, neg_inf)
    return out, lse


def weights_from_lse(p: Problem, req: Request, lse: Any) -> Any:
    """``exp(scores - lse)``: the weights, formed once with the shared score builder."""
    xp = p.xp
    ops = prepare(p, req.inputs.without_padding(p))
    s, _ = tile_scores(p, ops, ops.q, slice(0, p.L), slice(0, p.S))
    lse = xp.astype(lse, p.compute_dtype, copy=False)
    if p.grouped:
        lse = xp.reshape(lse, (*lse.shape[:-2], p.heads_kv, p.groups, p.L))
    return ungroup(p, xp.exp(s - exp_shift(p, lse)[..., None]))


def finish(
    p: Problem,
    req: Request,
    terms: Terms,
    out: Any,
    lse: Any,
    nan_from: tuple[Any, Any] | None = None,
) -> AttentionResult:
    """The kernel's ``out`` and ``lse`` (in the call's layout) with the library's semantics:
    with ``nan_from`` (the kernel's query and key, heads first: a kernel that may give
    zeros for a row whose scores are all NaN), NaN for the rows of :func:`nan_rows`; zeros
    and ``-inf`` for rows without an admissible key; the weights where asked for."""
    if nan_from is not None:
        first_key = terms.mask is None and terms.bias is None and terms.row_ok is None
        out, lse = fix_nan_rows(p, nan_rows(p, *nan_from, first_key=first_key), out, lse)
    out, lse = fix_empty_rows(p, terms, out, lse)
    weights = weights_from_lse(p, req, lse) if req.return_weights else None
    return AttentionResult(out=out, weights=weights, lse=lse if req.return_lse else None)


def cast(p: Problem, req: Request) -> tuple[Any, Any, Any]:
    """Query, key and value in :func:`kernel_dtype`, their rows past the lengths set to
    zero (whatever they held: a masked NaN would still give ``0 * NaN``); the query times
    ``scale`` if it is an array."""
    xp, dtype, x = p.xp, kernel_dtype(p), req.inputs.without_padding(p)
    q = xp.astype(x.query, dtype, copy=False)
    if p.scale_is_array:
        q = q * xp.astype(kernel_scale(p), dtype, copy=False)
    return q, xp.astype(x.key, dtype, copy=False), xp.astype(x.value, dtype, copy=False)


def scale_option(p: Problem) -> float:
    """The kernel's ``scale`` (1 when :func:`cast` multiplied an array scale into ``q``)."""
    return 1.0 if p.scale_is_array else float(p.scale)


@dataclass(frozen=True)
class Layout:
    """The call as ``(B, H, N, X)`` arrays with one flat batch axis (for 4-D kernels)."""

    q: Any
    k: Any
    v: Any
    B: int
    Hq: int
    Hkv: int


def four_d(p: Problem, q: Any, k: Any, v: Any) -> Layout:
    """Reshape q, k, v to ``(B, H, N, X)``; refuse batch axes that broadcast."""
    xp = p.xp
    batch = p.batch_shape
    lead = batch[:-1]
    B = math.prod(lead)
    ndim = len(batch) + 2
    heads = []
    out = []
    for name, x in (("query", q), ("key", k), ("value", v)):
        x = leading_axes(xp, x, ndim)
        if tuple(x.shape[: len(lead)]) != lead:
            raise refuse(
                f"4-D kernels need query, key and value with equal batch axes; {name} has "
                f"{tuple(x.shape[: len(lead)])}, the call {lead}"
            )
        h = int(x.shape[-3]) if batch else 1
        heads.append(h)
        out.append(xp.reshape(x, (B, h, *x.shape[-2:])))
    hq, hk, hv = heads
    if hq != (batch[-1] if batch else 1) or hk != hv or hq % hk:
        raise refuse(
            f"heads (query {hq}, key {hk}, value {hv}) must be equal, or the query's a "
            "multiple of the key/value's"
        )
    return Layout(q=out[0], k=out[1], v=out[2], B=B, Hq=hq, Hkv=hk)


def four_d_term(p: Problem, x: Any, name: str) -> Any:
    """A mask/bias as ``(B|1, H|1, L|1, S|1)``; refuse one that broadcasts partially."""
    if x is None:
        return None
    xp = p.xp
    batch = p.batch_shape
    lead = batch[:-1]
    x = leading_axes(xp, x, len(batch) + 2)
    x_lead = tuple(x.shape[: len(lead)])
    if x_lead != lead and any(n != 1 for n in x_lead):
        raise refuse(f"the {name}'s batch axes {x_lead} broadcast partially against {lead}")
    h = int(x.shape[-3]) if batch else 1
    return xp.reshape(x, (math.prod(lead) if x_lead == lead else 1, h, *x.shape[-2:]))


def from_four_d(p: Problem, x: Any, tail: tuple[int, ...]) -> Any:
    return p.xp.reshape(x, (*p.batch_shape, *tail))
