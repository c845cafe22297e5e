"""Checking the arguments of :func:`~sdpa_array._api.kv_cache.attention_with_kv_cache`.

:func:`check_call` runs every check before any array work and returns a :class:`CacheCall`;
each error names the argument and the shapes, dtypes or values involved. The options that the
cache function passes on to :func:`~sdpa_array.scaled_dot_product_attention` (``window``,
``scale``, ``softcap``, the flags) are checked by the main function's own
:func:`~sdpa_array._problem.problem.validate`, on an empty stand-in for the keys, so that both
functions accept exactly the same values.

Cache lengths and block tables are read on the host where that is possible (NumPy arrays,
lists, arrays of the inputs' library that hold values); lazy Dask arrays and traced arrays
(``jax.jit``, ``torch.func``) are kept as arrays, and their values are not checked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from ..._arrays.compat import array_namespace, device, is_array_api_obj, namespace_name
from ..._plan.decode import call_signature, kept_setup
from ..._plan.kv_call import CacheCall
from ..._problem.band import window_bounds
from ..._problem.options import Options
from ..._problem.peer_keywords import unexpected_keywords
from ..._problem.problem import Problem, validate
from ..._problem.scalar_options import check_flag
from .starts import check_starts

__all__ = ["CacheCall", "check_call"]

#: The keyword options of the cache function, all with the main function's meaning.
OPTIONS = (
    "mask",
    "bias",
    "is_causal",
    "window",
    "scale",
    "softcap",
    "enable_gqa",
    "return_lse",
    "return_max_scores",
    "alignment",
    "implementation",
)

#: The ``implementation`` names the cache function takes: ``"triton"`` decodes through the
#: Triton decoding kernel where it applies (else every chunk's call runs the Triton
#: kernels); the others are given to every chunk's call; ``"auto"`` takes the decoding
#: kernel on a GPU where it applies.
IMPLEMENTATION_NAMES = ("auto", "materialized", "blocked", "native", "triton")


def _torch_values(x: Any) -> np.ndarray:
    """A torch tensor's values on the host; refused (``RuntimeError``) while a CUDA graph is
    captured, where the copy would synchronise and break the capture."""
    import torch

    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a CUDA graph is being captured")
    return np.asarray(x.detach().cpu().numpy())


#: How a library's readable array becomes a NumPy array (default: ``numpy.asarray``).
_HOST_READERS: dict[str, Callable[[Any], np.ndarray]] = {
    "torch": _torch_values,
    "cupy": lambda x: x.get(),
}

#: Libraries whose arrays are never read on the host here (a lazy graph is not computed).
_UNREAD = frozenset({"dask"})


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _check_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if "return_weights" in unknown:
        raise TypeError(
            "attention_with_kv_cache() does not return attention weights (return_weights); "
            "use scaled_dot_product_attention on the gathered keys for them"
        )
    if unknown:
        raise TypeError(unexpected_keywords("attention_with_kv_cache", unknown, OPTIONS))
    alignment = options.get("alignment", "bottom_right")
    if alignment != "bottom_right":
        raise ValueError(
            "alignment is always 'bottom_right' with a KV cache (the last query sits on the last "
            f"attended token), got {alignment!r}"
        )


def _namespace(named: dict[str, Any]) -> ModuleType:
    """The inputs' namespace; the integer arguments may also be NumPy arrays or lists."""
    integer = ("cache_lengths", "cache_leftpad", "block_table")
    xp = array_namespace({k: v for k, v in named.items() if k not in integer})
    for name in integer:
        value = named.get(name)
        if value is None or isinstance(value, (list, tuple, np.ndarray)):
            continue
        if not is_array_api_obj(value):
            raise TypeError(
                f"{name} must be a list of ints, a NumPy array or an integer array of the "
                f"inputs' library, got {_kind(value)}"
            )
        try:
            array_namespace({"query": named["query"], name: value})
        except TypeError:
            raise TypeError(
                f"{name} must be a list of ints, a NumPy array or an array of the inputs' "
                f"library ({_kind(named['query'])}), got {_kind(value)}"
            ) from None
    return xp


