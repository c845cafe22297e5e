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
captures (a relative-position table, a temperature). :func:`_with_captured` makes such a
function declare them: under torch the tensors its closure, defaults, partial arguments,
dataclass fields or the globals it names hold (:func:`_held_arrays`; its values on one
element show whether it depends on any other tensor that requires grad), under JAX the
values ``jax.closure_convert`` hoists out of it. The backward kernels then evaluate the
function again on each tile and have the library's autodiff take the tile's score gradient
back to those arrays (``torch.autograd.grad``; ``jax.vjp`` of the function
closure-converted for the tile, with the ``custom_vjp``'s inputs in place of the caller's
tracers), summing the parts: memory stays ``O(block)``. Arrays that autodiff follows and
no wrapper takes (a ``mask_mod``'s, a function's beside declared parameters, JAX integer
tracers, tensors of a ``torch.func`` transform, tensors a function reaches otherwise:
:func:`_mods_hold`, :func:`_with_captured`) still send ``"auto"`` to the materialized
implementation, which the library differentiates whole, and make an explicit blocked
choice raise a ``TypeError``. The arrays of the problem itself (lengths, segment ids, a
seed array) are passed to the JAX wrapper as arguments.

Both wrappers take ``sinks`` like ``bias`` (a differentiable input, ``None`` when absent);
dropout needs nothing saved, since the backward kernel regenerates its keep mask from the
seed in the :class:`~sdpa_array._problem.problem.Problem`. Both wrappers also differentiate the
log-sum-exp output (``d lse_i / d z_ij = P_ij``). This
is the only module that knows torch's and JAX's autodiff APIs.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

from .._arrays.compat import in_library, namespace_name
from .._arrays.typing import Array
from .._kernels.native import Request, plan_native
from .._kernels.result import AttentionResult, finish_gradients
from .._problem.mod_calls import index_grid
from .._problem.mod_parameters import declared_parameters, has_parameters, trainable_mods
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
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
            trained, unexplained = _with_captured(p, _torch_trainable)
            params = _trainable_parameters(trained, _torch_trainable)
            held = unexplained or _mods_hold(trained, _torch_trainable, params)
            if _torch_needs_grad(x) or params or held:
                backward = _torch_backward_choice(choice, p, x, outputs.lse)
                if backward is not None and held:
                    return _materialized_instead(choice, p, x, outputs)
                if backward is not None:
                    return _torch_forward(choice, backward, trained, x, outputs, params)
        if library == "jax" and choice.row.own_autograd:
            trained = p  # nothing traced: nothing to hoist (jax.closure_convert caches)
            if _jax_traced(x) or _mods_hold(p, _jax_tracer):
                trained, _ = _with_captured(p, _jax_tracer)
            params = _trainable_parameters(trained, _jax_tracer, rebuilt=True)
            if _mods_hold(trained, _jax_tracer, params):
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


def _jax_tracer(a: Any) -> bool:
    import jax

    return isinstance(a, jax.core.Tracer)


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


def _torch_trainable(a: Any) -> bool:
    import torch

    return isinstance(a, torch.Tensor) and a.requires_grad


