"""``attention_with_kv_cache`` through the planner: the choice that runs is the one
:func:`~sdpa_array._api.explain_cache.explain_kv_cache` reports, kept plans still check
every value, and the face reaches no kernel but through the plan.

Every call here is also checked against the float64 oracle with the bound of
``tests/test_kv_cache.py`` (its :func:`~tests.test_kv_cache.run`).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sdpa_array._api.explain_cache import explain_kv_cache
from sdpa_array._api.kv_cache import api as kv_api
from sdpa_array._api.kv_cache import attention_with_kv_cache
from sdpa_array._plan import decode as kv_decode
from sdpa_array.testing.backends import get_backend
from tests.test_kv_cache import host, make_case, run

#: The calls with NumPy arrays of their own (the choice does not depend on the library).
NUMPY = get_backend("numpy")

FACE = Path(__file__).resolve().parents[1] / "sdpa_array" / "_api" / "kv_cache"


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    package = "sdpa_array._api.kv_cache"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base) if node.level else ""
            module = ".".join(p for p in (prefix, node.module or "") if p)
            found += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return found


def test_the_face_imports_no_kernel() -> None:
    """The KV cache's face asks the planner and runs its plan: no module of it imports
    ``sdpa_array._kernels`` (nor names any kernel module in its text)."""
    modules = sorted(FACE.glob("*.py"))
    assert modules
    for path in modules:
        reached = [m for m in _imported_modules(path) if m.startswith("sdpa_array._kernels")]
        assert reached == [], f"{path.name} imports {reached}"
        assert "_kernels" not in path.read_text(), f"{path.name} names the kernels"


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The planner's choices that ran, in order."""
    seen: list[str] = []
    for name, original in list(kv_api.RUNS.items()):

        def recording(plan: Any, caches: Any, _name: str = name, _run: Any = original) -> Any:
            seen.append(_name)
            return _run(plan, caches)

        monkeypatch.setitem(kv_api.RUNS, name, recording)
    return seen


#: (id, case arguments, call options, the planner's choice off a GPU)
CASES = [
    ("contiguous-equal", dict(lengths=[6, 6, 6], new=True, paged=False), {}, "single"),
    ("contiguous-equal-cached", dict(lengths=[9, 9, 9], new=False, paged=False), {}, "single"),
    (
        "contiguous-equal-window",
        dict(lengths=[12, 12, 12], new=False, paged=False),
        dict(window=(3, 0), is_causal=True),
        "single",
    ),
    (
        "contiguous-equal-left-padded",
        dict(lengths=[9, 9, 9], new=True, paged=False, starts=[2, 2, 2]),
        dict(is_causal=True),
        "single",
    ),
    ("contiguous-unequal", dict(lengths=[0, 7, 14], new=True, paged=False), {}, "split"),
    (
        "contiguous-equal-num-splits",
        dict(lengths=[9, 9, 9], new=False, paged=False),
        dict(num_splits=2),
        "split",
    ),
    ("paged-equal", dict(lengths=[6, 6, 6], new=True, paged=True), {}, "split"),
]