def _check_arrays(xp: ModuleType, named: dict[str, Any]) -> None:
    for name in ("query", "key_cache", "value_cache", "new_key", "new_value"):
        x = named[name]
        if x is None:
            continue
        if x.ndim != 4:
            expected = {
                "query": "(B, Hq, L, E)",
                "new_key": "(B, Hkv, L, E)",
                "new_value": "(B, Hkv, L, Ev)",
            }.get(name, "(B, Hkv, S_max, E|Ev) or (num_pages, Hkv, page_size, E|Ev)")
            raise ValueError(f"{name} must have 4 dimensions {expected}, got {tuple(x.shape)}")
        if not xp.isdtype(x.dtype, "real floating"):
            raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
    arrays = ("query", "key_cache", "value_cache", "new_key", "new_value")
    present = {n: named[n].dtype for n in arrays if named[n] is not None}
    if len({str(d) for d in present.values()}) > 1:
        listed = ", ".join(f"{n} {d}" for n, d in present.items())
        raise TypeError(f"query, the caches and the new tokens must share one dtype, got {listed}")
    mask, bias = named["mask"], named["bias"]
    if mask is not None and not xp.isdtype(mask.dtype, "bool"):
        raise TypeError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    if bias is not None and not xp.isdtype(bias.dtype, "real floating"):
        raise TypeError(f"bias must have a real floating dtype, got {bias.dtype}")


def _check_shapes(named: dict[str, Any], paged: bool, enable_gqa: bool) -> None:
    q, k, v = (tuple(named[n].shape) for n in ("query", "key_cache", "value_cache"))
    B, Hq, L, E = q
    shapes = f"query {q}, key_cache {k}, value_cache {v}"
    if k[:3] != v[:3]:
        raise ValueError(f"key_cache and value_cache must agree on all but the last axis: {shapes}")
    if k[3] != E:
        raise ValueError(f"key_cache must have the query's feature size E={E}: {shapes}")
    if not paged and k[0] != B:
        raise ValueError(
            f"a contiguous key_cache must have shape (B, Hkv, S_max, E) with the query's B={B} "
            f"(or pass block_table for a paged cache): {shapes}"
        )
    if paged and k[2] < 1:
        raise ValueError(f"a paged cache needs page_size >= 1 (axis 2 of key_cache): {shapes}")
    Hkv = k[1]
    if enable_gqa and (Hkv == 0 or Hq % Hkv):
        raise ValueError(
            f"enable_gqa=True needs query heads ({Hq}) to be a multiple of the cache's heads "
            f"({Hkv}): {shapes}"
        )
    if not enable_gqa and Hkv not in (Hq, 1):
        raise ValueError(
            f"query heads ({Hq}) and cache heads ({Hkv}) differ; pass enable_gqa=True for "
            f"grouped-query attention: {shapes}"
        )
    for name, width in (("new_key", E), ("new_value", v[3])):
        x = named[name]
        if x is not None and tuple(x.shape) != (B, Hkv, L, width):
            raise ValueError(
                f"{name} must have shape (B, Hkv, L, {'E' if name == 'new_key' else 'Ev'}) = "
                f"{(B, Hkv, L, width)} to match {shapes}, got {tuple(x.shape)}"
            )