def _materialized_instead(
    choice: Choice, p: Problem, x: Inputs, outputs: Outputs
) -> AttentionResult:
    """The materialized forward, which the library's autodiff differentiates whole, for a
    call whose mods still hold arrays autodiff follows that no wrapper takes as inputs
    (:func:`_mods_hold`: a ``mask_mod``'s, a function's beside declared parameters, a JAX
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


def _held_arrays(obj: Any, autodiff_array: Callable[[Any], bool], depth: int = 4) -> list[Any]:
    """The arrays autodiff follows (``autodiff_array``) that ``obj`` holds: itself, or in
    the fields of a dataclass, the closure, defaults, partial arguments or the globals a
    function names, a bound method's object, tuples and lists, ``depth`` levels deep; each
    once."""
    found: list[Any] = []

    def visit(o: Any, depth: int) -> None:
        if autodiff_array(o):
            if not any(o is a for a in found):
                found.append(o)
            return
        if depth == 0 or o is None or isinstance(o, (str, bytes, int, float, bool)):
            return
        if isinstance(o, (types.ModuleType, type)):
            return
        if isinstance(o, (tuple, list)):
            for part in o:
                visit(part, depth - 1)
            return
        parts: list[Any] = []
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            parts += [getattr(o, f.name) for f in dataclasses.fields(o)]
        parts += [cell.cell_contents for cell in getattr(o, "__closure__", None) or ()]
        parts += list(getattr(o, "__defaults__", None) or ())
        code, names = getattr(o, "__code__", None), getattr(o, "__globals__", None)
        if isinstance(names, dict) and code is not None:
            parts += [names[n] for n in code.co_names if n in names]
        parts += [getattr(o, n, None) for n in ("value", "func", "args", "__self__")]
        keywords = getattr(o, "keywords", None)
        parts += list(keywords.values()) if isinstance(keywords, dict) else []
        for part in parts:
            if part is not o:
                visit(part, depth - 1)

    visit(obj, depth)
    return found


def _mods_hold(
    p: Problem, autodiff_array: Callable[[Any], bool], handled: tuple[Any, ...] = ()
) -> bool:
    """Whether a mask, bias or score function of ``p`` holds an array that autodiff
    follows (``autodiff_array``: a JAX tracer, a torch tensor that requires grad;
    :func:`_held_arrays`) that is not in ``handled`` (the functions' declared parameters,
    inputs of the wrappers). A ``jax.custom_vjp`` cannot close over a tracer, and a
    ``torch.autograd.Function`` would not pass a gradient to such a tensor."""
    return any(
        not any(a is h for h in handled)
        for f in (p.mask_mod, p.bias_mod, p.score_mod)
        for a in _held_arrays(f, autodiff_array)
    )


def _with_captured(p: Problem, autodiff_array: Callable[[Any], bool]) -> tuple[Problem, bool]:
    """``p`` whose ``score_mod`` and ``bias_mod`` of the caller's that declare no
    parameters but capture floating arrays autodiff follows declare those as their
    parameters (:class:`_CapturedTorch`, :class:`_CapturedJax`; ``p`` itself where none
    does), and whether a function's values depend on torch tensors that require grad
    that it does not declare then (found neither by :func:`_held_arrays` nor among its
    parameters: no wrapper could pass them a gradient). The autograd wrappers take the
    declared arrays as inputs, like the ready-made functions' parameters, and the backward
    kernels give their gradients tile by tile."""
    changes: dict[str, Any] = {}
    unexplained = False
    for name in ("score_mod", "bias_mod"):
        mod = getattr(p, name)
        if mod is None:
            continue
        slope = getattr(mod, "derivative", None) if name == "score_mod" else None
        if namespace_name(p.xp) == "torch":
            captured = [] if has_parameters(mod) else _held_arrays(mod, autodiff_array)
            floating = all(p.xp.isdtype(a.dtype, "real floating") for a in captured)
            if floating and not any(_functorch_wrapped(a) for a in captured):
                declared = tuple(captured) or declared_parameters(mod, None)
                if _torch_depends_on_others(mod, _probe(p, name), declared):
                    unexplained = True
                elif captured:
                    changes[name] = _CapturedTorch(mod, tuple(captured), slope)
        elif not has_parameters(mod):
            captured_jax = _jax_captured(mod, slope, _probe(p, name))
            if captured_jax:
                changes[name] = _CapturedJax(mod, captured_jax, slope)
    return (dataclasses.replace(p, **changes) if changes else p), unexplained


def _probe(p: Problem, name: str) -> tuple[Array, ...]:
    """Arguments of ``name`` (``"score_mod"`` or ``"bias_mod"``) for a one-element tile:
    the index arrays (and a zero score)."""
    seq = p.sequence_batch
    heads = p.kernel_batch[len(seq) :]
    probe = index_grid(p.xp, p.device, (1,) * len(seq), (1,) * len(heads), slice(0, 1), slice(0, 1))
    if name != "score_mod":
        return probe
    shape = (1,) * (len(p.kernel_batch) + 2)
    return (p.xp.zeros(shape, dtype=p.compute_dtype, device=p.device), *probe)


def _torch_depends_on_others(
    mod: Callable[..., Any], probe: tuple[Array, ...], declared: tuple[Any, ...]
) -> bool:
    """Whether ``mod``'s values on ``probe``, computed with grad enabled, depend on a
    tensor that requires grad other than ``declared`` (its autograd graph reaches a leaf
    before a declared tensor)."""
    import torch

    with torch.enable_grad():
        values = mod(*probe)
    if not isinstance(values, torch.Tensor) or values.grad_fn is None:
        return False
    nodes_of = [getattr(a, "grad_fn", None) for a in declared]  # arrays of other libraries
    stops = {id(node) for node in nodes_of if node is not None}
    leaves = {id(a) for a, node in zip(declared, nodes_of, strict=True) if node is None}
    seen: set[int] = set()
    nodes: list[Any] = [values.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node
        if leaf is not None:
            if id(leaf) not in leaves:
                return True
            continue
        nodes.extend(n for n, _ in node.next_functions)
    return False


def _functorch_wrapped(a: Any) -> bool:
    """Whether ``a`` is a tensor of a ``torch.func`` transform (which the
    ``torch.autograd.Function`` sees unwrapped level by level, while a closure keeps it)."""
    import torch

    return bool(torch._C._functorch.is_functorch_wrapped_tensor(a))


def _jax_captured(mod: Any, slope: Any, probe: tuple[Array, ...]) -> tuple[Any, ...]:
    """The values that ``jax.closure_convert`` hoists out of ``mod`` and its derivative
    ``slope`` (or ``None``) called on ``probe``: the tracers their values may depend on,
    each once."""
    import jax

    captured: list[Any] = []
    for f in (mod, slope):
        if f is not None:
            for c in jax.closure_convert(f, *probe)[1]:
                if not any(c is a for a in captured):
                    captured.append(c)
    return tuple(captured)


@dataclasses.dataclass(frozen=True, eq=False)
class _Captured:
    """A caller's bias or score function whose captured arrays are its declared
    parameters (the protocol of :mod:`~sdpa_array._problem.mod_parameters`).

    ``parameter_cotangents`` evaluates the function again on the tile and has the
    library's autodiff take the cotangent back to the captured arrays, so that memory
    stays that of a tile.

    Attributes
    ----------
    mod : callable
        The caller's function.
    captured : tuple of array
        The arrays it captures that autodiff follows.
    slope : callable or None
        A score function's ``derivative`` method, where it has one.
    """

    mod: Callable[..., Any]
    captured: tuple[Any, ...]
    slope: Callable[..., Any] | None = None

    def __repr__(self) -> str:
        return getattr(self.mod, "__qualname__", None) or repr(self.mod)

    @property
    def parameters(self) -> tuple[Any, ...]:
        return self.captured

    @property
    def derivative(self) -> Callable[..., Any] | None:
        return self.slope

    def __call__(self, *args: Any) -> Any:
        return self.mod(*args)


class _CapturedTorch(_Captured):
    """:class:`_Captured` under torch: the function is kept as it is (it closes over the
    tensors themselves); their gradients come from ``torch.autograd.grad`` of its values
    on each tile."""

    def parameter_cotangents(self, cotangent: Any, *args: Any) -> tuple[Any, ...]:
        """``sum(cotangent * d values / d a)`` for each captured tensor ``a``, in the
        cotangent's dtype; differentiable where a graph is being built (double backward)."""
        import torch

        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            values = self.mod(*args)
            grads: tuple[Any, ...] = (None,) * len(self.captured)
            if values.requires_grad:
                values = values.to(cotangent.dtype).expand(cotangent.shape)
                grads = torch.autograd.grad(
                    values,
                    self.captured,
                    grad_outputs=cotangent,
                    allow_unused=True,
                    create_graph=create_graph,
                )
        return tuple(
            torch.zeros(a.shape, dtype=cotangent.dtype, device=cotangent.device)
            if g is None
            else g.to(cotangent.dtype)
            for g, a in zip(grads, self.captured, strict=True)
        )


