"""``implementation="auto"`` follows the per-library thresholds of the dispatch table:
materialized at or below a library's threshold, blocked above it, blocked above the hard
cap whatever the library, and explicit implementations untouched by either.

The problems are validated but tiny: the score matrix ``(a, 1, b)`` of a query ``(a, 1, 1)``
against a key ``(1, b, 1)`` reaches hundreds of MiB from arrays of a few KiB.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa_array._arrays.compat import namespace_name
from sdpa_array._kernels.native import CannotDelegateError, Request, plan_native
from sdpa_array._plan import dispatch as _dispatch
from sdpa_array._problem.options import Options
from sdpa_array._problem.outputs import Outputs
from sdpa_array._problem.problem import Inputs, Problem, validate
from sdpa_array.testing.backends import get_backend

#: Backend id of each library in the table (the library name is the namespace's). Dask is
#: not in it: ``"auto"`` builds its chunk graph (tests/test_dask_graph.py).
BACKEND_OF = {
    "numpy": "numpy",
    "torch": "torch",
    "jax": "jax",
    "array_api_strict": "strict",
}


def problem_of(backend_id: str, nbytes: int, *, above: bool) -> tuple[Problem, Inputs]:
    """A float32 problem whose score matrix has at most ``nbytes`` bytes (``above``: a few
    bytes more than ``nbytes``)."""
    backend = get_backend(backend_id)
    if not backend.is_available():
        pytest.skip(f"{backend_id} is not available")
    n = nbytes // 4
    a = math.isqrt(n)
    b = n // a + (1 if above else 0)  # a * b <= n < a * (b + 1)
    q = backend.asarray(np.zeros((a, 1, 1), dtype=np.float32), "float32")
    k = backend.asarray(np.zeros((1, b, 1), dtype=np.float32), "float32")
    p = validate(q, k, k, Options())
    assert (_dispatch.score_bytes(p) > nbytes) == above
    return p, Inputs(q, k, k)


def forward_request(p: Problem, x: Inputs) -> Request | None:
    """A plain forward request, or ``None`` where a native kernel would take it (then
    ``"auto"`` delegates, and the threshold is not what decides)."""
    request = Request(x, Outputs(False, False))
    try:
        plan_native(p, request)
    except CannotDelegateError:
        return request
    return None


def test_table_covers_the_measured_libraries():
    assert set(_dispatch.AUTO_BLOCKED_BYTES_BY_LIBRARY) == set(BACKEND_OF)
    for threshold in _dispatch.AUTO_BLOCKED_BYTES_BY_LIBRARY.values():
        assert 0 < threshold <= _dispatch.AUTO_MAX_SCORE_BYTES


@pytest.mark.parametrize("library", sorted(BACKEND_OF))
def test_auto_follows_the_library_threshold(library, monkeypatch):
    threshold = _dispatch.AUTO_BLOCKED_BYTES_BY_LIBRARY[library]
    below, x_below = problem_of(BACKEND_OF[library], threshold, above=False)
    above, x_above = problem_of(BACKEND_OF[library], threshold, above=True)
    assert namespace_name(below.xp) == library
    assert _dispatch.auto_blocked_bytes(below) == threshold
    # the VJP
    assert _dispatch.choose(below, "auto").name == "materialized"
    assert _dispatch.choose(above, "auto").name == "blocked"
    # the forward: a native kernel takes these calls on torch and JAX, so the rule behind
    # it is checked with the native planner refusing every call
    native_takes = [forward_request(p, x) is None for p, x in ((below, x_below), (above, x_above))]
    assert native_takes == [library in ("torch", "jax")] * 2

    def refuse(p, request):
        raise CannotDelegateError("refused by the test")

    monkeypatch.setattr(_dispatch, "plan_native", refuse)
    forward = Request(x_below, Outputs(False, False))
    assert _dispatch.choose(below, "auto", request=forward).name == "materialized"
    forward = Request(x_above, Outputs(False, False))
    assert _dispatch.choose(above, "auto", request=forward).name == "blocked"


def test_weights_stay_materialized_above_the_threshold():
    threshold = _dispatch.AUTO_BLOCKED_BYTES_BY_LIBRARY["numpy"]
    p, x = problem_of("numpy", threshold, above=True)
    assert (
        _dispatch.choose(p, "auto", request=Request(x, Outputs(True, False))).name == "materialized"
    )


def test_libraries_without_an_entry_get_the_default(monkeypatch):
    monkeypatch.delitem(_dispatch.AUTO_BLOCKED_BYTES_BY_LIBRARY, "numpy")
    for above, name in ((False, "materialized"), (True, "blocked")):
        p, _ = problem_of("numpy", _dispatch.AUTO_BLOCKED_BYTES, above=above)
        assert _dispatch.auto_blocked_bytes(p) == _dispatch.AUTO_BLOCKED_BYTES
        assert _dispatch.choose(p, "auto").name == name


def test_memory_cap_wins_over_the_library_threshold(monkeypatch):
    monkeypatch.setitem(_dispatch.AUTO_BLOCKED_BYTES_BY_LIBRARY, "numpy", 2**40)
    cap = _dispatch.AUTO_MAX_SCORE_BYTES
    below, _ = problem_of("numpy", cap, above=False)
    above, x = problem_of("numpy", cap, above=True)
    assert _dispatch.auto_blocked_bytes(above) == cap
    assert _dispatch.choose(below, "auto").name == "materialized"
    assert _dispatch.choose(above, "auto").name == "blocked"
    assert (
        _dispatch.choose(above, "auto", request=Request(x, Outputs(False, False))).name == "blocked"
    )


@pytest.mark.parametrize("above", [False, True])
def test_explicit_implementations_ignore_the_thresholds(above):
    p, x = problem_of("numpy", _dispatch.AUTO_MAX_SCORE_BYTES, above=above)
    request = Request(x, Outputs(False, False))
    for name in ("materialized", "blocked"):
        assert _dispatch.choose(p, name) == _dispatch.Choice(name)
        assert _dispatch.choose(p, name, request=request) == _dispatch.Choice(name)
    assert _dispatch.choose(p, "auto", (8, None)) == _dispatch.Choice("blocked", True, 8, None)
