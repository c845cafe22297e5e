"""Test helpers: run the library on a backend and check it with :mod:`sdpa_array.testing`.

The error bounds come from :mod:`sdpa_array.testing.bounds`, whose docstrings derive them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array._kernels import native
from sdpa_array.testing import (
    Backend,
    assert_array_like,
    assert_close,
    assert_close_to_oracle,
    assert_vjp_close_to_oracle,
    assert_within,
    vjp_oracle_and_bounds,
)
from sdpa_array.testing.bounds import (
    UNIT_ROUNDOFF,
    compute_dtype,
    lse_bound,
    output_bound,
    score_error,
)

__all__ = [
    "KV",
    "KV_EV",
    "Q_GQA",
    "UNIT_ROUNDOFF",
    "Q",
    "assert_array_like",
    "assert_close",
    "assert_unchanged",
    "assert_within",
    "check_against_oracle",
    "check_vjp_against_oracle",
    "compute_dtype",
    "lse_bound",
    "output_bound",
    "rounded",
    "score_error",
    "snapshot",
    "spy_native_kernels",
    "vjp_oracle_and_bounds",
]

#: Shapes that most fixed cases of the test files share, so that libraries which compile
#: every operation anew for each new shape (``SHAPE_COMPILING_LIBRARIES`` of
#: ``tests/conftest.py``: JAX) compile once for all of them. A case uses other shapes only
#: where the shapes are what it tests (no heads axis, broadcast batch axes, ``L > S``...).
#: ``(batch, heads, L, E)`` of the query and ``(batch, heads, S, E)`` of key and value, with
#: ``L < S``; ``Q_GQA`` has twice the heads of ``KV``; ``KV_EV`` a value feature size
#: ``Ev != E``.
Q = (2, 2, 6, 4)
KV = (2, 2, 7, 4)
Q_GQA = (2, 4, 6, 4)
KV_EV = (2, 2, 7, 3)


def rounded(backend: Backend, a: np.ndarray, dtype: str) -> tuple[Any, np.ndarray]:
    """Put ``a`` on ``backend`` in ``dtype``; also return the rounded values in float64."""
    x = backend.asarray(a, dtype)
    return x, reference.to_numpy(x).astype(np.float64)


def snapshot(inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """The values of the arrays among ``inputs`` (other values are left out)."""
    return {name: reference.to_numpy(x) for name, x in inputs.items() if hasattr(x, "shape")}


def assert_unchanged(inputs: dict[str, Any], before: dict[str, np.ndarray]) -> None:
    """No implementation writes to the caller's arrays (``numpy:readonly`` would raise where
    NumPy writes; this also catches a write that checks ``writeable`` first)."""
    for name, values in before.items():
        np.testing.assert_array_equal(
            reference.to_numpy(inputs[name]), values, err_msg=f"the call changed its {name}"
        )


CALL_ONLY = ("implementation", "block_q", "block_k")


def ran_fused(q: Any, k: Any, v: Any, run: dict[str, Any], *, vjp: bool = False) -> bool:
    """Whether the call ``f(q, k, v, **run)`` (its VJP, or an autograd backward through it,
    with ``vjp``) runs a fused kernel in the inputs' dtype, as :func:`sdpa_array.explain`
    says: the oracle's bound then has that kernel's terms."""
    explanation = sdpa_array.explain(q, k, v, **run)
    return explanation.vjp_fused if vjp else explanation.forward_fused


def as_checked(q: Any, k: Any, v: Any, run: dict[str, Any], *, vjp: bool = False) -> dict:
    """The keyword arguments of ``assert_(vjp_)close_to_oracle`` for a call made with
    ``run``: its options, less the implementation and blocks, and ``fused``."""
    options = {name: x for name, x in run.items() if name not in CALL_ONLY}
    return {**options, "fused": ran_fused(q, k, v, run, vjp=vjp)}


def check_against_oracle(
    backend: Backend,
    dtype: str,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    implementation: str = "auto",
    return_weights: bool = True,
    **options: Any,
) -> tuple[Any, ...]:
    """Run the library on ``backend`` in ``dtype`` and check every output with the oracle.

    Inputs are rounded to ``dtype`` first and the oracle gets the rounded values
    (:func:`sdpa_array.testing.assert_close_to_oracle`). Returns the library's
    ``(out, weights, lse)`` (``weights`` is None if not requested).
    """
    xq, xk, xv = (backend.asarray(a, dtype) for a in (q, k, v))
    xmask = None if mask is None else backend.asarray(mask)
    xbias = None if bias is None else backend.asarray(bias, dtype)
    inputs = {"query": xq, "key": xk, "value": xv, "mask": xmask, "bias": xbias}
    before = snapshot(inputs)
    run = {"mask": xmask, "bias": xbias, "implementation": implementation, **options}
    run |= {"return_weights": return_weights, "return_lse": True}
    result = sdpa_array.scaled_dot_product_attention(xq, xk, xv, **run)
    assert_unchanged(inputs, before)
    assert_close_to_oracle(result, xq, xk, xv, **as_checked(xq, xk, xv, run))
    return result[0], (result[1] if return_weights else None), result[-1]


def check_vjp_against_oracle(
    backend: Backend,
    dtype: str,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    **options: Any,
) -> tuple[Any, ...]:
    """Run the library's VJP on ``backend`` in ``dtype`` and check every gradient.

    Inputs are rounded to ``dtype`` first and the oracle gets the rounded values
    (:func:`sdpa_array.testing.assert_vjp_close_to_oracle`, whose bound has a fused
    kernel's terms where the call runs one). Returns the gradients.
    """
    xq, xk, xv, xg = (backend.asarray(a, dtype) for a in (q, k, v, d_out))
    xmask = None if mask is None else backend.asarray(mask)
    xbias = None if bias is None else backend.asarray(bias, dtype)
    inputs = {"query": xq, "key": xk, "value": xv, "grad_output": xg, "mask": xmask, "bias": xbias}
    before = snapshot(inputs)
    run = {"implementation": implementation, "block_q": block_q, "block_k": block_k}
    run |= {"mask": xmask, "bias": xbias, **options}
    got = sdpa_array.scaled_dot_product_attention_vjp(xq, xk, xv, xg, **run)
    assert_unchanged(inputs, before)
    assert_vjp_close_to_oracle(got, xq, xk, xv, xg, **as_checked(xq, xk, xv, run, vjp=True))
    return got


def spy_native_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each native kernel that runs: the rows of
    :data:`sdpa_array._kernels.native.NATIVE_KERNELS`, wrapped where their plan's call runs.
    """
    called: list[str] = []
    rows = []
    for row in native.NATIVE_KERNELS:

        def plan_and_record(p, req, plan=row.plan, kernel=row.kernel):
            delegation = plan(p, req)

            def run(run=delegation.run):
                called.append(kernel)
                return run()

            return dataclasses.replace(delegation, run=run)

        rows.append(dataclasses.replace(row, plan=plan_and_record))
    monkeypatch.setattr(native, "NATIVE_KERNELS", tuple(rows))
    return called
