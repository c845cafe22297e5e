"""Error bounds for comparing an attention result with the float64 oracle.

The oracle receives exactly the same (already rounded) inputs, converted to float64, so only
the arithmetic of the implementation under test is measured. With unit roundoff ``u_c`` of the
compute dtype (float32 for float16/bfloat16 inputs) and ``u_o`` of the output dtype:

* each score ``s_ij = scale * sum_e q_ie k_je`` (plus a bias and a soft-cap, whose derivative is
  at most 1) is off by at most ``|ds| <= (E + 2) u_c * scale * max_ij sum_e |q_ie||k_je|
  + 2 u_c * max|bias| + 3 u_c * max|bias_mod| (+ 4 u_c * softcap)``, the standard
  ``gamma_E`` bound for a dot product of length ``E``; a bias is rounded to the compute
  dtype and added (``2 u_c``), a ``bias_mod``'s value may also be computed in it (a
  rounded factor times an exact index difference, ``+ u_c``);
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

The gradients' bounds (:func:`vjp_oracle_and_bounds`) follow the same steps through the
backward pass; its docstring writes them out. These bounds are used by the test suite, by
:func:`sdpa_array.testing.assert_close_to_oracle` and by ``python -m sdpa_array demo``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference
from ..reference._mods import evaluate_mod, index_grids

__all__ = [
    "UNIT_ROUNDOFF",
    "compute_dtype",
    "dtype_name",
    "lse_bound",
    "mod_bias_extent",
    "output_bound",
    "scale_is_array",
    "score_error",
    "vjp_oracle_and_bounds",
]

UNIT_ROUNDOFF = {
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float32": 2.0**-24,
    "float64": 2.0**-53,
}


def dtype_name(x: Any) -> str:
    """The name of an array's floating dtype (``"float32"``, ``"bfloat16"``...)."""
    name = str(x.dtype).rsplit(".", 1)[-1].strip("'>")
    if name not in UNIT_ROUNDOFF:
        raise TypeError(f"not a floating dtype the bounds know: {x.dtype}")
    return name


def scale_is_array(scale: Any) -> bool:
    """Whether ``scale`` was given as an array (which has a gradient), not as a number."""
    return hasattr(scale, "shape") and not isinstance(scale, np.generic)


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
    bias_mod_max: float = 0.0,
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
    return err + 3 * u * bias_mod_max


def mod_bias_extent(bias_mod: Any, score_shape: tuple[int, ...]) -> float:
    """Largest finite ``|bias_mod|`` over the scores of ``score_shape`` (0 without one).

    The function is evaluated by the oracle's own code, on NumPy index arrays.
    """
    if bias_mod is None or 0 in score_shape:
        return 0.0
    shape = tuple(score_shape)
    grids = index_grids(np.empty(0), shape[:-2], *shape[-2:])
    values = evaluate_mod("bias_mod", bias_mod, grids, shape)
    finite = np.abs(values[np.isfinite(values)])
    return float(np.max(finite)) if finite.size else 0.0


def output_bound(dtype: str, *, S: int, ds: float, v_max: float, out_max: float) -> float:
    """Error bound for ``out`` (``v_max = 1`` gives the bound for the weights)."""
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    u_o = UNIT_ROUNDOFF[dtype]
    return v_max * (2 * ds + (2 * S + 6) * u_c) + u_o * out_max