@dataclasses.dataclass(frozen=True, eq=False)
class _CapturedJax(_Captured):
    """:class:`_Captured` under JAX: the captured tracers may be other arrays
    (``given``, from :meth:`with_parameters`: the ``jax.custom_vjp``'s own inputs). Each
    call converts the function for its arguments' shapes with ``jax.closure_convert`` and
    evaluates it with ``given`` in place of the captured tracers, so the tracers of the
    caller's trace are never used inside the ``custom_vjp``."""

    given: tuple[Any, ...] = ()

    @property
    def parameters(self) -> tuple[Any, ...]:
        return self.given or self.captured

    @property
    def derivative(self) -> Callable[..., Any] | None:
        slope = self.slope
        return None if slope is None else functools.partial(self._evaluate, slope, self.given)

    def with_parameters(self, *arrays: Any) -> _CapturedJax:
        """The same function, evaluated with ``arrays`` in place of the captured ones."""
        return dataclasses.replace(self, given=arrays)

    def _evaluate(self, f: Callable[..., Any], given: tuple[Any, ...], *args: Any) -> Any:
        """``f(*args)`` with ``given`` in place of the captured tracers (none: ``f``
        itself)."""
        if not given:
            return f(*args)
        import jax

        converted, consts = jax.closure_convert(f, *args)
        stand_ins = []
        for c in consts:
            at = [i for i, a in enumerate(self.captured) if c is a]
            stand_ins.append(given[at[0]] if at else c)
        return converted(*args, *stand_ins)

    def __call__(self, *args: Any) -> Any:
        return self._evaluate(self.mod, self.given, *args)

    def parameter_cotangents(self, cotangent: Any, *args: Any) -> tuple[Any, ...]:
        """``sum(cotangent * d values / d a)`` for each parameter ``a`` (``jax.vjp`` of the
        function's values on the tile), in the cotangent's dtype."""
        import jax
        import jax.numpy as jnp

        def values(*params: Any) -> Any:
            v = self._evaluate(self.mod, params, *args)
            return jnp.broadcast_to(v.astype(cotangent.dtype), cotangent.shape)

        _, pullback = jax.vjp(values, *self.parameters)
        return tuple(g.astype(cotangent.dtype) for g in pullback(cotangent))


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
    their captured tracers, :func:`_with_captured`), whose parameters are ``params``; ``p``
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
