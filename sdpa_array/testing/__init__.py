"""Testing attention against the float64 oracle, on any array library (public).

* :func:`assert_close_to_oracle` and :func:`assert_vjp_close_to_oracle` check results and
  gradients of any library in one call: library, array type, shape, dtype and device, then
  the error bound derived in :mod:`sdpa_array.testing.bounds`;
* :func:`assert_varlen_close_to_oracle` and :func:`assert_varlen_vjp_close_to_oracle` do
  the same for the packed variable-length layout;
* :mod:`sdpa_array.testing.backends` is the registry of array backends that the test suite,
  the benchmarks, the demo and the docs share.

Examples
--------
>>> import numpy as np
>>> from sdpa_array import scaled_dot_product_attention
>>> from sdpa_array.testing import assert_close_to_oracle
>>> q = np.random.default_rng(0).standard_normal((2, 5, 4), dtype=np.float32)
>>> out = scaled_dot_product_attention(q, q, q, is_causal=True)
>>> assert_close_to_oracle(out, q, q, q, is_causal=True)
"""

from .assertions import (
    assert_array_like,
    assert_close,
    assert_close_to_oracle,
    assert_vjp_close_to_oracle,
    assert_within,
    dtype_name,
)
from .backends import BACKENDS, Backend, BackendUnavailable, available_backends, get_backend
from .bounds import (
    UNIT_ROUNDOFF,
    compute_dtype,
    lse_bound,
    output_bound,
    score_error,
)
from .varlen import assert_varlen_close_to_oracle, assert_varlen_vjp_close_to_oracle
from .vjp_bounds import vjp_oracle_and_bounds

__all__ = [
    "BACKENDS",
    "UNIT_ROUNDOFF",
    "Backend",
    "BackendUnavailable",
    "assert_array_like",
    "assert_close",
    "assert_close_to_oracle",
    "assert_varlen_close_to_oracle",
    "assert_varlen_vjp_close_to_oracle",
    "assert_vjp_close_to_oracle",
    "assert_within",
    "available_backends",
    "compute_dtype",
    "dtype_name",
    "get_backend",
    "lse_bound",
    "output_bound",
    "score_error",
    "vjp_oracle_and_bounds",
]