def lse_bound(dtype: str, *, S: int, ds: float, lse_max: float) -> float:
    """Error bound for the log-sum-exp."""
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    return ds + (S + 4) * u_c * (1 + lse_max)


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

    Dropout multiplies ``dP`` and ``P`` (for ``dV``) by ``M = keep / (1 - p)``, exactly up to
    one rounding: ``A`` becomes ``A M`` (so ``W``, ``R`` and ``D`` include it) and ``dV``'s
    terms use ``P M`` and ``e_P M``; the extra rounding is within the ``2 u`` of ``dZ``.

    Sinks (``P`` then includes the sink's share ``p_sink = exp(sink - lse)`` in its row
    sums): the sink's gradient is ``-Σ_i p_sink_i D_i`` over every row it reaches. With
    ``p_sink`` off by ``eps p_sink + u`` (as ``P``), ``|D_i| <= W_i`` and ``D``'s error
    ``e_D``, its bound is ``Σ_i ((eps p_sink_i + u) W_i + p_sink_i e_D_i)`` plus the rounding
    of the sum of ``n`` terms (``L`` times the batch entries and heads summed into one sink),
    ``(n + 3) u Σ_i p_sink_i W_i``, and ``u_o |dSinks|``.

    When ``scale`` is an array, the oracle also returns ``dScale = Σ dS ⊙ (Q Kᵀ)``, which an
    implementation forms as ``Σ Q ⊙ dQ / scale`` (or, through autodiff, as ``Σ dS ⊙ raw``
    with ``raw = Q Kᵀ`` rounded: the same products, grouped differently). Its bound is the
    propagated ``dQ`` bound ``Σ |Q| e_dQ / scale``, plus the rounding of the sum of
    ``n = Q.size`` products and of ``raw`` (``(n + E + 3) u Σ |Q| m_dQ / scale``, with
    ``m_dQ = scale |dS| |K|`` the magnitude ``dQ`` is a sum of), plus ``u_s |dScale|`` for
    the rounding to the scale's dtype.

    Returns
    -------
    (list of numpy.ndarray, list of numpy.ndarray)
        The oracle's ``(dQ, dK, dV[, dBias][, dScale])`` and the bounds, in the same shapes.
    """
    softcap = options.get("softcap")
    expected = list(
        reference.scaled_dot_product_attention_vjp(q, k, v, d_out, mask=mask, bias=bias, **options)
    )
    scale_array = options.get("scale")
    d_scale = expected.pop() if scale_is_array(scale_array) else None
    d_sinks = expected.pop() if options.get("sinks") is not None else None
    fwd = prep = reference.intermediates(q, k, v, mask=mask, bias=bias, **options)
    u = UNIT_ROUNDOFF[compute_dtype(dtype)]
    u_o = UNIT_ROUNDOFF[dtype]
    underflow = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 2.0**-150}.get(dtype, 0.0)
    scale = prep["scale"]
    L, S, Ev = q.shape[-2], k.shape[-2], v.shape[-1]
    P = fwd["weights"]
    admissible = fwd["allowed"].astype(np.float64)
    finite_lse = fwd["lse"][np.isfinite(fwd["lse"])]
    lse_max = float(np.max(np.abs(finite_lse))) if finite_lse.size else 0.0
    extent = mod_bias_extent(options.get("bias_mod"), P.shape)
    ds = score_error(dtype, q, k, scale, bias, softcap, extent)
    eps = 3 * ds + (2 * S + 10) * u + 2 * u * lse_max
    dO = np.abs(d_out)
    A = np.matmul(dO, np.swapaxes(np.abs(prep["v_rep"]), -1, -2))
    keep = fwd["keep"] if fwd["keep"] is not None else 1.0
    A = A * keep
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
        (np.matmul(T(e_P * keep, -1, -2), dO), np.matmul(T(P * keep, -1, -2), dO), L, True),
    ]
    if bias is not None:
        terms.append((e_Z, Z_abs, 1, False))
    bounds, mags = [], []
    inputs: list[np.ndarray] = [q, k, v] + ([bias] if bias is not None else [])
    for (err, mag, length, per_kv_head), ref, x in zip(terms, expected, inputs, strict=True):
        n = length * (mag.size // max(x.size, 1))  # terms summed into one entry
        err = np.broadcast_to(err, mag.shape)
        if per_kv_head:
            err, mag = (reference.unrepeat_heads(a, prep["group"]) for a in (err, mag))
        err, mag = reference.sum_to_shape(err, x.shape), reference.sum_to_shape(mag, x.shape)
        bounds.append(err + (n + 3) * u * mag + u_o * np.abs(ref) + underflow * (err > 0))
        mags.append(mag)
    if d_sinks is not None:
        shape = np.shape(options["sinks"])
        p_sink = fwd["sink_weight"][..., None]
        err = np.sum((eps * p_sink + u) * W + p_sink * e_D, axis=(-2, -1))
        mag = np.sum(p_sink * W, axis=(-2, -1))
        n = L * (mag.size // max(int(np.prod(shape)), 1))
        err, mag = reference.sum_to_shape(err, shape), reference.sum_to_shape(mag, shape)
        expected.append(d_sinks)
        bounds.append(err + (n + 3) * u * mag + u_o * np.abs(d_sinks))
    if d_scale is not None:
        u_s = UNIT_ROUNDOFF[dtype_name(scale_array)]
        q_abs = np.abs(q)
        rounding = (q.size + q.shape[-1] + 3) * u * np.sum(q_abs * mags[0])
        err = (np.sum(q_abs * bounds[0]) + rounding) / scale
        expected.append(d_scale)
        bounds.append(np.asarray(err + u_s * np.abs(d_scale)))
    return expected, bounds
