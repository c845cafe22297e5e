"""Error bounds against the float64 oracle; the same module as :mod:`sdpa_array.testing.bounds`."""

from .testing.bounds import (
    UNIT_ROUNDOFF,
    compute_dtype,
    lse_bound,
    output_bound,
    score_error,
    vjp_oracle_and_bounds,
)

__all__ = [
    "UNIT_ROUNDOFF",
    "compute_dtype",
    "lse_bound",
    "output_bound",
    "score_error",
    "vjp_oracle_and_bounds",
]
