"""Eager JAX calls compiled whole: ``jax.jit`` around the public function, cached.

An eager call on JAX arrays (concrete values, outside any JAX transformation) would run
every operation of the kernels one at a time, each dispatched from Python: a blocked call
of a few hundred tiles costs hundreds of dispatches. :func:`run_jitted` instead traces the
public function under ``jax.jit`` once per setup (shapes, dtypes, the options that are not
arrays) and reuses the compiled program, so an eager call costs about what a jitted one
does, compilation included: the first call of a setup compiles, as the caller's own
``jax.jit`` would. Every call of a setup runs the same program, so repeated calls give
bit-identical results (XLA's fused program may round differently from the operations run
one at a time). The call is validated eagerly first, so bad input still gets its error
before any work.

Not compiled (run as they are): calls with dropout and an int seed (each new seed would
compile a new program; a seed given as an array is traced instead), calls with a mask or
bias function (run eagerly, its blocks are classified on their values and the empty ones
skipped, which a trace cannot do), calls whose static options cannot be hashed, and every
call when
``SDPA_ARRAY_JAX_EAGER_JIT=0``.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ENVIRONMENT_VARIABLE", "clear_compiled", "eager_jax", "run_jitted"]

#: Set to ``0`` to run eager JAX calls operation by operation.
ENVIRONMENT_VARIABLE = "SDPA_ARRAY_JAX_EAGER_JIT"


def _enabled() -> bool:
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip() not in ("0", "false", "no", "off")


def eager_jax(arrays: list[Any]) -> bool:
    """Whether ``arrays`` (the call's arrays, ``None`` skipped) are concrete JAX arrays, none
    a tracer: an eager JAX call, which :func:`run_jitted` compiles."""
    present = [a for a in arrays if a is not None]
    if not present or not _enabled():
        return False
    if type(present[0]).__module__.split(".")[0] not in ("jax", "jaxlib"):
        return False
    jax = importlib.import_module("jax")
    return all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in present)


def _is_array(value: Any) -> bool:
    """An array argument, traced; NumPy scalars (``np.float32(0.5)`` as ``scale``) and
    Python numbers stay static, as the call treats them as numbers."""
    if isinstance(value, np.generic):
        return False
    return hasattr(value, "shape") and hasattr(value, "dtype")


@functools.lru_cache(maxsize=128)
def _compiled(function: Callable[..., Any], static: tuple[tuple[str, Any], ...]) -> Any:
    jax = importlib.import_module("jax")
    fixed = dict(static)

    def call(positional: tuple[Any, ...], dynamic: dict[str, Any]) -> Any:
        return function(*positional, **fixed, **dynamic)

    return jax.jit(call)


def clear_compiled() -> None:
    """Forget every compiled program (the next call of each setup traces again)."""
    _compiled.cache_clear()


def run_jitted(
    function: Callable[..., Any], positional: tuple[Any, ...], keywords: dict[str, Any]
) -> tuple[bool, Any]:
    """``(True, function(*positional, **keywords))`` computed by a cached ``jax.jit`` of
    ``function`` over the array arguments, or ``(False, None)`` where the call is not
    compiled (see the module docstring). Keywords holding arrays (a tuple of arrays, for
    ``segment_ids``) are traced; the others are static."""
    int_seed = keywords.get("dropout_p") and not _is_array(keywords.get("dropout_seed"))
    mods = (keywords.get(name) for name in ("mask_mod", "bias_mod", "score_mod"))
    if int_seed or any(mod is not None for mod in mods):
        return False, None
    dynamic: dict[str, Any] = {}
    static: list[tuple[str, Any]] = []
    for name, value in keywords.items():
        leaves = value if isinstance(value, tuple) else (value,)
        if any(_is_array(v) for v in leaves):
            dynamic[name] = value
        else:
            static.append((name, value))
    key = tuple(sorted(static, key=lambda item: item[0]))
    try:
        hash(key)
    except TypeError:
        return False, None
    return True, _compiled(function, key)(positional, dynamic)
