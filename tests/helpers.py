"""Test helpers: the error bound against the float64 oracle, and a strict ``assert_close``.

Error bound
-----------
The oracle receives exactly the same (already rounded) inputs, converted to float64, so only
the arithmetic of the implementation under test is measured. With unit roundoff ``u_c`` of the
compute dtype (float32 for float16/bfloat16 inputs) and ``u_o`` of the output dtype:

* each score ``s_ij = scale * sum_e q_ie k_je`` (plus a bias and a soft-cap, whose derivative is
  at most 1) is off by at most ``|ds| <= (E + 2) u_c * scale * max_ij sum_e |q_ie||k_je|
  + 2 u_c * max|bias| (+ 4 u_c * softcap)``, the standard ``gamma_E`` bound for a dot
  product of length ``E``;
* the softmax maps a score perturbation ``ds`` to a relative weight perturbation of at most
  ``2 max|ds|``, and ``exp``, the row sum of length ``S`` and the division add ``(S + 4) u_c``;
* the output ``sum_j p_j v_j`` is a convex combination: its error is at most
  ``max|v| * (2 max|ds| + (S + 4) u_c) + (S + 2) u_c * max|v|`` (the product with ``V`` is a
  dot product of length ``S``), and the final rounding to the output dtype adds
  ``u_o * max|out|``.

So ``bound = max|v| * (2 |ds| + (2 S + 6) u_c) + u_o * max|out|``. The weights obey the
same bound with ``max|v| = 1``; the log-sum-exp is off by at most ``|ds| + (S + 4) u_c (1 +
|lse|)``. Both are first-order worst-case bounds (no statistical averaging), so a test that
exceeds them has found a real error, not noise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sdpa_array import reference
from sdpa_array.backends import Backend

UNIT_ROUNDOFF = {
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float32": 2.0**-24,
    "float64": 2.0**-53,
}


def compute_dtype(dtype: str) -> str:
    """Dtype in which scores and softmax run for inputs of ``dtype`` (at least float32)."""
    return "float64" if dtype == "float64" else "float32"


def score_error(
    dtype: str,
    q: np.ndarray,
    k: np.ndarray,
    scale: float,
    bias: Any = None,
    softcap: float | None = None,
) -> float:
    """Worst-case absolute error of one final score (see the module docstring).

    A soft-cap has derivative at most 1, so it passes the product's error through, and its
    own ``tanh``, division and multiplication add at most ``4 u_c * softcap``.
    """
    u = UNIT_ROUNDOFF[compute_dtype(dtype)]
    E = q.shape[-1]
    if q.size == 0 or k.size == 0:
        qk = 0.0
    else:
        # max over every (query, key) pair of any batch/head: a superset of the pairs that
        # meet, hence still an upper bound; for very large inputs, the cheaper
        # sum_e max_i |q_ie| max_j |k_je| bounds it from above.
        qa, ka = np.abs(q).reshape(-1, E), np.abs(k).reshape(-1, E)
        if qa.shape[0] * ka.shape[0] <= 2**24:
            qk = float(np.max(qa @ ka.T))
        else:
            qk = float(np.max(qa, axis=0) @ np.max(ka, axis=0))
    err = (E + 2) * u * scale * qk
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64)
        finite = b[np.isfinite(b)]
        err += 2 * u * (float(np.max(np.abs(finite))) if finite.size else 0.0)
    if softcap is not None:
        err += 4 * u * softcap
    return err


def output_bound(dtype: str, *, S: int, ds: float, v_max: float, out_max: float) -> float:
    """Error bound for ``out`` (``v_max = 1`` gives the bound for the weights)."""
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    u_o = UNIT_ROUNDOFF[dtype]
    return v_max * (2 * ds + (2 * S + 6) * u_c) + u_o * out_max


def lse_bound(dtype: str, *, S: int, ds: float, lse_max: float) -> float:
    """Error bound for the log-sum-exp."""
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    return ds + (S + 4) * u_c * (1 + lse_max)


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