@pytest.mark.parametrize(
    ("config", "arguments", "options", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_the_choice_that_runs_is_explained(
    backend: Any, ran: list[str], config: str, arguments: dict, options: dict, expected: str
) -> None:
    """Off a GPU the planner takes one forward call over a contiguous cache's tokens
    where every sequence attends the same ones in one chunk, else split-KV chunks; the
    choice that runs is the one the explanation names, and the result is the oracle's."""
    backend.configure()
    case = make_case(config, heads_kv=4, **arguments)
    lengths = case.lengths
    q, k, v = (
        backend.asarray(a, "float32") for a in (case.query, case.key_cache, case.value_cache)
    )
    new = {}
    if case.new_key is not None:
        new = dict(
            new_key=backend.asarray(case.new_key, "float32"),
            new_value=backend.asarray(case.new_value, "float32"),
        )
    found = explain_kv_cache(
        q,
        k,
        v,
        cache_lengths=lengths,
        cache_leftpad=case.starts,
        block_table=case.table,
        return_lse=True,
        **new,
        **options,
    )
    assert found.kernel == expected
    assert found.automatic
    assert all(reason.startswith(("triton:", "single:")) for reason in found.why)
    assert (found.span is not None) == (expected == "single")
    assert (found.forward is not None) == (expected == "single")
    if expected == "split":
        assert found.pieces >= 1
    assert str(found).startswith(f"kv cache: {expected}")
    run(backend, "float32", case, return_lse=True, **options)
    assert ran == [expected]


def test_single_choice_is_the_forwards_call(ran: list[str]) -> None:
    """The ``"single"`` choice's explanation names the forward's own plan, and a batch
    decoding in step is one forward call, not one per sequence."""
    case = make_case("forward", lengths=[5, 5, 5], new=True, paged=False, heads_kv=4)
    found = explain_kv_cache(
        case.query,
        case.key_cache,
        case.value_cache,
        cache_lengths=case.lengths,
        new_key=case.new_key,
        new_value=case.new_value,
    )
    assert (found.kernel, found.span, found.forward) == ("single", (0, 7), "materialized")
    assert "forward: materialized" in str(found)
    run(NUMPY, "float64", case, return_lse=True, is_causal=True)
    assert ran == ["single"]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kept_plans_check_every_value(paged: bool) -> None:
    """A second call of a planned signature takes the kept checks but still checks its own
    lengths, starts and block table (given as lists, whose values and sizes the signature
    leaves out)."""
    case = make_case("kept", lengths=[2, 3, 0], new=False, paged=paged, heads_kv=4)
    q, k, v = case.query, case.key_cache, case.value_cache
    table = None if case.table is None else case.table.tolist()
    good = dict(cache_lengths=[2, 3, 0], block_table=table, return_lse=True)
    first = attention_with_kv_cache(q, k, v, **good)
    assert np.array_equal(attention_with_kv_cache(q, k, v, **good)[0], first[0])
    with pytest.raises(ValueError, match="cache_lengths must be non-negative"):
        attention_with_kv_cache(q, k, v, **dict(good, cache_lengths=[2, -1, 0]))
    with pytest.raises(ValueError, match="the cache is too small"):
        attention_with_kv_cache(q, k, v, **dict(good, cache_lengths=[2, 3, case.capacity + 1]))
    with pytest.raises(ValueError, match="cache_lengths must have shape"):
        attention_with_kv_cache(q, k, v, **dict(good, cache_lengths=[2, 3]))
    with pytest.raises(ValueError, match="cache_leftpad"):
        attention_with_kv_cache(q, k, v, **dict(good, cache_leftpad=[0, 4, 0]))
    if table is not None:
        bad = [list(row) for row in table]
        bad[0][0] = k.shape[0]
        with pytest.raises(ValueError, match="block_table"):
            attention_with_kv_cache(q, k, v, **dict(good, block_table=bad))


def test_plans_are_kept_by_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second call of a signature reuses the first one's checks (``validate`` is not
    run again); a call with an array among its options is checked anew each time."""
    case = make_case("signature", lengths=[4, 4, 4], new=False, paged=False, heads_kv=4)
    q, k, v = case.query, case.key_cache, case.value_cache
    seen = []
    original = kv_decode.plan_decode

    def planned(c: Any) -> Any:
        seen.append(c.signature is not None and kv_decode.kept_setup(c.signature) is not None)
        return original(c)

    monkeypatch.setattr(kv_api, "plan_decode", planned)
    for _ in range(2):  # the log-sum-exp too: not a plain call (below)
        attention_with_kv_cache(q, k, v, cache_lengths=[4, 4, 4], return_lse=True)
    mask = np.ones((1, 1, 1, k.shape[2]), dtype=bool)
    for _ in range(2):
        attention_with_kv_cache(q, k, v, cache_lengths=[4, 4, 4], mask=mask)
    assert seen == [False, True, False, False]


def test_a_plain_call_planned_once_is_its_forward_call(
    torch_interop_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain call (contiguous, no new token, lengths as a list, simple options) planned
    as one forward call makes that call at once the next time: no check or plan runs, and
    the result is the planned call's, bit for bit. Other lengths, a new token or an option
    of another value are planned (and checked) again."""
    backend = torch_interop_backend
    case = make_case("plain", lengths=[5, 5], new=True, paged=False, heads_kv=2)
    q, k, v = (
        backend.asarray(a, "float32") for a in (case.query, case.key_cache, case.value_cache)
    )
    new = (backend.asarray(case.new_key, "float32"), backend.asarray(case.new_value, "float32"))
    options = {"cache_lengths": [5, 5], "enable_gqa": True, "scale": 0.5}
    run(backend, "float32", case, **{n: x for n, x in options.items() if n != "cache_lengths"})
    first = attention_with_kv_cache(q, k, v, **options)
    planned: list[int] = []
    original = kv_api.plan_decode
    monkeypatch.setattr(kv_api, "plan_decode", lambda c: planned.append(1) or original(c))
    again = attention_with_kv_cache(q, k, v, **options)
    assert planned == []
    assert again[1] is k
    assert again[2] is v
    assert np.array_equal(host(again[0]), host(first[0]))
    for changed in (
        {"cache_lengths": [4, 5]},
        {"scale": 0.25},
        {"new_key": new[0], "new_value": new[1], "cache_lengths": [4, 4]},
    ):
        attention_with_kv_cache(q, k, v, **{**options, **changed})
    assert len(planned) == 3
    with pytest.raises(ValueError, match="cache_lengths must be non-negative"):
        attention_with_kv_cache(q, k, v, **{**options, "cache_lengths": [5, -1]})