def _read(xp: ModuleType, x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array, or ``None`` where its values cannot be read without work."""
    if isinstance(x, np.ndarray):
        return x
    name = namespace_name(xp)
    if name in _UNREAD:
        return None
    try:
        return np.asarray(_HOST_READERS.get(name, np.asarray)(x))
    except Exception:  # tracers and batched tensors refuse, each with its own error
        return None


def _integers(
    xp: ModuleType, name: str, value: Any, shape: tuple[int | None, ...], what: str
) -> Any:
    """``value`` as a host int64 array (lists, NumPy, readable arrays) or the array itself.

    ``shape`` is the expected shape, ``None`` where any size fits.
    """
    if isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value)
        except ValueError:
            raise ValueError(f"{name} must have shape {what}, got a ragged list") from None
        if value.size == 0:
            value = value.astype(np.int64)
    if isinstance(value, np.ndarray):
        integral = value.dtype.kind in "iu"
    else:
        integral = xp.isdtype(value.dtype, "integral")
    if not integral:
        raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
    got = tuple(int(n) for n in value.shape)
    if len(got) != len(shape) or any(
        e is not None and e != n for e, n in zip(shape, got, strict=True)
    ):
        expected = tuple("*" if e is None else e for e in shape)
        raise ValueError(f"{name} must have shape {what} = {expected}, got {got}")
    host = _read(xp, value)
    return value if host is None else host.astype(np.int64)


def _check_lengths(lengths: tuple[int, ...], new: int, capacity: int, layout: str) -> None:
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_lengths must be non-negative, got cache_lengths[{b}] = {n}")
        if n + new > capacity:
            raise ValueError(
                f"the cache is too small: cache_lengths[{b}] = {n} plus {new} new token(s) "
                f"needs {n + new} token slots, but {layout} holds {capacity} per sequence"
            )


def _check_table(table: np.ndarray, lengths: Any, new: int, page_size: int, pages: int) -> None:
    """Every page a sequence uses (all of them where lengths are unknown) must exist."""
    for b, row in enumerate(table):
        used = len(row) if lengths is None else -(-(int(lengths[b]) + new) // page_size)
        for j, page in enumerate(row[:used].tolist()):
            if not 0 <= page < pages:
                raise ValueError(
                    f"block_table[{b}, {j}] = {page} points outside the cache's {pages} pages "
                    f"(key_cache axis 0); sequence {b} uses its first {used} entries"
                )


def _num_splits(num_splits: Any) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits}")
    return int(num_splits)


def _term(xp: ModuleType, name: str, term: Any, scores: tuple[int, ...], what: str) -> Any:
    if term is None:
        return None
    try:
        fits = np.broadcast_shapes(tuple(term.shape), scores) == scores
    except ValueError:
        fits = False
    if not fits or term.ndim > 4:
        raise ValueError(
            f"{name} of shape {tuple(term.shape)} does not broadcast to (B, Hq, L, T) = "
            f"{scores} (T = {what})"
        )
    return xp.reshape(term, (1,) * (4 - term.ndim) + tuple(term.shape))


def check_call(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    *,
    cache_lengths: Any,
    new_key: Any,
    new_value: Any,
    block_table: Any,
    num_splits: Any,
    options: dict[str, Any],
    cache_leftpad: Any = None,
) -> CacheCall:
    """Check every argument of the cache function and return the call they describe.

    A call whose signature was checked before (:func:`~sdpa_array._plan.decode.kept_setup`)
    takes what those checks found and checks only the values of its lengths, starts and
    block table.

    Raises
    ------
    TypeError
        Non-arrays, mixed libraries, non-floating or mixed dtypes, a non-boolean ``mask``,
        non-integer lengths or block table, a ``num_splits`` that is not an int, an unknown
        option.
    ValueError
        Shapes that do not fit, a cache too small for ``cache_lengths + L``, a block table
        pointing outside the pages or a ``cache_leftpad`` past the tokens (where the values
        can be read), ``new_key`` without ``new_value``, out-of-range options.
    """
    signature = call_signature(
        (query, key_cache, value_cache, new_key, new_value),
        (cache_lengths, cache_leftpad, block_table),
        num_splits,
        options,
    )
    setup = kept_setup(signature)
    if setup is None:
        setup = _setup(
            query,
            key_cache,
            value_cache,
            new_key=new_key,
            new_value=new_value,
            block_table=block_table,
            num_splits=num_splits,
            options=options,
            integers={"cache_lengths": cache_lengths, "cache_leftpad": cache_leftpad},
        )
        setup["signature"] = signature
    xp = setup["xp"]
    B, Hq, L = (int(n) for n in query.shape[:3])
    new = L if new_key is not None else 0
    lengths, table, capacity = _layout(xp, B, new, key_cache, cache_lengths, block_table)
    host_lengths = lengths if isinstance(lengths, tuple) else None
    starts = check_starts(xp, cache_leftpad, B, host_lengths, new, _integers)
    paged = setup["paged"]
    scores, what = (B, Hq, L, capacity), "max_pages * page_size" if paged else "S_max"
    # the window as given (the problem's stub call has S = 0, which would make every side
    # "past the lengths"), bounded as validation bounds it
    window = options.get("window")
    left, right = (None, None) if window is None else window_bounds(window, L + capacity)
    return CacheCall(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        new_key=new_key,
        new_value=new_value,
        capacity=capacity,
        lengths=lengths,
        starts=starts,
        table=table,
        mask=_term(xp, "mask", options.get("mask"), scores, what),
        bias=_term(xp, "bias", options.get("bias"), scores, what),
        window=None if left is None and right is None else (left, right),
        **setup,
    )


def _setup(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    *,
    new_key: Any,
    new_value: Any,
    block_table: Any,
    num_splits: Any,
    options: dict[str, Any],
    integers: dict[str, Any],
) -> dict[str, Any]:
    """Every check that the call's signature decides, and what they found: the fields of
    :meth:`CacheCall.setup` (the signature aside)."""
    _check_options(options)
    named = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "new_key": new_key,
        "new_value": new_value,
        "mask": options.get("mask"),
        "bias": options.get("bias"),
        "block_table": block_table,
        **integers,
    }
    xp = _checked_arrays(named, bool(options.get("enable_gqa", False)))
    implementation, problem = _checked_options(named, options)
    return {
        "xp": xp,
        "device": device(query),
        "paged": block_table is not None,
        "page_size": int(key_cache.shape[2]),
        "num_splits": _num_splits(num_splits),
        "is_causal": bool(options.get("is_causal", False)),
        "passed": {
            k: options[k]
            for k in ("scale", "softcap", "enable_gqa", "implementation")
            if k in options
        },
        "return_lse": bool(options.get("return_lse", False)),
        "return_max_scores": bool(options.get("return_max_scores", False)),
        "problem": problem,
        "implementation": implementation,
    }


def _checked_arrays(named: dict[str, Any], enable_gqa: bool) -> ModuleType:
    """The arrays' namespace, after checking that they are present where required, of one
    library, of fitting dtypes and shapes."""
    if named["cache_lengths"] is None:
        raise TypeError("cache_lengths is required: the number of tokens in each cache, (B,)")
    for name in ("query", "key_cache", "value_cache"):
        if named[name] is None:
            raise TypeError(f"{name} must be an array, got None")
    xp = _namespace(named)
    if (named["new_key"] is None) != (named["new_value"] is None):
        given, missing = (
            ("new_key", "new_value") if named["new_value"] is None else ("new_value", "new_key")
        )
        raise ValueError(f"{given} was given without {missing}: pass both or neither")
    _check_arrays(xp, named)
    check_flag("enable_gqa", enable_gqa)
    _check_shapes(named, named["block_table"] is not None, enable_gqa)
    return xp


def _layout(
    xp: ModuleType, B: int, new: int, key_cache: Any, cache_lengths: Any, block_table: Any
) -> tuple[Any, Any, int]:
    """``(lengths, table, capacity)``: the lengths as a tuple of ints and the block table as
    a host int64 array where they can be read (and then checked against the cache), else as
    given; a contiguous cache as the table of one page per sequence; the tokens a sequence
    holds."""
    pages, _, rows, _ = (int(n) for n in key_cache.shape)
    lengths = _host_ints(cache_lengths, B)
    if lengths is None:
        found = _integers(xp, "cache_lengths", cache_lengths, (B,), "(B,)")
        lengths = tuple(found.tolist()) if isinstance(found, np.ndarray) else found
    host_lengths = lengths if isinstance(lengths, tuple) else None
    if block_table is not None:
        table = _integers(xp, "block_table", block_table, (B, None), "(B, max_pages)")
        capacity = int(table.shape[1]) * rows
        layout = f"the block table ({table.shape[1]} pages of {rows} tokens)"
    else:
        table = _one_page_each(B)
        capacity = rows
        layout = f"key_cache (S_max = {rows})"
    if host_lengths is not None:
        _check_lengths(host_lengths, new, capacity, layout)
    if block_table is not None and isinstance(table, np.ndarray):
        _check_table(table, host_lengths, new, rows, pages)
    return lengths, table, capacity


def _host_ints(value: Any, B: int) -> tuple[int, ...] | None:
    """A list or tuple of ``B`` Python ints as a tuple (no NumPy array made for it); ``None``
    for anything else, which :func:`_integers` checks."""
    if type(value) in (list, tuple) and len(value) == B and all(type(n) is int for n in value):
        return tuple(value)
    return None


@functools.lru_cache(maxsize=64)
def _one_page_each(B: int) -> np.ndarray:
    """The block table of a contiguous cache, ``[[0], [1], ...]`` (read-only, shared)."""
    table = np.arange(B, dtype=np.int64)[:, None]
    table.flags.writeable = False
    return table


def _checked_options(named: dict[str, Any], options: dict[str, Any]) -> tuple[str, Problem]:
    """``(implementation, problem)``: the options checked by the main function's validation
    on a stub call with no keys (scale, softcap, window, GQA resolved). Whether the Triton
    kernels can run ``implementation="triton"`` is the planner's question."""
    check_flag("return_lse", options.get("return_lse", False))
    check_flag("return_max_scores", options.get("return_max_scores", False))
    implementation = options.get("implementation", "auto")
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATION_NAMES:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATION_NAMES}, got {implementation!r}"
        )
    query, key_cache, value_cache = named["query"], named["key_cache"], named["value_cache"]
    stub_options = Options(
        is_causal=options.get("is_causal", False),
        window=options.get("window"),
        alignment="bottom_right",
        scale=options.get("scale"),
        softcap=options.get("softcap"),
        enable_gqa=options.get("enable_gqa", False),
    )
    problem = validate(query, key_cache[:1, :, :0, :], value_cache[:1, :, :0, :], stub_options)
    return implementation, problem
