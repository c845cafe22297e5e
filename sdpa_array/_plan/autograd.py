"""Autograd through our backward kernels: a ``torch.autograd.Function`` and a ``jax.custom_vjp``.

The materialized and native implementations are compositions of the library's own
differentiable operations (or its fused kernel), so torch and JAX differentiate them by
themselves. An implementation whose :class:`~sdpa_array._plan.dispatch.Row` says
``own_autograd`` (the blocked one) could be differentiated that way too, but the library
would keep every tile's probabilities for the backward pass, and the tiles add up to the
whole score matrix. So when it runs on torch tensors that require grad, or on JAX tracers,
:func:`forward` runs it as one opaque operation that keeps only its inputs, its output (in
the compute dtype) and its log-sum-exp, and whose backward pass is the implementation's own
backward kernel: memory stays ``O(block)`` in training. Calls delegated to a torch
kernel that returns the log-sum-exp (CPU or CUDA) go through the same operation, with the
VJP's automatic choice of backward kernel, because torch differentiates neither that
log-sum-exp nor the kernel's backward.

* torch: the ``forward`` / ``setup_context`` / ``backward`` form with
  ``generate_vmap_rule``, so ``torch.func.grad``, ``torch.func.vmap`` and their
  compositions work. The backward kernel is written with differentiable torch operations
  and changes no tensor that takes part in autograd in place, so when a graph is being
  created (``create_graph=True``, ``torch.func.grad`` of a gradient) the gradients are
  themselves differentiable: double backward is exact. Forward mode through the wrapper
  (``torch.func.hessian`` of a loss of the call) raises torch's ``NotImplementedError``
  (no ``jvp``); the materialized implementation supports it. A fused kernel's backward (the
  Triton one) builds no graph: then the blocked backward kernel runs instead.
* JAX: a ``jax.custom_vjp``, which works under ``jit``, ``vmap`` and ``grad`` (reverse
  mode, to any order). A ``custom_vjp`` has no forward mode: under ``jax.jvp`` or
  ``jax.jacfwd``, a call that ``implementation="auto"`` sent to the blocked path runs the
  materialized one instead (JAX differentiates it in both modes); an explicit
  ``implementation="blocked"`` raises a ``TypeError`` that says so.

Trainable data of the bias and score functions are inputs of both wrappers, whose backward
passes return their gradients (:mod:`~sdpa_array._problem.mod_parameters`): the parameters
the ready-made functions declare, and the floating arrays autodiff follows (torch tensors
that require grad, JAX tracers) that a ``bias_mod`` or ``score_mod`` of the caller's
captures (a relative-position table, a temperature). :func:`with_captured` makes such a
function declare them: under torch the tensors its closure, defaults, partial arguments,
dataclass fields or the globals it names hold (:func:`held_arrays`; its values on one
element show whether it depends on any other tensor that requires grad), under JAX the
values ``jax.closure_convert`` hoists out of it. The backward kernels then evaluate the
function again on each tile and have the library's autodiff take the tile's score gradient
back to those arrays (``torch.autograd.grad``; ``jax.vjp`` of the function
closure-converted for the tile, with the ``custom_vjp``'s inputs in place of the caller's
tracers), summing the parts: memory stays ``O(block)``. Arrays that autodiff follows and
no wrapper takes (a ``mask_mod``'s, a function's beside declared parameters, JAX integer
tracers, tensors of a ``torch.func`` transform, tensors a function reaches otherwise:
:func:`.captured.mods_hold`, :func:`.captured.with_captured`) still send ``"auto"`` to
the materialized implementation, which the library differentiates whole, and make an
explicit blocked choice raise a ``TypeError``. The arrays of the problem itself (lengths,
segment ids, a seed array) are passed to the JAX wrapper as arguments.

Both wrappers take ``sinks`` like ``bias`` (a differentiable input, ``None`` when absent);
dropout needs nothing saved, since the backward kernel regenerates its keep mask from the
seed in the :class:`~sdpa_array._problem.problem.Problem`. Both wrappers also differentiate the
log-sum-exp output (``d lse_i / d z_ij = P_ij``). This module and :mod:`.captured` are
the only ones that know torch's and JAX's autodiff APIs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from .._arrays.compat import in_library, namespace_name
from .._arrays.typing import Array
from .._kernels.native import Request, plan_native
from .._kernels.result import AttentionResult, finish_gradients
from .._problem.mod_parameters import declared_parameters, trainable_mods
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .captured import jax_tracer, mods_hold, torch_trainable, with_captured
from .dispatch import Choice, choose

__all__ = ["forward"]


def forward(choice: Choice, p: Problem, x: Inputs, outputs: Outputs) -> AttentionResult:
    """Run ``choice``'s forward kernel, through an autograd wrapper where one is needed.

    The wrapper runs when the row says ``own_autograd``, the arrays need gradients (torch
    tensors with ``requires_grad`` while grad mode is on, JAX tracers) and the weights are
    not asked for (they are the score matrix anyway, so the library's own autodiff of the
    materialized fallback is as good). The maximum scores are a statistic, never
    differentiated on any path: a detached torch tensor, ``jax.lax.stop_gradient`` in JAX.
    """
    result = _forward(choice, p, x, outputs)
    if result.row_maxima is None:
        return result
    return dataclasses.replace(result, row_maxima=_statistic(p, result.row_maxima))


def _forward(choice: Choice, p: Problem, x: Inputs, outputs: Outputs) -> AttentionResult:
    if not outputs.weights:
        library = namespace_name(p.xp)
        if library == "torch" and _torch_grad_enabled():
            trained, unexplained = with_captured(p, torch_trainable)
            params = _trainable_parameters(trained, torch_trainable)
            held = unexplained or mods_hold(trained, torch_trainable, params)
            if _torch_needs_grad(x) or params or held:
                backward = _torch_backward_choice(choice, p, x, outputs.lse)
                if backward is not None and held:
                    return _materialized_instead(choice, p, x, outputs)
                if backward is not None:
                    return _torch_forward(choice, backward, trained, x, outputs, params)
        if library == "jax" and choice.row.own_autograd:
            trained = p  # nothing traced: nothing to hoist (jax.closure_convert caches)
            if _jax_traced(x) or mods_hold(p, jax_tracer):
                trained, _ = with_captured(p, jax_tracer)
            params = _trainable_parameters(trained, jax_tracer, rebuilt=True)
            if mods_hold(trained, jax_tracer, params):
                return _materialized_instead(choice, p, x, outputs)
            if _jax_traced(x) or params:
                return _jax_forward(choice, p, trained, x, outputs, params)
    return choice.forward(p, x, outputs)


def _trainable_parameters(
    p: Problem, autodiff_array: Callable[[Any], bool], *, rebuilt: bool = False
) -> tuple[Any, ...]:
    """The declared parameters of ``score_mod`` and ``bias_mod``
    (:func:`~sdpa_array._problem.mod_parameters.declared_parameters`) when autodiff follows
    one of them (then they are inputs of the wrappers, which return their gradients), else
    ``()``, and ``()`` where one is not an array of the inputs' library (a wrapper could not
    take it as an input). ``rebuilt``: the wrapper rebuilds the functions with their own (traced)
    parameters, so each must have ``with_parameters`` (JAX)."""
    trainable = trainable_mods(p.score_mod, p.bias_mod)
    if rebuilt and not all(hasattr(mod, "with_parameters") for _, mod in trainable):
        return ()
    params = declared_parameters(p.score_mod, p.bias_mod)
    if not all(in_library(p.xp, a) for a in params):  # the library differentiates whole
        return ()
    return params if any(autodiff_array(a) for a in params) else ()


def _torch_grad_enabled() -> bool:
    import torch

    return bool(torch.is_grad_enabled())


def _statistic(p: Problem, a: Array) -> Array:
    """``a`` cut from autodiff (torch: detached; JAX: ``stop_gradient``)."""
    library = namespace_name(p.xp)
    if library == "torch":
        return a.detach()
    if library == "jax":
        import jax

        return jax.lax.stop_gradient(a)
    return a


def _torch_backward_choice(
    choice: Choice, p: Problem, x: Inputs, return_lse: bool
) -> Choice | None:
    """Whose backward kernel differentiates ``choice`` under torch (``None``: torch's own).

    The implementation's own, when its row says ``own_autograd``; the VJP's automatic
    choice when ``choice`` delegates the log-sum-exp to a torch kernel whose log-sum-exp
    torch does not differentiate (a loss on it would silently lose that gradient) or whose
    backward torch cannot differentiate again (so that double backward works): torch's
    kernels that return the log-sum-exp, on the CPU and on CUDA.
    """
    if choice.row.own_autograd:
        return choice
    if choice.name == "native" and return_lse:
        delegation = plan_native(p, Request(x, Outputs(lse=True)))
        if not (delegation.lse_differentiable and delegation.twice_differentiable):
            return choose(p, "auto", vjp_inputs=x, lse_cotangent=True)
    return None


def _torch_needs_grad(x: Inputs) -> bool:
    return any(a.requires_grad for a in x.differentiable)


def _jax_traced(x: Inputs) -> bool:
    import jax

    return any(isinstance(a, jax.core.Tracer) for a in x.differentiable)


def _with_scale(p: Problem, scale: Array) -> Problem:
    """``p`` with the scale array the autodiff wrapper hands its function (if any)."""
    return p if scale is None else dataclasses.replace(p, scale=scale)


def _problem_arrays(p: Problem) -> tuple[Array, ...]:
    """The arrays inside ``p`` that may be traced under ``jax.jit``: the lengths, the
    segment ids and a seed array. A ``jax.custom_vjp`` function may not close over a
    tracer, so the wrapper passes them as arguments (:func:`_with_arrays` puts them back)."""
    ql, kl, seg = p.query_lengths, p.key_lengths, p.segments
    seed = None if isinstance(p.dropout_seed, int) else p.dropout_seed
    return (
        None if ql is None else ql.array,
        None if kl is None else kl.array,
        None if seg is None else seg.query,
        None if seg is None else seg.key,
        seed,
    )


def _materialized_instead(
    choice: Choice, p: Problem, x: Inputs, outputs: Outputs
) -> AttentionResult:
    """The materialized forward, which the library's autodiff differentiates whole, for a
    call whose mods still hold arrays autodiff follows that no wrapper takes as inputs
    (:func:`mods_hold`: a ``mask_mod``'s, a function's beside declared parameters, a JAX
    integer tracer). ``TypeError`` for an explicit choice."""
    if not choice.automatic:
        raise TypeError(
            f"implementation={choice.name!r} cannot differentiate this call: its mask_mod, "
            "bias_mod or score_mod depends on traced arrays or tensors that require grad "
            "that its autodiff wrapper cannot take as inputs (it takes those a bias_mod or "
            "score_mod declares, or holds in its closure, defaults, partial arguments, "
            "dataclass fields or globals; not a mask_mod's, nor tensors of a torch.func "
            "transform): pass such data as constants, or use "
            "implementation='materialized' (or 'auto', which then runs it)"
        )
    return Choice("materialized", automatic=True).forward(p, x, outputs)


def _with_arrays(p: Problem, arrays: tuple[Array, ...]) -> Problem:
    """``p`` holding ``arrays`` (from :func:`_problem_arrays`) in their places."""
    ql, kl, seg_q, seg_k, seed = arrays
    replace = dataclasses.replace
    q_lengths, k_lengths, segments = p.query_lengths, p.key_lengths, p.segments
    return replace(
        p,
        query_lengths=None if q_lengths is None else replace(q_lengths, array=ql),
        key_lengths=None if k_lengths is None else replace(k_lengths, array=kl),
        segments=None if segments is None else replace(segments, query=seg_q, key=seg_k),
        dropout_seed=p.dropout_seed if seed is None else seed,
    )


def _out_and_lse(choice: Choice, p: Problem, x: Inputs, maxima: bool) -> tuple[Array, ...]:
    """``(out, lse)``, and the rows' maxima with ``maxima``."""
    r = choice.forward(p, x, Outputs(lse=True, max_scores=maxima))
    return (r.out, r.lse, r.row_maxima) if maxima else (r.out, r.lse)


def _gradients(
    choice: Choice,
    p: Problem,
    x: Inputs,
    out: Array,
    lse: Array,
    grad_out: Array,
    grad_lse: Array,
) -> tuple[Array, ...]:
    """``(dq, dk, dv, dbias, dsinks, dscale, *dparameters)`` from the backward kernel
    (``None`` for no input; the gradients of the mods' parameters where
    ``p.mod_gradients``)."""
    raw = choice.backward(p, x, grad_out, out=out, lse=lse, grad_lse=grad_lse)
    grads = iter(finish_gradients(p, x, raw))
    dq, dk, dv = next(grads), next(grads), next(grads)
    dbias = None if x.bias is None else next(grads)
    dsinks = None if x.sinks is None else next(grads)
    dscale = None if x.scale is None else next(grads)
    return dq, dk, dv, dbias, dsinks, dscale, *grads


def _with_parameters(p: Problem, params: tuple[Any, ...]) -> Problem:
    """``p`` whose ``score_mod`` and ``bias_mod`` hold ``params`` (traced ones, under JAX;
    :func:`_trainable_parameters`' order) and whose backward gives their gradients; ``p``
    itself without parameters.

    Under torch the saved parameters may be other tensors holding the same values (saved
    tensors hooks unpack copies): a function without ``with_parameters`` is kept as it is.
    """
    if not params:
        return p
    changes: dict[str, Any] = {"mod_gradients": True}
    rest = iter(params)
    for name, mod in trainable_mods(p.score_mod, p.bias_mod):
        own = tuple(mod.parameters)
        given = tuple(next(rest) for _ in own)
        rebuild = getattr(mod, "with_parameters", None)
        if rebuild is not None and any(a is not b for a, b in zip(given, own, strict=True)):
            changes[name] = rebuild(*given)
    return dataclasses.replace(p, **changes)


@functools.cache
def _torch_function() -> Any:
    """The ``torch.autograd.Function`` (defined on first use: torch is optional)."""
    import torch

    class OwnBackward(torch.autograd.Function):
        """Attention whose backward pass is the implementation's backward kernel."""

        generate_vmap_rule = True

        @staticmethod
        def forward(
            query: Any,
            key: Any,
            value: Any,
            bias: Any,
            sinks: Any,
            scale: Any,
            mask: Any,
            p: Problem,
            choice: Choice,
            backward: Choice,
            maxima: bool,
            *params: Any,
        ) -> tuple[Any, ...]:
            x = Inputs(query, key, value, mask, bias, scale, sinks)
            # the mods hold the tensors given here (functorch wraps them per level)
            trained = _with_parameters(_with_scale(p, scale), params)
            trained = dataclasses.replace(trained, mod_gradients=p.mod_gradients)
            return _out_and_lse(choice, trained, x, maxima)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
            query, key, value, bias, sinks, scale, mask, p, _, backward, _, *params = inputs
            out, lse = output[:2]
            if len(output) == 3:  # the rows' maxima: a statistic
                ctx.mark_non_differentiable(output[2])
            ctx.save_for_backward(query, key, value, bias, sinks, scale, mask, out, lse, *params)
            ctx.p, ctx.backward_choice = p, backward
            ctx.set_materialize_grads(False)

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any, *_: Any) -> tuple[Any, ...]:
            query, key, value, bias, sinks, scale, mask, out, lse, *params = ctx.saved_tensors
            if grad_out is None:
                grad_out = torch.zeros_like(out)
            x = Inputs(query, key, value, mask, bias, scale, sinks)
            p = _with_parameters(_with_scale(ctx.p, scale), tuple(params))
            choice = ctx.backward_choice
            if torch.is_grad_enabled() and not choice.row.differentiable_backward:
                # a graph of the gradients is being built (double backward): a fused
                # kernel's gradients have none, so the blocked kernel computes them
                choice = Choice("blocked")
            dq, dk, dv, dbias, dsinks, dscale, *dparams = _gradients(
                choice, p, x, out, lse, grad_out, grad_lse
            )
            return (dq, dk, dv, dbias, dsinks, dscale, None, None, None, None, None, *dparams)

    return OwnBackward


