"""The paths a call can take, for tests that check one feature on every path.

A feature's test file (``tests/test_<feature>.py``) lists its cases in a module-level
``PATH_CASES`` (:class:`FeatureCase`) and asks for the ``path_case`` fixture; ``conftest.py``
generates one test per selected backend, dtype, :data:`PATHS` entry and case, for the
combinations the path computes (:meth:`Path.accepts`): a path that does not take an option
generates no test rather than a skipped one. Each test runs the case through its path with
:func:`check_on_path`, which compares the forward result (output and log-sum-exp) and, where
the path has them, the gradients with the float64 oracle within the derived bounds of
:mod:`sdpa_array.testing.bounds`.

The paths:

``materialized``, ``blocked``, ``blocked-3x4``
    the forward function and :func:`sdpa_array.scaled_dot_product_attention_vjp` with that
    implementation: ``blocked`` with its own block sizes (whole rows of the small cases in
    one tile: the softmax of a tile), ``blocked-3x4`` with 3 x 4 tiles, so that the cases
    span several tiles, partial ones at the edges (the online softmax, and ``P``
    recomputed from the log-sum-exp in the backward); their forward calls also return the
    maximum scores, checked against the oracle's;
``auto``
    both functions' own choice: a native kernel where one computes the call (torch on the
    CPU), a generic kernel otherwise;
``native``
    ``implementation="native"``: the library's own kernel (torch's SDPA, ``jax.nn``), for
    the cases every native kernel computes (:attr:`FeatureCase.native`), in the dtypes in
    which it returns the log-sum-exp;
``autograd``
    the forward function under the library's own autodiff (torch autograd, ``jax.vjp``),
    on torch and JAX;
``kv_cache``
    :func:`sdpa_array.attention_with_kv_cache` with the keys and values as full caches
    (forward only, with the maximum scores), for the options that function takes.

Dask arrays take every path lazily (the ``dask`` backend), and the Triton kernels are the
``auto`` path on a GPU (``nox -s tests-cuda``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array.testing import Backend, assert_close_to_oracle, assert_vjp_close_to_oracle
from tests.helpers import as_checked, assert_unchanged, snapshot
from tests.libraries import AUTOGRAD_LIBRARIES, native_lse

__all__ = [
    "PATHS",
    "FeatureCase",
    "Path",
    "PathCase",
    "check_on_path",
    "path_cases",
    "random_mask",
    "random_normal",
    "swap_length_and_heads",
]

#: Option values given as NumPy floating arrays that the call takes in the inputs' dtype;
#: other NumPy arrays (masks, lengths, segment ids) keep their own dtype.
FLOAT_OPTIONS = frozenset({"bias", "sinks", "scale"})

#: Options whose arrays have a gradient (the VJP's order after query, key and value).
DIFFERENTIABLE_OPTIONS = ("bias", "sinks", "scale")


def random_mask(*shape: int, seed: int = 0, keep: float = 0.7) -> np.ndarray:
    """A boolean mask of ``shape`` keeping about ``keep`` of the pairs."""
    return np.random.default_rng(seed).random(shape) < keep


def random_normal(*shape: int, seed: int = 0) -> np.ndarray:
    """Standard normal values of ``shape`` (a bias, sinks...)."""
    return np.random.default_rng(seed).standard_normal(shape)


@dataclass(frozen=True)
class FeatureCase:
    """One case of a feature: shapes of query, key and value, and the call's options.

    Array options are NumPy arrays, put on each backend by :meth:`arrays` (floating ones
    of :data:`FLOAT_OPTIONS` in the case's dtype); numbers, flags and functions
    (``mask_mod``, ``bias_mod``) are given as they are.
    """

    id: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    options: dict[str, Any] = field(default_factory=dict)
    #: on the ``native`` path: ``True`` if every native kernel computes the case in the
    #: dtypes it computes (the path fails if one refuses it), or the reason every native
    #: kernel's refusal of the forward call must name (``CannotDelegateError`` before any
    #: work; the VJP must delegate or refuse for that reason); ``None`` keeps the case off
    #: that path
    native: bool | str | None = None

    def arrays(self, backend: Backend, dtype: str) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Query, key, value, output cotangent and options on ``backend`` in ``dtype``,
        drawn from a generator seeded by the case's id."""
        rng = np.random.default_rng(zlib.crc32(self.id.encode()))
        q, k, v = (rng.standard_normal(s) for s in (self.q, self.k, self.v))
        out_shape = reference.scaled_dot_product_attention(q, k, v, **self.options).shape
        g = rng.standard_normal(out_shape)

        def put(name: str, value: Any) -> Any:
            if isinstance(value, tuple):  # segment ids (query's, key's), windows
                return tuple(put(name, x) for x in value)
            if not isinstance(value, np.ndarray):
                return value
            if name in FLOAT_OPTIONS and value.dtype.kind == "f":
                return backend.asarray(value, dtype)
            return backend.asarray(value)

        options = {name: put(name, value) for name, value in self.options.items()}
        return (*(backend.asarray(a, dtype) for a in (q, k, v, g)), options)


@dataclass(frozen=True)
class Path:
    """How a call reaches a kernel (see the module's docstring)."""

    name: str
    #: the call's own keyword arguments
    call: dict[str, Any]
    #: the backends and dtypes it runs on (default: every one)
    backends: Callable[[Backend, str], bool] = lambda b, dtype: True
    #: the options it takes (``None``: every option)
    options: frozenset[str] | None = None
    #: whether it computes gradients
    gradients: bool = True
    #: whether it also returns the attention weights (checked too)
    weights: bool = False
    #: whether its forward call also returns the maximum scores (checked too)
    max_scores: bool = False
    #: a further condition on the case (default: none)
    condition: Callable[[FeatureCase], bool] = lambda case: True

    def accepts(self, backend: Backend, dtype: str, case: FeatureCase) -> bool:
        """Whether this path computes ``case`` on ``backend`` in ``dtype``."""
        if not self.backends(backend, dtype):
            return False
        if self.options is not None and not set(case.options) <= self.options:
            return False
        return self.condition(case)


def _bottom_right_or_unrestricted(case: FeatureCase) -> bool:
    """The KV cache aligns causal masks and windows to the bottom right and takes no other
    ``alignment``: cases aligned otherwise (the main function's default is the top left)
    differ where ``L != S``."""
    alignment = case.options.get("alignment")
    restricted = case.options.get("is_causal") or case.options.get("window") is not None
    aligned = alignment == "bottom_right" or case.q[-2] == case.k[-2]
    return alignment in (None, "bottom_right") and (not restricted or aligned)


#: Every path (see the module's docstring).
PATHS = (
    Path("materialized", {"implementation": "materialized"}, weights=True, max_scores=True),
    Path("blocked", {"implementation": "blocked"}, max_scores=True),
    Path(
        "blocked-3x4",
        {"implementation": "blocked", "block_q": 3, "block_k": 4},
        max_scores=True,
    ),
    Path("auto", {"implementation": "auto"}),
    Path(
        "native",
        {"implementation": "native"},
        backends=native_lse,
        condition=lambda case: case.native is not None,
    ),
    Path(
        "autograd",
        {"implementation": "auto"},
        backends=lambda b, dtype: b.library in AUTOGRAD_LIBRARIES,
    ),
    Path(
        "kv_cache",
        {},
        options=frozenset(
            {"mask", "bias", "is_causal", "window", "scale", "softcap", "enable_gqa", "alignment"}
        ),
        gradients=False,
        max_scores=True,
        condition=lambda case: (
            len(case.q) == len(case.k) == len(case.v) == 4
            and case.q[0] == case.k[0] == case.v[0]
            and _bottom_right_or_unrestricted(case)
            and not isinstance(case.options.get("scale"), np.ndarray)
        ),
    ),
)


@dataclass(frozen=True)
class PathCase:
    """One generated combination: a backend, a dtype, a path and a feature's case."""

    backend: Backend
    dtype: str
    path: Path
    case: FeatureCase


def path_cases(backends: list[Backend], cases: list[FeatureCase]) -> list[PathCase]:
    """Every (backend, dtype, path, case) the paths compute."""
    return [
        PathCase(b, dtype, path, case)
        for b in backends
        for dtype in b.dtypes
        for path in PATHS
        for case in cases
        if path.accepts(b, dtype, case)
    ]


#: library -> native refusals of the forward call returning the log-sum-exp that its native
#: backward does not share (torch differentiates its math kernel, which takes ``Ev != E``).
FORWARD_ONLY_REFUSALS = {"torch": frozenset({"Ev == E"})}


def _refuses_backward(backend: Backend, reason: str) -> bool:
    return reason not in FORWARD_ONLY_REFUSALS.get(backend.library, frozenset())


def swap_length_and_heads(x: Any) -> Any:
    """Axes -3 and -2 exchanged, in x's own library (a ``"BLHE"`` array heads first, and
    back)."""
    xp = sdpa_array._arrays.compat.array_namespace({"x": x})
    order = [*range(x.ndim - 3), x.ndim - 2, x.ndim - 3, x.ndim - 1]
    return xp.permute_dims(x, tuple(order))


def _autodiff(backend: Backend, q: Any, k: Any, v: Any, g: Any, run: dict[str, Any]) -> tuple:
    """The forward result and the gradients of ``sum(out * g)`` with respect to query,
    key, value and the differentiable options' arrays, by the library's own autodiff."""
    names = [n for n in DIFFERENTIABLE_OPTIONS if _is_array(run.get(n))]
    leaves = [q, k, v, *(run[n] for n in names)]

    def forward(*xs: Any) -> Any:
        options = dict(run, **dict(zip(names, xs[3:], strict=True)))
        return sdpa_array.scaled_dot_product_attention(*xs[:3], return_lse=True, **options)

    if backend.library == "torch":
        import torch

        xs = [x.detach().clone().requires_grad_(True) for x in leaves]
        out, lse = forward(*xs)
        grads = torch.autograd.grad(out, xs, g)
        return (out.detach(), lse.detach()), grads
    import jax

    (out, lse), pullback = jax.vjp(forward, *leaves)
    return (out, lse), pullback((g, jax.numpy.zeros_like(lse)))


def _is_array(x: Any) -> bool:
    return x is not None and hasattr(x, "shape")


def check_on_path(item: PathCase) -> None:
    """Run ``item``'s case through its path and check its results against the oracle."""
    backend, dtype, path, case = item.backend, item.dtype, item.path, item.case
    q, k, v, g, options = case.arrays(backend, dtype)
    run = {**options, **path.call}
    if path.name == "native" and isinstance(case.native, str):
        # refused with the reason, before any work
        with pytest.raises(sdpa_array.CannotDelegateError, match=case.native):
            sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **run)
        if _refuses_backward(backend, case.native):
            with pytest.raises(sdpa_array.CannotDelegateError, match=case.native):
                sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
        else:
            grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
            assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, run, vjp=True))
        return
    inputs = {"query": q, "key": k, "value": v, "grad_output": g, **options}
    before = snapshot(inputs)
    if path.name == "kv_cache":
        lengths = [case.k[-2]] * case.k[0]
        result = sdpa_array.attention_with_kv_cache(
            q, k, v, cache_lengths=lengths, return_lse=True, return_max_scores=True, **run
        )[:3]
        grads = None
    elif path.name == "autograd":
        result, grads = _autodiff(backend, q, k, v, g, run)
    else:
        forward = {**run, "return_max_scores": True} if path.max_scores else run
        result = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **forward)
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    assert len(result) == 2 + path.max_scores
    checked = as_checked(q, k, v, run)
    if path.weights:
        with_weights = sdpa_array.scaled_dot_product_attention(
            q, k, v, return_weights=True, return_lse=True, **run
        )
        assert_close_to_oracle(
            with_weights, q, k, v, return_weights=True, return_lse=True, **checked
        )
    assert_unchanged(inputs, before)
    checked_vjp = None if grads is None else as_checked(q, k, v, run, vjp=True)
    if options.get("layout") == "BLHE":
        # a layout only moves axes: the bound is that of the heads-first call
        q, k, v, g = (swap_length_and_heads(x) for x in (q, k, v, g))
        result = (swap_length_and_heads(result[0]), *result[1:])
        if grads is not None:
            grads = (*(swap_length_and_heads(x) for x in grads[:3]), *grads[3:])
        checked = {name: x for name, x in checked.items() if name != "layout"}
        if checked_vjp is not None:
            del checked_vjp["layout"]
    assert_close_to_oracle(
        result, q, k, v, return_lse=True, return_max_scores=path.max_scores, **checked
    )
    if grads is not None:
        assert_vjp_close_to_oracle(tuple(grads), q, k, v, g, **checked_vjp)
