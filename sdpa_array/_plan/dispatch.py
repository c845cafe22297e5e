"""The one table of implementations, and the one :func:`choose` that forward, VJP and
autograd all use.

Each row of :data:`IMPLEMENTATIONS` names a forward kernel and, where there is one, its
backward kernel. :func:`choose` turns the caller's ``implementation=`` (and block sizes)
into a :class:`Choice`: the row's name, its kernels and the block sizes. The autograd
wrappers (:mod:`sdpa_array._plan.autograd`) ask a choice for its name and its backward kernel,
so forward and backward can never disagree about which implementation ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from .._arrays.compat import namespace_name
from .._arrays.typing import Array
from .._kernels.blocked import blocked_attention
from .._kernels.dask_graph import dask_attention, dask_vjp
from .._kernels.materialized import materialized_attention
from .._kernels.native import (
    CannotDelegateError,
    Delegation,
    Request,
    native_attention,
    native_vjp,
    plan_native,
    plan_native_vjp,
)
from .._kernels.result import AttentionResult, RawGrads
from .._kernels.tiling import TILE_BYTES, check_block_sizes
from .._kernels.triton import CannotUseTritonError, plan_triton, triton_attention, triton_vjp
from .._kernels.vjp_blocked import blocked_vjp
from .._kernels.vjp_materialized import materialized_vjp
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem

__all__ = [
    "AUTO_BLOCKED_BYTES",
    "AUTO_BLOCKED_BYTES_BY_LIBRARY",
    "AUTO_MAX_SCORE_BYTES",
    "IMPLEMENTATIONS",
    "BackwardKernel",
    "Choice",
    "ForwardKernel",
    "Row",
    "auto_blocked_bytes",
    "choose",
    "score_bytes",
    "triton_reason",
]


class ForwardKernel(Protocol):
    """The signature of every forward kernel."""

    def __call__(self, p: Problem, x: Inputs, outputs: Outputs) -> AttentionResult: ...


class BackwardKernel(Protocol):
    """The signature of every backward kernel (``out`` and ``lse``: both or neither)."""

    def __call__(
        self,
        p: Problem,
        x: Inputs,
        grad_output: Array,
        *,
        out: Array = None,
        lse: Array = None,
        grad_lse: Array = None,
    ) -> RawGrads: ...


@dataclass(frozen=True)
class Row:
    """One implementation.

    Attributes
    ----------
    forward : ForwardKernel
        Its forward kernel.
    backward : BackwardKernel or None
        Its backward kernel (``None``: the VJP cannot choose it).
    takes_blocks : bool
        Whether it takes ``block_q`` / ``block_k``.
    own_autograd : bool
        Whether torch and JAX differentiate it through its backward kernel (an opaque
        operation that saves only inputs, output and log-sum-exp) rather than through their
        own autodiff of its forward, which would keep every tile for the backward pass.
    differentiable_backward : bool
        Whether its backward kernel is written with the library's differentiable
        operations, so that its gradients can be differentiated again (double backward);
        where not (fused kernels), the autograd wrapper runs the blocked backward kernel
        when a graph of the gradients is being built.
    """

    forward: ForwardKernel
    backward: BackwardKernel | None
    takes_blocks: bool = False
    own_autograd: bool = False
    differentiable_backward: bool = True


#: The implementations by name.
IMPLEMENTATIONS: dict[str, Row] = {
    "materialized": Row(materialized_attention, materialized_vjp),
    "blocked": Row(blocked_attention, blocked_vjp, takes_blocks=True, own_autograd=True),
    "native": Row(native_attention, native_vjp),
    "triton": Row(triton_attention, triton_vjp, own_autograd=True, differentiable_backward=False),
    "dask": Row(dask_attention, dask_vjp, takes_blocks=True),
}

#: ``"auto"`` runs the blocked implementation when the score matrix of the whole call (in
#: the compute dtype) would exceed this many bytes, i.e. more than one tile: then the
#: materialized path's passes run from main memory instead of cache, and its memory grows
#: as ``L * S``. The default for libraries
#: without an entry in :data:`AUTO_BLOCKED_BYTES_BY_LIBRARY`.
AUTO_BLOCKED_BYTES = TILE_BYTES

#: Memory safety beats speed: above this many score bytes (256 MiB) ``"auto"`` never
#: materializes the score matrix, whatever the library's threshold.
AUTO_MAX_SCORE_BYTES = 2**28

#: Per library (:func:`~._compat.namespace_name` of the inputs' namespace), the score bytes
#: above which ``"auto"`` runs the blocked implementation: the largest measured size at
#: which the blocked forward was still slower than the materialized one (float32, B=1, H=8,
#: E=64, ``L = S`` from 256 to 4096, i.e. 2 to 512 MiB of scores;
#: ``asv_benchmarks/studies/auto_crossover.py``; docs/performance.md, "`auto`'s thresholds
#: per library"). NumPy: blocked faster from 2 MiB (0.1-0.4x), so one tile as before. JAX
#: (eager): forward 2.3x slower at 8 MiB, 0.6-0.85x from 32 MiB (its VJP already 0.87x at
#: 8 MiB). array-api-strict: blocked 1.2-2.7x slower at every measured size, forward and VJP
#: (each tile is separate eager operations), so materialized up to the cap. Dask has no
#: entry: ``"auto"`` builds its graph of chunk pairs (``"dask"``; Dask's materialized and
#: blocked paths measured 1.9-7x apart in favour of materialized). torch: also
#: slower blocked, but under autograd the materialized path keeps the whole probability
#: matrix for the backward pass while the blocked one keeps ``O(block)``, so torch keeps
#: the one-tile default (and most torch calls delegate to its native kernel anyway).
AUTO_BLOCKED_BYTES_BY_LIBRARY: dict[str, int] = {
    "numpy": TILE_BYTES,
    "jax": 8 * 2**20,
    "torch": TILE_BYTES,
    "array_api_strict": AUTO_MAX_SCORE_BYTES,
}


def auto_blocked_bytes(p: Problem) -> int:
    """Score bytes above which ``"auto"`` prefers the blocked implementation for ``p``'s
    library (its entry in :data:`AUTO_BLOCKED_BYTES_BY_LIBRARY`, else
    :data:`AUTO_BLOCKED_BYTES`), never above :data:`AUTO_MAX_SCORE_BYTES`."""
    threshold = AUTO_BLOCKED_BYTES_BY_LIBRARY.get(namespace_name(p.xp), AUTO_BLOCKED_BYTES)
    return min(threshold, AUTO_MAX_SCORE_BYTES)


@dataclass(frozen=True)
class Choice:
    """The implementation that runs a call, chosen once.

    Attributes
    ----------
    name : str
        The row of :data:`IMPLEMENTATIONS`.
    automatic : bool
        Whether ``"auto"`` chose it (another implementation may then stand in, e.g. for
        forward-mode autodiff, which the blocked one's ``jax.custom_vjp`` lacks).
    block_q, block_k : int or None
        Block sizes of the blocked implementation (``None``: chosen from the shapes).
    why : tuple of str
        For an automatic choice, why each implementation ``"auto"`` prefers to it was
        passed over (what :func:`sdpa_array.explain` shows).
    planned : (Request, Delegation) or None
        The native kernel's call as :func:`choose` planned it for one request: a forward
        call with that request's very inputs and flags runs it without planning again.
    """

    name: str
    automatic: bool = False
    block_q: int | None = None
    block_k: int | None = None
    why: tuple[str, ...] = field(default=(), compare=False)
    planned: tuple[Request, Delegation] | None = field(default=None, compare=False, repr=False)

    @property
    def row(self) -> Row:
        return IMPLEMENTATIONS[self.name]

    def _blocks(self) -> dict[str, int | None]:
        return {"block_q": self.block_q, "block_k": self.block_k} if self.row.takes_blocks else {}

    def forward(self, p: Problem, x: Inputs, outputs: Outputs) -> AttentionResult:
        """Run the forward kernel (the planned native call, when it was planned for
        exactly this request)."""
        if self.planned is not None:
            request, delegation = self.planned
            if request.inputs is x and request.outputs == outputs:
                return delegation.run()
        run = self.row.forward
        x = x.without_padding(p)
        return run(p, x, outputs, **self._blocks())

    def backward(
        self,
        p: Problem,
        x: Inputs,
        grad_output: Array,
        *,
        out: Array = None,
        lse: Array = None,
        grad_lse: Array = None,
    ) -> RawGrads:
        """Run the backward kernel (raw gradients; see :mod:`sdpa_array._kernels.result`), with the
        padding of inputs and cotangents set to zero (:meth:`Inputs.without_padding`)."""
        run = self.row.backward
        if run is None:
            raise ValueError(f"implementation {self.name!r} has no backward kernel")
        x = x.without_padding(p)
        grad_output = p.without_padding(grad_output)
        if grad_lse is not None:
            grad_lse = p.without_padding(grad_lse, features=False)
        return run(p, x, grad_output, out=out, lse=lse, grad_lse=grad_lse, **self._blocks())


def score_bytes(p: Problem) -> int:
    """Bytes of the call's whole score matrix in the compute dtype."""
    return math.prod(p.score_shape) * p.itemsize


def choose(
    p: Problem,
    implementation: str,
    blocks: tuple[int | None, int | None] = (None, None),
    *,
    request: Request | None = None,
    vjp_inputs: Inputs | None = None,
    lse_cotangent: bool = False,
) -> Choice:
    """The implementation that runs the call (see ``implementation`` in the public docs).

    Parameters
    ----------
    p : Problem
        The validated call.
    implementation : str
        The caller's ``implementation=``.
    blocks : (int or None, int or None)
        The caller's ``block_q`` and ``block_k``.
    request : Request, optional
        The forward call's arrays and output flags; ``None`` chooses for the VJP, among
        the implementations that have a backward kernel.
    vjp_inputs : Inputs, optional
        For the VJP: the caller's arrays, which the native and Triton backward kernels need
        to plan their call (without them ``"auto"`` chooses neither).
    lse_cotangent : bool
        For the VJP: whether the backward also receives a log-sum-exp cotangent (the
        autograd wrappers), which torch's native backward kernels cannot take.

    Raises
    ------
    ValueError
        An unknown ``implementation`` (or one without a backward kernel, for the VJP), or
        block sizes that are not positive ints or are given to an implementation that
        takes none.
    CannotDelegateError
        ``"native"`` for a call no native kernel computes exactly (also when ``L`` or ``S``
        is 0, where no kernel would run).
    CannotUseTritonError
        ``"triton"`` for a call the Triton kernels cannot compute here (triton missing, not
        on a GPU, a mask function...).
    """
    names = [n for n, row in IMPLEMENTATIONS.items() if request is not None or row.backward]
    choices = ("auto", *names)
    if not isinstance(implementation, str) or implementation not in choices:
        raise ValueError(f"implementation must be one of {choices}, got {implementation!r}")
    sized = any(b is not None for b in blocks)
    if sized:
        if implementation != "auto" and not IMPLEMENTATIONS[implementation].takes_blocks:
            raise ValueError(
                f"block_q/block_k apply to the blocked implementation, not {implementation!r}"
            )
        check_block_sizes(*blocks)
    if implementation == "auto":
        name, why, delegation = _automatic(p, sized, request, vjp_inputs, lse_cotangent)
        planned = None if delegation is None or request is None else (request, delegation)
        return Choice(name, True, *blocks, why=why, planned=planned)
    if implementation == "native":  # raises CannotDelegateError before any work
        if request is not None:
            planned = (request, plan_native(p, request))
            return Choice(implementation, False, *blocks, planned=planned)
        if vjp_inputs is not None:
            plan_native_vjp(p, vjp_inputs)
    if implementation == "triton":  # raises CannotUseTritonError before any work
        x = request.inputs if request is not None else vjp_inputs
        if x is not None:
            plan_triton(p, x)
    return Choice(implementation, False, *blocks)


def _native_vjp_reason(p: Problem, x: Inputs | None, lse_cotangent: bool) -> str | None:
    """Why the VJP's ``"auto"`` does not differentiate the native kernel (``None``: it
    does): only on a CUDA device, where torch's fused backward kernels run, for calls they
    compute exactly without a mask built for them."""
    if lse_cotangent:
        return "native: a log-sum-exp cotangent, which torch's backward kernels cannot take"
    if x is None:
        return "native: the VJP was planned without the caller's arrays"
    if not p.on_gpu:
        return "native: the library's own backward kernels are used off a GPU"
    try:
        delegation = plan_native_vjp(p, x)
    except CannotDelegateError as exc:
        return f"native: {exc}"
    if delegation.builds_mask:
        return "native: it would need an (L, S) mask built for the call"
    return None


def _triton_reason(p: Problem, x: Inputs) -> str | None:
    """Why ``"auto"`` does not run the Triton kernels (``None``: it does). Only on a GPU:
    under triton's interpreter they run on the CPU too, but only when asked for by name."""
    if not p.on_gpu:
        return "triton: auto uses the Triton kernels on a GPU only"
    try:
        plan_triton(p, x)
    except CannotUseTritonError as exc:
        return f"triton: {exc}"
    return None


def triton_reason(p: Problem, x: Inputs) -> str | None:
    """Why ``"auto"`` does not run the Triton kernels on ``x`` (``None``: it does): the
    forward's and the VJP's rule, which the KV cache's planner (:mod:`.decode`) follows
    too."""
    return _triton_reason(p, x)


def _automatic(
    p: Problem,
    sized: bool,
    request: Request | None,
    vjp_inputs: Inputs | None = None,
    lse_cotangent: bool = False,
) -> tuple[str, tuple[str, ...], Delegation | None]:
    """``"auto"``'s rule, why the candidates before the chosen one were passed over, and
    the native call when it chose one.

    Weights → materialized. On a GPU, torch's native kernel where it computes the call
    exactly without a mask built for it, else the Triton kernels where they apply (CuPy:
    always first); elsewhere native where it applies and stays memory-efficient; else
    blocked for a large score matrix, materialized for a small one. Dask arrays (without
    weights) get the graph of chunk pairs (docs/distributed.md). The VJP follows the same
    order on a GPU (:func:`_native_vjp_reason`, :func:`_triton_reason`).
    """
    if namespace_name(p.xp) == "dask" and (request is None or not request.return_weights):
        return "dask", (), None
    if sized:
        return "blocked", ("block sizes were given",), None
    large = score_bytes(p) > auto_blocked_bytes(p)
    generic = "blocked" if large else "materialized"
    why: list[str] = []
    if request is None:  # the VJP
        reason = _native_vjp_reason(p, vjp_inputs, lse_cotangent)
        if reason is None:
            return "native", (), None
        why.append(reason)
        if vjp_inputs is not None:
            reason = _triton_reason(p, vjp_inputs)
            if reason is None:
                return "triton", tuple(why), None
            why.append(reason)
        return generic, tuple(why), None
    if request.return_weights:  # the weights are the score matrix: form it once
        return "materialized", ("the weights were asked for: the score matrix is formed",), None
    try:
        delegation = plan_native(p, request)
    except CannotDelegateError as exc:
        delegation = None
        why.append(str(exc))
    if delegation is not None:
        costly = delegation.builds_mask or not delegation.memory_efficient
        if not costly or not (large or p.on_gpu):
            return "native", tuple(why), delegation
        why.append(
            f"native: {delegation.kernel} would "
            + ("need an (L, S) mask built" if delegation.builds_mask else "form the scores")
        )
    if p.on_gpu:
        reason = _triton_reason(p, request.inputs)
        if reason is None:
            return "triton", tuple(why), None
        why.append(reason)
        if delegation is not None and not large:
            return "native", tuple(why), delegation
    return generic, tuple(why), None
