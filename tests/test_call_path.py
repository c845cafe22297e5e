"""The way of one call: the places a forward call's query visits, and no step back up.

A call is traced with :func:`sys.setprofile`. A *place* is a function of the package that
receives the caller's query, or a record (a dataclass) holding it or the query a kernel made
of it (a dataclass field named ``q`` or ``query``), counted once however often it is
entered; a dataclass's generated ``__init__`` is not a place. A *step up* is a call from a
module to one of a higher layer of the import-linter contract (``pyproject.toml``), where
the modules of ``sdpa_array._api`` it does not name stand with the public entry points:
the layers import downwards only, and this checks that no callback climbs back either. Two
calls are not steps: the public functions' keyword wrapper
(:func:`~sdpa_array._problem.peer_keywords.names_peer_spellings`) entering the function it
wraps, and the thread pool's ``map_blocks`` running a kernel's blocks (a ``map``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sdpa_array as sa
from sdpa_array import mods

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
_CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
LAYERS = next(c for c in _CONTRACTS["contracts"] if c["type"] == "layers")["layers"]

#: The paths' bounds: the plain calls at most 25 places (the issue's ~25); a call that
#: validates mask or mod functions or segment ids, or runs the blocked kernel, visits
#: their checks and the tile helpers of the blocked kernel and the restrictions too (measured:
#: 26 to 41 places).
PLAIN = 25


def _layer(module: str) -> int | None:
    """The index of ``module``'s layer in the contract (0 the highest); the unnamed modules
    of ``sdpa_array._api`` with the entry points."""
    for index, entry in enumerate(LAYERS):
        for name in re.split(r"[|:]", entry):
            name = name.strip()
            if module == name or module.startswith(name + "."):
                return index
    if module.startswith("sdpa_array._api"):
        return _layer("sdpa_array._api.forward")
    return None


def _trace(function: Any, query: Any, *args: Any, **kwargs: Any) -> tuple[list[str], list[str]]:
    """The places ``function(query, *args, **kwargs)`` visits and its steps up."""
    tracked = {id(query)}
    kept: list[Any] = []  # the queries a kernel made, alive while traced (their ids)
    places: dict[str, None] = {}
    steps_up: list[str] = []
    wrapper_code = sa.scaled_dot_product_attention.__code__

    def holds(x: Any) -> bool:
        if id(x) in tracked:
            return True
        if isinstance(x, (tuple, list)):
            return any(id(y) in tracked for y in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            found = False
            for field in dataclasses.fields(x):
                y = getattr(x, field.name, None)
                found = found or id(y) in tracked
                if field.name in ("q", "query") and hasattr(y, "shape"):
                    tracked.add(id(y))
                    kept.append(y)
            return found
        return False

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("sdpa_array"):
            return
        code = frame.f_code
        name = f"{module}.{code.co_qualname}"
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if "__create_fn__" not in name and any(holds(frame.f_locals.get(a)) for a in arguments):
            places.setdefault(name, None)
        caller = frame.f_back
        if caller is None or caller.f_code is wrapper_code:
            return
        calling = caller.f_globals.get("__name__", "")
        if not calling.startswith("sdpa_array") or calling == "sdpa_array._arrays.parallel":
            return
        below, above = _layer(calling), _layer(module)
        if below is not None and above is not None and above < below:
            steps_up.append(f"{calling}.{caller.f_code.co_qualname} -> {name}")

    sys.setprofile(profile)
    try:
        function(query, *args, **kwargs)
    finally:
        sys.setprofile(None)
    return list(places), steps_up


def _arrays(library: str) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 256, 32), dtype=np.float32) for _ in range(3))
    if library == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)
    return q, k, v


def _segments(library: str) -> dict[str, Any]:
    ids = np.repeat(np.arange(4, dtype=np.int32), 64)[None]
    if library == "torch":
        import torch

        return {"segment_ids": (torch.from_numpy(ids), torch.from_numpy(ids))}
    return {"segment_ids": (ids, ids)}


#: (name, library, keywords, the bound on its places).
CASES = [
    ("default", "numpy", {}, PLAIN),
    ("causal", "numpy", {"is_causal": True}, PLAIN),
    ("lse", "numpy", {"return_lse": True}, PLAIN),
    ("key lengths", "numpy", {"key_lengths": 100}, PLAIN),
    ("BLHE", "numpy", {"layout": "BLHE"}, PLAIN),
    ("default", "torch", {}, PLAIN),
    ("causal", "torch", {"is_causal": True}, PLAIN),
    ("blocked causal", "numpy", {"implementation": "blocked", "is_causal": True}, 26),
    ("mask_mod", "numpy", {"mask_mod": mods.causal()}, 29),
    ("segment ids", "numpy", "segments", 39),
    ("blocked, mask", "torch", {"implementation": "blocked", "mask": "ones"}, 41),
]


@pytest.mark.parametrize(
    ("library", "keywords", "bound"),
    [pytest.param(lib, kw, bound, id=f"{lib}-{name}") for name, lib, kw, bound in CASES],
)
def test_a_forward_call_visits_few_places_and_never_climbs_back(
    library: str, keywords: Any, bound: int
) -> None:
    q, k, v = _arrays(library)
    if keywords == "segments":
        keywords = _segments(library)
    elif keywords.get("mask") == "ones":
        import torch

        keywords = {**keywords, "mask": torch.ones(256, 256, dtype=torch.bool)}
    sa.scaled_dot_product_attention(q, k, v, **keywords)  # planned and kept once
    places, steps_up = _trace(sa.scaled_dot_product_attention, q, k, v, **keywords)
    assert places[0] == "sdpa_array._api.forward.scaled_dot_product_attention"
    assert len(places) <= bound, "\n".join(places)
    assert steps_up == []


def test_the_trace_sees_a_step_up() -> None:
    """The check itself: a kernel-layer function calling back into the public face is a
    step up."""
    from sdpa_array._kernels import layout as kernel_layout

    def climb(query: Any) -> None:
        kernel_layout.__dict__["_test_climb"](query)

    source = "def _test_climb(query):\n    return sa.explain(query, query, query)\n"
    namespace = kernel_layout.__dict__
    exec(compile(source, kernel_layout.__file__, "exec"), namespace)
    namespace["sa"] = sa
    try:
        q, _, _ = _arrays("numpy")
        _, steps_up = _trace(climb, q)
    finally:
        del namespace["_test_climb"], namespace["sa"]
    assert steps_up
    assert steps_up[0].startswith("sdpa_array._kernels.layout._test_climb")
