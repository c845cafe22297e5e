"""The arrays a caller's mask, bias or score function captures that autodiff follows.

A ``bias_mod`` or ``score_mod`` of the caller's may close over a torch tensor that requires
grad or a traced JAX array (a relative-position table, a temperature). :func:`with_captured`
makes such captured floating arrays the function's declared parameters (a torch function
re-evaluated on each tile under ``torch.enable_grad``, a JAX function converted with
``jax.closure_convert``), so that the autograd wrappers of :mod:`.autograd` take them as
inputs and the backward kernels give their gradients tile by tile, in ``O(block)`` memory.
:func:`held_arrays` and :func:`mods_hold` find what a function holds, for the cases no
wrapper can take.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

from .._arrays.compat import namespace_name
from .._arrays.typing import Array
from .._problem.mod_calls import index_grid
from .._problem.mod_parameters import declared_parameters, has_parameters
from .._problem.problem import Problem

__all__ = ["held_arrays", "jax_tracer", "mods_hold", "torch_trainable", "with_captured"]


def torch_trainable(a: Any) -> bool:
    """Whether ``a`` is a torch tensor that requires grad (what torch's autograd follows)."""
    import torch

    return isinstance(a, torch.Tensor) and a.requires_grad


def jax_tracer(a: Any) -> bool:
    """Whether ``a`` is a JAX tracer (what JAX's transformations follow)."""
    import jax

    return isinstance(a, jax.core.Tracer)


def held_arrays(obj: Any, autodiff_array: Callable[[Any], bool], depth: int = 4) -> list[Any]:
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


def mods_hold(
    p: Problem, autodiff_array: Callable[[Any], bool], handled: tuple[Any, ...] = ()
) -> bool:
    """Whether a mask, bias or score function of ``p`` holds an array that autodiff
    follows (``autodiff_array``: a JAX tracer, a torch tensor that requires grad;
    :func:`held_arrays`) that is not in ``handled`` (the functions' declared parameters,
    inputs of the wrappers). A ``jax.custom_vjp`` cannot close over a tracer, and a
    ``torch.autograd.Function`` would not pass a gradient to such a tensor."""
    return any(
        not any(a is h for h in handled)
        for f in (p.mask_mod, p.bias_mod, p.score_mod)
        for a in held_arrays(f, autodiff_array)
    )


def with_captured(p: Problem, autodiff_array: Callable[[Any], bool]) -> tuple[Problem, bool]:
    """``p`` whose ``score_mod`` and ``bias_mod`` of the caller's that declare no
    parameters but capture floating arrays autodiff follows declare those as their
    parameters (:class:`_CapturedTorch`, :class:`_CapturedJax`; ``p`` itself where none
    does), and whether a function's values depend on torch tensors that require grad
    that it does not declare then (found neither by :func:`held_arrays` nor among its
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
            captured = [] if has_parameters(mod) else held_arrays(mod, autodiff_array)
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
