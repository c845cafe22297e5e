"""Malformed calls of every public function, generated (hypothesis).

Each public function has a valid call; a malformed one replaces one of its arguments with a
value from a pool of wrong kinds (``None``, strings, bytes, containers, objects, booleans),
out-of-range numbers (negative, zero, ``+-inf``, NaN, past 64 bits) and wrong arrays (other
ranks, integer/boolean/complex dtypes, zero-size, non-contiguous, another library's). Every
call must either succeed without NaN (the value happened to be valid) or raise a
``ValueError`` or ``TypeError`` whose message names the argument, leaving every input
unchanged; any other exception, a warning (pytest turns them into errors) or a NaN fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import sdpa_array
from sdpa_array import mods, reference

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((2, 2, 5, 4))
K = RNG.standard_normal((2, 2, 6, 4))
V = RNG.standard_normal((2, 2, 6, 3))
G = RNG.standard_normal((2, 2, 5, 3))
LSE = RNG.standard_normal((2, 2, 5))


def _bad_values() -> list[Any]:
    values: list[Any] = [
        None,
        "x",
        "0.5",
        b"1",
        [1, 2],
        (1,),
        {"a": 1},
        object(),
        True,
        -1,
        0,
        2**70,
        -(2**70),
        1.5,
        -0.5,
        math.nan,
        math.inf,
        -math.inf,
        np.zeros(3),
        np.zeros((2, 2)),
        np.zeros((2, 2, 5, 4, 1, 1)),
        np.zeros((2, 2, 5, 4), dtype=np.int64),
        np.zeros((2, 2, 5, 4), dtype=bool),
        np.zeros((2, 2, 5, 4), dtype=np.complex128),
        np.zeros((2, 2, 0, 4)),
        np.full((2, 2, 5, 4), np.nan),
        Q.transpose(0, 1, 3, 2),
        np.float64(np.nan),
        np.asarray(2.0),
    ]
    try:
        import torch

        values.append(torch.zeros(2, 2, 5, 4))
    except ImportError:
        pass
    return values


BAD = _bad_values()


def _has_nan(x: Any) -> bool:
    arrays = x if isinstance(x, (tuple, list)) else (x,)
    found = False
    for a in arrays:
        if isinstance(a, (list, tuple)):
            found |= _has_nan(a)
            continue
        try:
            values = reference.to_numpy(a)
        except (TypeError, ValueError):  # not an array
            continue
        if values.dtype.kind in "fc":
            found |= bool(np.isnan(values).any())
    return found


#: name -> (function, positional arguments' names, valid keyword arguments, names that
#: may be replaced, and what an error must mention for each)
CALLS: dict[str, tuple[Callable[..., Any], tuple[str, ...], dict[str, Any]]] = {
    "scaled_dot_product_attention": (
        sdpa_array.scaled_dot_product_attention,
        ("query", "key", "value"),
        {
            "query": Q,
            "key": K,
            "value": V,
            "mask": None,
            "bias": None,
            "is_causal": False,
            "window": None,
            "alignment": "top_left",
            "scale": None,
            "softcap": None,
            "enable_gqa": False,
            "query_lengths": None,
            "key_lengths": None,
            "sinks": None,
            "dropout_p": 0.0,
            "dropout_seed": None,
            "mask_mod": None,
            "bias_mod": None,
            "return_weights": False,
            "return_lse": False,
            "implementation": "auto",
            "block_q": None,
            "block_k": None,
        },
    ),
    "scaled_dot_product_attention_vjp": (
        sdpa_array.scaled_dot_product_attention_vjp,
        ("query", "key", "value", "grad_output"),
        {
            "query": Q,
            "key": K,
            "value": V,
            "grad_output": G,
            "mask": None,
            "bias": None,
            "is_causal": False,
            "scale": None,
            "softcap": None,
            "sinks": None,
            "implementation": "auto",
        },
    ),
    "explain": (
        sdpa_array.explain,
        ("query", "key", "value"),
        {"query": Q, "key": K, "value": V, "is_causal": False, "implementation": "auto"},
    ),
    "attention_with_kv_cache": (
        sdpa_array.attention_with_kv_cache,
        ("query", "key_cache", "value_cache"),
        {
            "query": Q[:, :, :1],
            "key_cache": K,
            "value_cache": V,
            "cache_lengths": [4, 6],
            "new_key": None,
            "new_value": None,
            "block_table": None,
            "num_splits": None,
        },
    ),
    "merge_attention_states": (
        sdpa_array.merge_attention_states,
        ("outs", "lses"),
        {"outs": [G, G], "lses": [LSE, LSE]},
    ),
    "create_block_mask": (
        sdpa_array.create_block_mask,
        ("mask_mod", "batch_size", "heads", "L", "S"),
        {
            "mask_mod": mods.causal(),
            "batch_size": 2,
            "heads": None,
            "L": 5,
            "S": 6,
            "block_q": None,
            "block_k": None,
        },
    ),
    "dropout_keep_mask": (
        sdpa_array.dropout_keep_mask,
        ("seed", "shape", "dropout_p"),
        {"seed": 1, "shape": (2, 2, 5, 6), "dropout_p": 0.5, "xp": None, "device": None},
    ),
    "multi_head_attention": (
        sdpa_array.multi_head_attention,
        ("query", "key", "value", "params"),
        {
            "query": Q[0],
            "key": K[0],
            "value": K[0],
            "params": {
                "q_weight": RNG.standard_normal((4, 4)),
                "k_weight": RNG.standard_normal((4, 4)),
                "v_weight": RNG.standard_normal((4, 4)),
                "out_weight": RNG.standard_normal((4, 4)),
            },
            "num_heads": 2,
            "num_kv_heads": None,
            "add_zero_attn": False,
            "is_causal": False,
        },
    ),
    "causal": (mods.causal, (), {"offset": 0}),
    "sliding_window": (mods.sliding_window, ("left", "right"), {"left": 2, "right": 0}),
    "prefix_lm": (mods.prefix_lm, ("prefix_lengths",), {"prefix_lengths": [2, 3]}),
    "document": (
        mods.document,
        ("query_segments", "key_segments"),
        {"query_segments": np.zeros((2, 5), int), "key_segments": np.zeros((2, 6), int)},
    ),
    "alibi": (mods.alibi, ("slopes",), {"slopes": [0.5, 0.25]}),
    "alibi_slopes": (mods.alibi_slopes, ("heads",), {"heads": 4}),
    "set_num_threads": (sdpa_array.set_num_threads, ("n",), {"n": None}),
}

#: Arguments whose errors may name the argument they are checked against instead (both
#: names are accepted).
ALSO = {
    "query": ("key", "grad_output"),
    "key": ("query", "value"),
    "value": ("key", "query"),
    "key_cache": ("value_cache", "query"),
    "value_cache": ("key_cache",),
    "outs": ("lses",),
    "lses": ("outs",),
    "L": ("block",),
    "S": ("block",),
    "n": ("threads",),
    "seed": ("dropout_seed",),
    "grad_output": ("output",),
    "left": ("window",),
    "right": ("window",),
    "block_q": ("block",),
    "block_k": ("block",),
    "is_causal": ("causal",),
    "enable_gqa": ("gqa",),
    "query_segments": ("segment",),
    "key_segments": ("segment",),
    "prefix_lengths": ("prefix",),
}


def _call(name: str, replaced: str, bad: Any) -> tuple[Callable[..., Any], tuple, dict]:
    fn, positional, valid = CALLS[name]
    given = {**valid, replaced: bad}
    args = tuple(given.pop(n) for n in positional)
    return fn, args, given


def _snapshot(args: tuple, kwargs: dict) -> list[tuple[Any, np.ndarray]]:
    arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)]
    arrays += [a for v in (*args, *kwargs.values()) if isinstance(v, list) for a in v]
    return [(a, a.copy()) for a in arrays if isinstance(a, np.ndarray)]


@st.composite
def malformed(draw: Any) -> tuple[str, str, Any]:
    name = draw(st.sampled_from(sorted(CALLS)))
    _, _, valid = CALLS[name]
    replaced = draw(st.sampled_from(sorted(valid)))
    bad = draw(st.sampled_from(range(len(BAD))))
    return name, replaced, bad


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_valid_call_works(name: str) -> None:
    """The calls the malformed ones start from are valid (so an error is the bad value's)."""
    fn, positional, valid = CALLS[name]
    given = dict(valid)
    args = tuple(given.pop(n) for n in positional)
    fn(*args, **given)
    sdpa_array.set_num_threads(None)


@hypothesis.settings(max_examples=1500, deadline=None)
@hypothesis.given(malformed())
def test_malformed_calls_get_a_clear_error(case: tuple[str, str, int]) -> None:
    name, replaced, index = case
    bad = BAD[index]
    fn, args, kwargs = _call(name, replaced, bad)
    _check(name, replaced, bad, fn, args, kwargs)


def _check(
    name: str, replaced: str, bad: Any, fn: Callable[..., Any], args: tuple, kwargs: dict
) -> None:
    """The call succeeds without NaN, or raises a ValueError/TypeError naming ``replaced``;
    its inputs are unchanged either way."""
    before = _snapshot(args, kwargs)
    error: Exception | None = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        error = exc
    finally:
        sdpa_array.set_num_threads(None)
    if error is not None:
        names = (replaced, *ALSO.get(replaced, ()))
        assert any(n in str(error) for n in names), (
            f"{name}({replaced}={bad!r}) raised {type(error).__name__} not naming "
            f"{replaced}: {error}"
        )
    elif not (_has_nan(bad) or (isinstance(bad, float) and math.isnan(bad))):
        assert not _has_nan(result), f"{name}({replaced}={bad!r}) returned NaN"
    for original, copy in before:
        np.testing.assert_array_equal(original, copy)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_none_for_a_required_argument(name: str) -> None:
    """``None`` for each positional argument is a ``TypeError`` naming it (or accepted
    where ``None`` means a default)."""
    _, positional, _ = CALLS[name]
    for replaced in positional:
        fn, args, kwargs = _call(name, replaced, None)
        _check(name, replaced, None, fn, args, kwargs)


#: The functions that take the caller's arrays, tried on every eager backend.
ARRAY_CALLS = (
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "explain",
    "attention_with_kv_cache",
    "merge_attention_states",
    "multi_head_attention",
)


def _on(backend: Any, value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return backend.asarray(value, "float32")
    if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
        return [_on(backend, v) for v in value]
    if isinstance(value, dict):  # multi_head_attention's params
        return {name: _on(backend, v) for name, v in value.items()}
    return value


@st.composite
def malformed_array_call(draw: Any) -> tuple[str, str, int]:
    name = draw(st.sampled_from(ARRAY_CALLS))
    replaced = draw(st.sampled_from(sorted(CALLS[name][2])))
    return name, replaced, draw(st.sampled_from(range(len(BAD))))


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(case=malformed_array_call())
def test_malformed_calls_on_every_backend(eager_backend: Any, case: tuple[str, str, int]) -> None:
    """The same malformed calls with the valid arrays on each eager backend (the pool's
    NumPy arrays are then another library's)."""
    name, replaced, index = case
    fn, positional, valid = CALLS[name]
    given = {key: _on(eager_backend, value) for key, value in valid.items()}
    given[replaced] = BAD[index]
    args = tuple(given.pop(n) for n in positional)
    _check(name, replaced, BAD[index], fn, args, given)
