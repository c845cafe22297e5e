"""Error bounds for comparing an attention result with the float64 oracle.

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

These bounds are used by the test suite and by ``python -m sdpa_array demo``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["UNIT_ROUNDOFF", "compute_dtype", "lse_bound", "output_bound", "score_error"]

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
