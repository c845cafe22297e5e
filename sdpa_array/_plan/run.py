"""Running a planned call: what the public functions do once their arguments are checked.

:func:`run_forward` and :func:`run_vjp` take a heads-first call (``"BHLE"``) and, where the
caller has it, its validated :class:`~sdpa_array._problem.problem.Problem`; they plan it
(:mod:`sdpa_array._plan.plan`), run the chosen kernel and finish the result. The public
forward and VJP functions and the packed variable-length ones (one call per sequence) end
here; :func:`zero_gradients` is the gradients of a call whose output no key reaches.
"""

from __future__ import annotations

from typing import Any

from .._arrays.parallel import release_pool
from .._arrays.products import release_scratch
from .._arrays.typing import Array
from .._kernels.mod_terms import score_mod_derivable
from .._kernels.result import empty_result, finalize, finish_gradients, zero_gradients
from .._kernels.tiling import clear_band_plans
from .._problem.options import Options
from .._problem.outputs import Outputs
from .._problem.problem import Problem
from . import autograd as _autograd
from . import cache
from .plan import plan_forward, plan_vjp

__all__ = ["release_kept", "run_forward", "run_vjp", "zero_gradients"]


def run_forward(
    query: Array,
    key: Array,
    value: Array,
    options: Options,
    outputs: Outputs,
    implementation: str,
    blocks: tuple[int | None, int | None],
    problem: Problem | None = None,
) -> Any:
    """Plan a heads-first call (validating it, unless its ``problem`` is given), run it and
    return the public function's result: the output, then what ``outputs`` asks for."""
    plan = plan_forward(
        query, key, value, options, outputs, implementation, blocks, problem=problem
    )
    p = plan.problem
    if plan.empty:
        result = empty_result(p, plan.inputs.sinks)
    else:
        result = _autograd.forward(plan.choice, p, plan.inputs, outputs)
    return finalize(p, result, outputs)


def run_vjp(
    query: Array,
    key: Array,
    value: Array,
    grad_output: Array,
    options: Options,
    implementation: str,
    blocks: tuple[int | None, int | None],
    problem: Problem,
    *,
    out: Array = None,
    lse: Array = None,
) -> tuple[Array, ...]:
    """Plan a heads-first VJP call of a validated ``problem`` (``grad_output`` already
    checked against it), run its backward and return the public function's gradients.
    ``out`` and ``lse`` (both or neither): the output and log-sum-exp the probabilities
    come from, ``P = exp(Z - lse)`` and ``D = rowsum(dO * out)``, instead of a forward
    pass or each row's own softmax. A ``score_mod`` without a derivative on a library
    without autodiff is a ``TypeError`` here, before any work."""
    score_mod_derivable(problem)
    plan = plan_vjp(query, key, value, options, implementation, blocks, problem=problem)
    if plan.empty:  # nothing reaches the output: every gradient is zero
        return zero_gradients(problem, plan.inputs)
    grads = plan.choice.backward(problem, plan.inputs, grad_output, out=out, lse=lse)
    return finish_gradients(problem, plan.inputs, grads)


def release_kept() -> None:
    """Drop what the planner and the kernels keep between calls: the kept plans of repeated
    calls and of causal and window tilings, the NumPy products' scratch buffers and the
    threads of the NumPy block pool (later calls make them again)."""
    release_scratch()
    cache.clear()
    clear_band_plans()
    release_pool()
