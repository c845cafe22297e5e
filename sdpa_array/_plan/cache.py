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
``"auto"`` cost a few microseconds of planning (docs/performance.md, issue 28).

Calls with an array or a function among their options (a mask, lengths as arrays, a bias
function...), calls on other libraries, and Triton choices (whose planning reads the device)
are planned every time. At most :data:`MAX_ENTRIES` signatures are kept, the least recently
used dropped first; :func:`clear` forgets them all, and must be called after changing the
dispatch's own settings (its thresholds, the native kernels' table), which a kept plan does
not read again.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any

from .._arrays.compat import plain_signature
from .._arrays.typing import Array
from .._problem.options import Options
from .._problem.outputs import Outputs
from .._problem.problem import Problem
from .dispatch import Choice

__all__ = ["MAX_ENTRIES", "clear", "lookup", "signature", "store"]

#: Most signatures kept.
MAX_ENTRIES = 256

_entries: OrderedDict[tuple[Any, ...], tuple[Problem, Choice]] = OrderedDict()
_lock = threading.Lock()


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
    """Forget every kept plan."""
    with _lock:
        _entries.clear()
