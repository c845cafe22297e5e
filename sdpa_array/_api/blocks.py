"""One block of a longer call: query rows and key rows taken at their absolute positions.

Context parallelism (:mod:`sdpa_array.distributed`) computes a call of ``L`` queries and
``S`` keys as (query block, key block) pairs, each on the arrays a participant holds. A
block's causal and window restrictions are those of the whole call, its
:class:`~sdpa_array._problem.band.Band` moved to the block's offsets, exactly as the Dask
graph moves it for a chunk pair: the block is validated as a call of its own, its band
replaced by the whole call's with the diagonal of its first query at key
``offset + rows - cols``, its lengths (counted over the whole sequence) moved to its first
query and key as the Dask graph moves them, and the planner and kernels run it as any
call. The backward
of a block takes the whole call's output and log-sum-exp of its query rows (the softmax's
normaliser covers every key block), so that summing the blocks' gradients gives the call's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._arrays.compat import array_namespace
from .._arrays.typing import Array
from .._plan.run import run_forward, run_vjp
from .._problem.band import Band, window_bounds
from .._problem.options import Options
from .._problem.outputs import Outputs
from .._problem.problem import Problem, validate
from .._problem.sequences import lengths_at
from .vjp import check_grad_output

__all__ = ["block_band", "block_forward", "block_options", "block_vjp"]


def block_band(options: Options, extent: tuple[int, int], rows: slice, cols: slice) -> Band:
    """The band of the block of queries ``rows`` and keys ``cols`` of a call of ``extent``
    ``(L, S)`` queries and keys: the whole call's restrictions, with the block's first
    query and key as 0 (``options`` validated already)."""
    L, S = extent
    offset = 0 if options.alignment == "top_left" else S - L
    left, right = window_bounds(options.window, L + S)
    return Band(
        L=rows.stop - rows.start,
        S=cols.stop - cols.start,
        is_causal=bool(options.is_causal),
        left=left,
        right=right,
        offset=offset + rows.start - cols.start,
    )


def block_options(
    options: Options, lengths: tuple[Array | None, Array | None], rows: range, cols: range
) -> Options:
    """The options of the block of absolute query positions ``rows`` and key positions
    ``cols``: ``options`` with the whole call's ``(query_lengths, key_lengths)`` (integer
    arrays of the inputs' library, or ``None``; padding on the right) moved to the block's
    first query and key and clipped to its rows and columns."""
    q_len, k_len = lengths
    if q_len is None and k_len is None:
        return options
    xp = array_namespace({"lengths": q_len if q_len is not None else k_len})
    return options.replace(
        query_lengths=None if q_len is None else lengths_at(xp, q_len, rows.start, len(rows)),
        key_lengths=None if k_len is None else lengths_at(xp, k_len, cols.start, len(cols)),
    )


def block_is_empty(band: Band) -> bool:
    """Whether the band excludes every (query, key) pair of its block."""
    lo, hi = band.key_range(0, band.L)
    return lo >= hi


def _problem(query: Array, key: Array, value: Array, options: Options, band: Band) -> Problem:
    p = validate(query, key, value, options)
    if (p.L, p.S) != (band.L, band.S):
        raise ValueError(
            f"the block's band is for {band.L} queries and {band.S} keys; the block has "
            f"{p.L} and {p.S}"
        )
    return dataclasses.replace(p, band=band)


def block_forward(
    query: Array,
    key: Array,
    value: Array,
    options: Options,
    band: Band,
    implementation: str = "auto",
) -> tuple[Array, Array]:
    """``(out, lse)`` of one block (heads first) under ``band`` (:func:`block_band`):
    ``out`` in the inputs' dtype, ``lse`` in the compute dtype."""
    p = _problem(query, key, value, options, band)
    result: Any = run_forward(
        query, key, value, options, Outputs(lse=True), implementation, (None, None), p
    )
    return result[0], result[1]


def block_vjp(
    query: Array,
    key: Array,
    value: Array,
    grad_output: Array,
    out: Array,
    lse: Array,
    options: Options,
    band: Band,
    implementation: str = "blocked",
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of one block (heads first) under ``band`` for the output cotangent
    ``grad_output`` of its query rows, with the probabilities taken from the whole call's
    ``out`` and ``lse`` of those rows: ``P = exp(Z - lse)``, ``D = rowsum(dO * out)``.
    ``implementation``: one whose backward kernel takes them (blocked, materialized)."""
    p = _problem(query, key, value, options, band)
    check_grad_output(p, query, grad_output)
    grads = run_vjp(
        query, key, value, grad_output, options, implementation, (None, None), p,
        out=out, lse=lse,
    )  # fmt: skip
    return grads[0], grads[1], grads[2]
