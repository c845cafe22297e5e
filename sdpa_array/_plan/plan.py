"""One plan per call: the validated problem, the arrays, the outputs asked for and the
implementation (with its native kernel, when it delegates) that will compute them.

The public functions and :func:`~sdpa_array.explain` plan a call here, once; the plan is
what runs (the native kernel planned for it is the one that runs, not planned again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .._arrays.typing import Array
from .._kernels.native import Request, plan_native, plan_native_vjp
from .._kernels.tile_summary import (
    BackwardTileSummary,
    TileSummary,
    summarize_backward_tiles,
    summarize_tiles,
)
from .._problem.options import Options
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem, validate
from . import cache
from .dispatch import Choice, choose

__all__ = [
    "BackwardTileSummary",
    "Plan",
    "TileSummary",
    "backward_tiles_of",
    "native_vjp_kernel",
    "plan_forward",
    "plan_vjp",
    "tiles_of",
]


@dataclass(frozen=True, eq=False)
class Plan:
    """A call, planned.

    Attributes
    ----------
    problem : Problem
        The validated shapes, dtypes and options.
    inputs : Inputs
        The caller's arrays.
    outputs : Outputs or None
        What the forward call returns (``None`` for a VJP).
    choice : Choice
        The implementation, its block sizes, the native kernel it runs (``planned``) and,
        for ``"auto"``, why the ones it prefers were passed over.
    """

    problem: Problem
    inputs: Inputs
    outputs: Outputs | None
    choice: Choice

    @property
    def empty(self) -> bool:
        """Whether there is no query or no key (no kernel runs)."""
        return self.problem.L == 0 or self.problem.S == 0


def plan_forward(
    query: Array,
    key: Array,
    value: Array,
    options: Options,
    outputs: Outputs,
    implementation: str,
    blocks: tuple[int | None, int | None],
    *,
    problem: Problem | None = None,
) -> Plan:
    """Validate a forward call (or take its ``problem``, already validated) and choose what
    computes it; a call whose signature was planned before takes that plan
    (:mod:`.cache`)."""
    sig = None
    if problem is None:
        sig = cache.signature(query, key, value, options, outputs, implementation, blocks)
        kept = None if sig is None else cache.lookup(sig)
        if kept is not None:
            p, choice = kept
            x = Inputs.of(query, key, value, options, p)
            if choice.name == "native":  # the kernel's call holds this call's arrays
                request = Request(x, outputs)
                choice = dataclasses.replace(choice, planned=(request, plan_native(p, request)))
                cache.keep_direct(x, options, outputs, implementation, blocks, choice)
            return Plan(p, x, outputs, choice)
    p = validate(query, key, value, options) if problem is None else problem
    x = Inputs.of(query, key, value, options, p)
    request = Request(x, outputs)
    choice = choose(p, implementation, blocks, request=request)
    if sig is not None:
        cache.store(sig, p, choice)
        cache.keep_direct(x, options, outputs, implementation, blocks, choice)
    return Plan(p, x, outputs, choice)


def plan_vjp(
    query: Array,
    key: Array,
    value: Array,
    options: Options,
    implementation: str,
    blocks: tuple[int | None, int | None],
    *,
    problem: Problem | None = None,
) -> Plan:
    """Validate a VJP call (or take its ``problem``, already validated) and choose what
    computes it."""
    p = validate(query, key, value, options) if problem is None else problem
    x = Inputs.of(query, key, value, options, p)
    return Plan(p, x, None, choose(p, implementation, blocks, vjp_inputs=x))


def native_vjp_kernel(p: Problem, x: Inputs) -> str:
    """The native kernel whose backward a VJP planned ``"native"`` for ``p`` runs."""
    return plan_native_vjp(p, x).kernel


def tiles_of(plan: Plan) -> TileSummary | None:
    """The tiles a forward plan's blocked kernel visits and skips; ``None`` for another
    implementation or an empty call."""
    if plan.choice.name != "blocked" or plan.empty:
        return None
    return summarize_tiles(plan.problem, plan.inputs, plan.choice.block_q, plan.choice.block_k)


def backward_tiles_of(plan: Plan) -> BackwardTileSummary | None:
    """The tiles a VJP plan's blocked kernel visits and skips; ``None`` for another
    implementation or an empty call."""
    if plan.choice.name != "blocked" or plan.empty:
        return None
    p, x, choice = plan.problem, plan.inputs, plan.choice
    return summarize_backward_tiles(p, x, choice.block_q, choice.block_k)
