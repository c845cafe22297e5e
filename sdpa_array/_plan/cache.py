"""Plans of repeated calls: validation and the choice of kernel, once per signature.

A call whose arrays are eager NumPy arrays, torch tensors or CuPy arrays
(:func:`~sdpa_array._arrays.compat.plain_signature`) and whose every option is ``None``, a
number, a string or a tuple of those
(:meth:`~sdpa_array._problem.options.Options.scalar_signature`) is validated by what its
signature says: the three arrays' types, shapes, dtypes, devices and whether they require a
gradient, the typed options, the outputs asked for, the implementation and the block sizes.
The first call of a signature is validated and dispatched as any call, and its
:class:`~sdpa_array._problem.problem.Problem` and :class:`~sdpa_array._plan.dispatch.Choice`
are kept here; a later call of the same signature takes them and plans only what holds its
own arrays (a native kernel's call). This is what makes a small torch call through
``"auto"`` cost a few microseconds of planning.

Calls with an array or a function among their options (a mask, lengths as arrays, a bias
function...), calls on other libraries, and Triton choices (whose planning reads the device)
are planned every time. At most :data:`MAX_ENTRIES` signatures are kept, the least recently
used dropped first; :func:`clear` forgets them all, and must be called after changing the
dispatch's own settings (its thresholds, the native kernels' table), which a kept plan does
not read again.

*KV-cache calls.* :func:`~sdpa_array._plan.decode.plan_decode` keeps, by the cache call's
signature (:func:`~sdpa_array._plan.decode.call_signature`), what the call's checks found,
whether the Triton decoding kernel takes it and the split rule's chunk length
(:func:`lookup_decode`, :func:`store_decode`); the lengths, starts and block table are
checked, and the rest of the plan made, on every call. A *plain* cache call (contiguous,
no new tokens, lengths given as a list of ints, options of simple values, the output alone
asked for) planned as one forward call over the cache's tokens keeps that call's span and
keywords by the arrays' signatures, the lengths' values and the options
(:func:`keep_decode_direct`, :func:`decode_direct`): the same call again, whose checks and
plan would find the same, makes that forward call at once.

*Direct calls.* Where such a plan delegates the whole call to one library function whose
output is the public function's as it is
(:attr:`~sdpa_array._kernels.native.delegation.Delegation.direct`: torch's
``scaled_dot_product_attention`` without a mask, a cast or lengths), and the call has no
option but ``is_causal``, ``scale`` and ``enable_gqa`` (every other at its default, the
output alone asked for), that function is kept too (:func:`keep_direct`): the public forward
looks it up by the arrays' signatures and those three options before it builds anything
(:func:`direct`), and a later call of that signature costs a few microseconds beside the
function itself. The function receives the same arrays and options that the planned call
gives it, so the result and its autograd are the same.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .._arrays.compat import plain_signature
from .._arrays.typing import Array
from .._problem.options import Options
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem
from .dispatch import Choice

__all__ = [
    "MAX_ENTRIES",
    "clear",
    "decode_direct",
    "direct",
    "keep_decode_direct",
    "keep_direct",
    "lookup",
    "lookup_decode",
    "signature",
    "store",
    "store_decode",
]

#: Most signatures kept.
MAX_ENTRIES = 256

_entries: OrderedDict[tuple[Any, ...], tuple[Problem, Choice]] = OrderedDict()
_lock = threading.Lock()

#: Direct calls by :func:`_direct_key`; at most :data:`MAX_ENTRIES`, emptied when full.
_direct: dict[tuple[Any, ...], Callable[[Any, Any, Any], Any]] = {}

#: KV-cache calls by their key (:mod:`.decode`): what their checks found and what the
#: signature decides of their plan; at most :data:`MAX_ENTRIES`, least recently used dropped.
_decode: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

#: Plain KV-cache calls by their key (:func:`sdpa_array._plan.decode.direct_key`): the
#: tokens ``(lo, n)`` their one forward call attends and its keywords; at most
#: :data:`MAX_ENTRIES`, emptied when full.
_decode_direct: dict[tuple[Any, ...], tuple[int, int, dict[str, Any]]] = {}

#: The types of ``scale`` :func:`_direct_key` takes.
_DIRECT_SCALE_TYPES = frozenset({type(None), int, float})


def signature(
    query: Array,
    key: Array,
    value: Array,
    options: Options,
    outputs: Outputs,
    implementation: Any,
    blocks: tuple[Any, Any],
) -> tuple[Any, ...] | None:
    """What a forward call's validation and dispatch depend on, or ``None`` when that is
    more than its signature (see the module docstring)."""
    arrays = tuple(plain_signature(a) for a in (query, key, value))
    if any(a is None for a in arrays) or not isinstance(implementation, str):
        return None
    scalars = options.scalar_signature()
    if scalars is None or not all(b is None or type(b) is int for b in blocks):
        return None
    return (arrays, scalars, outputs, implementation, blocks)


def lookup(sig: tuple[Any, ...]) -> tuple[Problem, Choice] | None:
    """The problem and choice kept for ``sig``, if any."""
    with _lock:
        entry = _entries.get(sig)
        if entry is not None:
            _entries.move_to_end(sig)
        return entry


def store(sig: tuple[Any, ...], problem: Problem, choice: Choice) -> None:
    """Keep ``problem`` and ``choice`` (without the arrays of its planned native call) for
    ``sig``; Triton choices are not kept."""
    if choice.name == "triton":
        return
    with _lock:
        _entries[sig] = (problem, dataclasses.replace(choice, planned=None))
        _entries.move_to_end(sig)
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)


def clear() -> None:
    """Forget every kept plan and direct call."""
    with _lock:
        _entries.clear()
        _direct.clear()
        _decode.clear()
        _decode_direct.clear()


def _direct_key(
    query: Array, key: Array, value: Array, options: tuple[Any, Any, Any], implementation: Any
) -> tuple[Any, ...] | None:
    """The arrays' signatures, the three options (``is_causal``, ``scale``,
    ``enable_gqa``) with the type of ``scale``, and the implementation; ``None`` where one
    of them is not of a kind a direct call is kept for (two bools, ``None`` or a number, a
    string)."""
    is_causal, scale, enable_gqa = options
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        return None
    if type(scale) not in _DIRECT_SCALE_TYPES or type(implementation) is not str:
        return None
    arrays = (plain_signature(query), plain_signature(key), plain_signature(value))
    if arrays[0] is None or arrays[1] is None or arrays[2] is None:
        return None
    return (*arrays, is_causal, type(scale), scale, enable_gqa, implementation)


def direct(
    query: Array, key: Array, value: Array, options: tuple[Any, Any, Any], implementation: Any
) -> Callable[[Any, Any, Any], Any] | None:
    """The direct call kept for a forward call with these arrays, ``options``
    (``is_causal``, ``scale``, ``enable_gqa``; every other option at its default, the
    output alone asked for) and ``implementation``, if any."""
    if not _direct:
        return None
    found = _direct_key(query, key, value, options, implementation)
    return None if found is None else _direct.get(found)


def keep_direct(
    x: Inputs,
    options: Options,
    outputs: Outputs,
    implementation: Any,
    blocks: tuple[Any, Any],
    choice: Choice,
) -> None:
    """Keep ``choice``'s direct call for the signature of a call planned with it, where
    there is one and the call is of the kind :func:`direct` looks up."""
    planned = choice.planned
    if choice.name != "native" or planned is None or planned[1].direct is None:
        return
    if outputs != Outputs() or blocks != (None, None):
        return
    three = (options.is_causal, options.scale, options.enable_gqa)
    defaults = Options(is_causal=three[0], scale=three[1], enable_gqa=three[2])
    # None (an option holding an array or a function) differs from the defaults' too
    if options.scalar_signature() != defaults.scalar_signature():
        return
    found = _direct_key(x.query, x.key, x.value, three, implementation)
    if found is None:
        return
    with _lock:
        if len(_direct) >= MAX_ENTRIES:
            _direct.clear()
        _direct[found] = planned[1].direct


def lookup_decode(key: tuple[Any, ...]) -> Any:
    """What was kept for a KV-cache call of ``key`` (:func:`.decode.plan_decode`), if
    anything."""
    with _lock:
        entry = _decode.get(key)
        if entry is not None:
            _decode.move_to_end(key)
        return entry


def store_decode(key: tuple[Any, ...], entry: Any) -> None:
    """Keep ``entry`` (no array of the call: its checks' findings and its plan's static
    part) for KV-cache calls of ``key``."""
    with _lock:
        _decode[key] = entry
        _decode.move_to_end(key)
        while len(_decode) > MAX_ENTRIES:
            _decode.popitem(last=False)


def decode_direct(key: tuple[Any, ...] | None) -> tuple[int, int, dict[str, Any]] | None:
    """The span and forward keywords kept for a plain KV-cache call of ``key``, if any."""
    return None if key is None or not _decode_direct else _decode_direct.get(key)


def keep_decode_direct(
    key: tuple[Any, ...], span: tuple[int, int], keywords: dict[str, Any]
) -> None:
    """Keep the span and forward keywords a plain KV-cache call of ``key`` was planned
    with: a later call of that key makes that forward call at once."""
    with _lock:
        if len(_decode_direct) >= MAX_ENTRIES:
            _decode_direct.clear()
        _decode_direct[key] = (span[0], span[1], keywords)
