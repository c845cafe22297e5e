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


# --------------------------------------------------------------------------------------
# The backward pass: error bounds of the gradients against the oracle's
# --------------------------------------------------------------------------------------


def vjp_oracle_and_bounds(
    dtype: str,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    **options: Any,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The oracle's gradients and an element-wise bound on any implementation's error.

    The inputs (``q``, ``k``, ``v``, ``d_out``, ``bias``) are the already rounded float64
    values that the implementation received, so the bound covers its arithmetic only. It is a
    first-order worst-case bound, written out below with ``u`` the unit roundoff of the
    compute dtype, ``u_o`` that of the gradients' dtype, ``ds`` the score error of
    :func:`score_error` and ``|.|`` applied element-wise (all products of non-negative
    arrays), following the steps of the backward pass.

    * ``P``, from the tile's softmax or as ``exp(Z - lse)`` with the forward's ``lse`` (error
      ``ds + (S + 4) u + u |lse|``): ``|dP_ij| <= eps P_ij + u [j admissible]`` with
      ``eps = 3 ds + (2 S + 10) u + 2 u max|lse|``; the ``u`` term is the rounding of
      ``Z - lse`` magnified by ``exp``, ``P |log P| <= 1/e``. Excluded keys are exact zeros.
    * ``dP = dO Vᵀ``, a dot product of length ``Ev``: error ``(Ev + 2) u A`` with
      ``A = |dO| |V|ᵀ``, which also bounds ``|dP|``.
    * ``D = rowsum(P * dP)`` or ``rowsum(dO * O)`` (the same number; ``O`` carries the
      forward's error): ``|D| <= W = rowsum(P A)`` and its error is at most
      ``(eps + (S + Ev + 3) u) W + u rowsum(A [admissible])``.
    * ``dZ = P * (dP - D)``, with ``R = A + W >= |dP - D|``: error
      ``e_Z = e_P R + P ((Ev + 2) u A + e_D) + 2 u P R``, and ``|dZ| <= P R``.
    * Soft-cap: ``dS = dZ * (1 - t²)`` with ``t = tanh(x)``, ``x = raw / softcap``; the error
      of ``x`` is ``ds / softcap + u |x|``, and ``|d(1 - t²)/dx| <= 2``, so
      ``e_S = e_Z (1 - t²) + P R (2 (ds / softcap + u |x|) + 4 u)``. Without it
      ``e_S = e_Z``.
    * ``dQ = scale dS K``, ``dK = scale dSᵀ Q``, ``dV = Pᵀ dO``, ``dBias = dZ``: the propagated
      errors ``scale e_S |K|``, ``scale e_Sᵀ |Q|``, ``e_Pᵀ |dO|`` and ``e_Z``, plus the
      rounding of sums of ``n`` terms, ``(n + 3) u`` times the same products of magnitudes
      (``|dS| |K|``...), where ``n`` counts every term that ends up in one gradient entry: the
      dot product's length (``S`` for ``dQ``, ``L`` for ``dK``/``dV``, 1 for ``dBias``) times
      the number of broadcast batch entries and GQA heads summed into it.
    * Finally the rounding to the gradient's dtype: ``u_o |gradient|``, plus half its
      smallest subnormal for results that underflow (``2**-25`` for float16) where anything
      was computed at all.

    Rows with no admissible key, and keys no query attends, get a bound of exactly zero, so
    their gradients must be exact zeros.

    Returns
    -------
    (list of numpy.ndarray, list of numpy.ndarray)
        The oracle's ``(dQ, dK, dV[, dBias])`` and the bounds, in the same shapes.
    """
    from sdpa_array.reference import (
        _forward,
        _sum_to_shape,
        _unrepeat_heads,
        _validate_and_prepare,
    )

    is_causal = options.get("is_causal", False)
    window = options.get("window")
    alignment = options.get("alignment", "top_left")
    softcap = options.get("softcap")
    expected = list(
        reference.scaled_dot_product_attention_vjp(q, k, v, d_out, mask=mask, bias=bias, **options)
    )
    prep = _validate_and_prepare(
        q,
        k,
        v,
        mask,
        bias,
        window,
        alignment,
        options.get("scale"),
        softcap,
        options.get("enable_gqa", False),
    )
    fwd = _forward(prep, is_causal, window, alignment, softcap)
    u = UNIT_ROUNDOFF[compute_dtype(dtype)]
    u_o = UNIT_ROUNDOFF[dtype]
    underflow = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 2.0**-150}.get(dtype, 0.0)
    scale = prep["scale"]
    L, S, Ev = q.shape[-2], k.shape[-2], v.shape[-1]
    P = fwd["weights"]
    admissible = fwd["allowed"].astype(np.float64)
    finite_lse = fwd["lse"][np.isfinite(fwd["lse"])]
    lse_max = float(np.max(np.abs(finite_lse))) if finite_lse.size else 0.0
    ds = score_error(dtype, q, k, scale, bias, softcap)
    eps = 3 * ds + (2 * S + 10) * u + 2 * u * lse_max
    dO = np.abs(d_out)
    A = np.matmul(dO, np.swapaxes(np.abs(prep["v_rep"]), -1, -2))
    W = np.sum(P * A, axis=-1, keepdims=True)
    R = A + W
    e_P = eps * P + u * admissible
    e_D = (eps + (S + Ev + 3) * u) * W + u * np.sum(A * admissible, axis=-1, keepdims=True)
    e_Z = e_P * R + P * ((Ev + 2) * u * A + e_D) + 2 * u * P * R
    Z_abs = P * R
    if softcap is not None:
        x = np.abs(fwd["raw"]) / softcap
        c = 1.0 - np.tanh(x) ** 2
        e_S = e_Z * c + Z_abs * (2 * (ds / softcap + u * x) + 4 * u)
        S_abs = Z_abs * c
    else:
        e_S, S_abs = e_Z, Z_abs
    K, Q = np.abs(prep["k_rep"]), np.abs(prep["q"])
    T = np.swapaxes
    terms = [
        (scale * np.matmul(e_S, K), scale * np.matmul(S_abs, K), S, False),
        (scale * np.matmul(T(e_S, -1, -2), Q), scale * np.matmul(T(S_abs, -1, -2), Q), L, True),
        (np.matmul(T(e_P, -1, -2), dO), np.matmul(T(P, -1, -2), dO), L, True),
    ]
    if bias is not None:
        terms.append((e_Z, Z_abs, 1, False))
    bounds = []
    for (err, mag, length, per_kv_head), ref, x in zip(
        terms, expected, [q, k, v, bias], strict=False
    ):
        n = length * (mag.size // max(x.size, 1))  # terms summed into one entry
        err = np.broadcast_to(err, mag.shape)
        if per_kv_head:
            err, mag = (_unrepeat_heads(a, prep["group"]) for a in (err, mag))
        err, mag = _sum_to_shape(err, x.shape), _sum_to_shape(mag, x.shape)
        bounds.append(err + (n + 3) * u * mag + u_o * np.abs(ref) + underflow * (err > 0))
    return expected, bounds


def assert_within(actual: Any, expected: np.ndarray, bound: np.ndarray, what: str) -> None:
    """Element-wise ``|actual - expected| <= bound`` on the host, with no NaN anywhere."""
    got = reference.to_numpy(actual).astype(np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN in result"
    err = np.abs(got - expected)
    bad = ~(err <= bound)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), got.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.size} entries exceed their bound; at {worst} "
            f"got {got[worst]!r}, expected {expected[worst]!r}, bound {bound[worst]:.3e}"
        )


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

    Inputs are rounded to ``dtype`` first and the oracle gets the rounded values; each
    gradient must have its input's library, shape, dtype and device, and be within
    :func:`vjp_oracle_and_bounds` of the oracle's. Returns the library's gradients.
    """
    import sdpa_array

    xq, q64 = rounded(backend, q, dtype)
    xk, k64 = rounded(backend, k, dtype)
    xv, v64 = rounded(backend, v, dtype)
    xg, g64 = rounded(backend, d_out, dtype)
    xmask = None if mask is None else backend.asarray(mask)
    xbias, bias64 = (None, None) if bias is None else rounded(backend, bias, dtype)
    got = sdpa_array.scaled_dot_product_attention_vjp(
        xq,
        xk,
        xv,
        xg,
        mask=xmask,
        bias=xbias,
        implementation=implementation,
        block_q=block_q,
        block_k=block_k,
        **options,
    )
    expected, bounds = vjp_oracle_and_bounds(
        dtype, q64, k64, v64, g64, mask=mask, bias=bias64, **options
    )
    inputs = [xq, xk, xv] + ([xbias] if bias is not None else [])
    assert len(got) == len(inputs)
    names = ("dq", "dk", "dv", "dbias")[: len(inputs)]
    for name, g, x, e, b in zip(names, got, inputs, expected, bounds, strict=True):
        assert_array_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(g, e, b, name)
    return got