def _torch_forward(
    choice: Choice,
    backward: Choice,
    p: Problem,
    x: Inputs,
    outputs: Outputs,
    params: tuple[Any, ...] = (),
) -> AttentionResult:
    function = _torch_function()
    out, lse, *maxima = function.apply(
        x.query,
        x.key,
        x.value,
        x.bias,
        x.sinks,
        x.scale,
        x.mask,
        p,
        choice,
        backward,
        outputs.max_scores,
        *params,
    )
    return AttentionResult(
        out=out, lse=lse if outputs.lse else None, row_maxima=maxima[0] if maxima else None
    )


def _jax_forward(
    choice: Choice,
    p: Problem,
    trained_p: Problem,
    x: Inputs,
    outputs: Outputs,
    params: tuple[Any, ...] = (),
) -> AttentionResult:
    """The ``jax.custom_vjp`` of ``choice`` on ``trained_p`` (``p`` whose functions declare
    their captured tracers, :func:`with_captured`), whose parameters are ``params``; ``p``
    itself for the materialized fallback under forward mode."""
    import jax

    maxima = outputs.max_scores
    arrays = _problem_arrays(trained_p)

    def problem(scale: Any, trained: tuple[Any, ...], held: tuple[Any, ...]) -> Problem:
        return _with_arrays(_with_parameters(_with_scale(trained_p, scale), trained), held)

    @jax.custom_vjp
    def attention(
        query: Any,
        key: Any,
        value: Any,
        mask: Any,
        bias: Any,
        sinks: Any,
        scale: Any,
        trained: tuple[Any, ...],
        *held: Any,
    ) -> tuple[Any, ...]:
        return fwd(query, key, value, mask, bias, sinks, scale, trained, *held)[0]

    def fwd(
        query: Any,
        key: Any,
        value: Any,
        mask: Any,
        bias: Any,
        sinks: Any,
        scale: Any,
        trained: tuple[Any, ...],
        *held: Any,
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        x = Inputs(query, key, value, mask, bias, scale, sinks)
        results = _out_and_lse(choice, problem(scale, trained, held), x, maxima)
        out, lse = results[:2]
        return results, (query, key, value, mask, bias, sinks, scale, trained, out, lse, held)

    def bwd(saved: tuple[Any, ...], cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        query, key, value, mask, bias, sinks, scale, trained, out, lse, held = saved
        grad_out, grad_lse = cotangents[:2]  # the rows' maxima are a statistic
        x = Inputs(query, key, value, mask, bias, scale, sinks)
        dq, dk, dv, dbias, dsinks, dscale, *dparams = _gradients(
            choice, problem(scale, trained, held), x, out, lse, grad_out, grad_lse
        )
        return dq, dk, dv, None, dbias, dsinks, dscale, tuple(dparams), *(None for _ in held)

    attention.defvjp(fwd, bwd)
    try:
        out, lse, *rest = attention(
            x.query, x.key, x.value, x.mask, x.bias, x.sinks, x.scale, params, *arrays
        )
    except TypeError as exc:
        if "forward-mode" not in str(exc):
            raise
        if not choice.automatic:
            raise TypeError(
                f"implementation={choice.name!r} is differentiated in reverse mode only (its "
                "jax.custom_vjp saves O(block) memory); for jax.jvp, jax.jacfwd or "
                "jax.hessian use implementation='materialized' (or 'auto')"
            ) from exc
        return Choice("materialized", automatic=True).forward(p, x, outputs)
    return AttentionResult(
        out=out, lse=lse if outputs.lse else None, row_maxima=rest[0] if rest else None
    )
