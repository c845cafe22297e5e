"""Test helpers: a strict ``assert_close`` and ``check_against_oracle``.

The error bounds come from :mod:`sdpa_array.accuracy`, whose docstring derives them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sdpa_array import reference
from sdpa_array.accuracy import (
    UNIT_ROUNDOFF,
    compute_dtype,
    lse_bound,
    output_bound,
    score_error,
)
from sdpa_array.backends import Backend

__all__ = [
    "UNIT_ROUNDOFF",
    "assert_array_like",
    "assert_close",
    "check_against_oracle",
    "compute_dtype",
    "lse_bound",
    "output_bound",
    "rounded",
    "score_error",
]


def rounded(backend: Backend, a: np.ndarray, dtype: str) -> tuple[Any, np.ndarray]:
    """Put ``a`` on ``backend`` in ``dtype``; also return the rounded values in float64."""
    x = backend.asarray(a, dtype)
    return x, reference.to_numpy(x).astype(np.float64)


def assert_array_like(actual: Any, like: Any, *, shape: tuple[int, ...], dtype: Any) -> None:
    """Check library, array type, shape, dtype and device of ``actual`` against ``like``."""
    from sdpa_array._compat import array_namespace, device

    assert type(actual) is type(like), f"array type {type(actual)} != {type(like)}"
    assert array_namespace({"a": actual}) is array_namespace({"b": like})
    assert tuple(actual.shape) == tuple(shape), f"shape {tuple(actual.shape)} != {shape}"
    assert actual.dtype == dtype, f"dtype {actual.dtype} != {dtype}"
    assert device(actual) == device(like), f"device {device(actual)} != {device(like)}"


def assert_close(actual: Any, expected: np.ndarray, bound: float, what: str = "out") -> None:
    """Compare on the host: same shape, identical non-finite pattern, error within ``bound``."""
    got = reference.to_numpy(actual).astype(np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN in result"
    np.testing.assert_array_equal(
        np.isfinite(got), np.isfinite(expected), err_msg=f"{what}: non-finite pattern differs"
    )
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got[~finite], expected[~finite], err_msg=f"{what}: infinities")
    err = float(np.max(np.abs(got[finite] - expected[finite]))) if finite.any() else 0.0
    assert err <= bound, f"{what}: max error {err:.3e} exceeds the bound {bound:.3e}"


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
    """Run the library on ``backend`` in ``dtype`` and compare every output with the oracle.

    Inputs are rounded to ``dtype`` first and the oracle gets the rounded values, so the
    comparison measures the implementation's arithmetic only, within the bound above.
    Returns the library's ``(out, weights, lse)`` (``weights`` is None if not requested).
    """
    import sdpa_array
    from sdpa_array._compat import array_namespace

    xq, q64 = rounded(backend, q, dtype)
    xk, k64 = rounded(backend, k, dtype)
    xv, v64 = rounded(backend, v, dtype)
    xmask = None if mask is None else backend.asarray(mask)
    xbias, bias64 = (None, None) if bias is None else rounded(backend, bias, dtype)
    result = sdpa_array.scaled_dot_product_attention(
        xq,
        xk,
        xv,
        mask=xmask,
        bias=xbias,
        return_weights=return_weights,
        return_lse=True,
        implementation=implementation,
        **options,
    )
    out, lse = result[0], result[-1]
    weights = result[1] if return_weights else None
    ref_out, ref_w, ref_lse = reference.scaled_dot_product_attention(
        q64, k64, v64, mask=mask, bias=bias64, return_weights=True, return_lse=True, **options
    )
    xp = array_namespace({"query": xq})
    compute = xq.dtype if dtype in ("float32", "float64") else xp.float32
    assert_array_like(out, xq, shape=ref_out.shape, dtype=xq.dtype)
    assert_array_like(lse, xq, shape=ref_lse.shape, dtype=compute)
    scale = options.get("scale") or (1.0 / np.sqrt(q.shape[-1]) if q.shape[-1] else 1.0)
    S = k.shape[-2]
    ds = score_error(dtype, q64, k64, scale, bias64, options.get("softcap"))
    v_max = float(np.max(np.abs(v64))) if v64.size else 0.0
    out_max = float(np.max(np.abs(ref_out))) if ref_out.size else 0.0
    finite_lse = ref_lse[np.isfinite(ref_lse)]
    lse_max = float(np.max(np.abs(finite_lse))) if finite_lse.size else 0.0
    assert_close(out, ref_out, output_bound(dtype, S=S, ds=ds, v_max=v_max, out_max=out_max))
    assert_close(lse, ref_lse, lse_bound(dtype, S=S, ds=ds, lse_max=lse_max), "lse")
    if return_weights:
        assert_array_like(weights, xq, shape=ref_w.shape, dtype=xq.dtype)
        assert_close(
            weights, ref_w, output_bound(dtype, S=S, ds=ds, v_max=1.0, out_max=1.0), "weights"
        )
    return out, weights, lse
