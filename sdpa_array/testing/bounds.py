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
backward pass; its docstring writes them out.

Fused GPU kernels (the Triton implementation) differ from this model in two ways, each a
keyword of the functions below that adds its own derived terms and changes nothing when
left off: ``base2`` (scores scaled by ``log2(e)`` for ``exp2``, with a GPU's approximate
``exp2`` and ``log2``; :func:`base2_terms` derives them) and ``rounded_operands`` (the
probabilities and score gradients rounded to the inputs' dtype before their matrix
products, as FlashAttention does; :func:`operand_rounding` derives them).

These bounds are used by the test suite, by
:func:`sdpa_array.testing.assert_close_to_oracle` and by ``python -m sdpa_array demo``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference
from ..reference._mods import evaluate_mod, index_grids

__all__ = [
    "EXP2_ERROR",
    "UNIT_ROUNDOFF",
    "base2_terms",
    "compute_dtype",
    "dtype_name",
    "lse_bound",
    "mod_bias_extent",
    "operand_rounding",
    "output_bound",
    "scale_is_array",
    "score_error",
    "vjp_oracle_and_bounds",
    "weights_from_lse_bound",
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


#: Relative error of one ``exp2`` (and absolute error of one ``log2`` of a number in
#: ``[1, 2**24]``) in units of the compute dtype's unit roundoff: a GPU's ``ex2.approx.f32``
#: is within 2 ulp (``4 u``) of ``2**x``, ``lg2.approx.f32`` within ``2**-22``; correctly
#: rounded functions (NumPy, the interpreter) are within ``1 u``.
EXP2_ERROR = 4


def operand_rounding(dtype: str) -> tuple[float, float]:
    """``(u_r, eta)``: relative and absolute error of rounding a number in ``[-1, 1]``-ish
    magnitudes to the inputs' dtype before a matrix product (``rounded_operands``).

    A kernel that multiplies in the inputs' dtype (tensor cores) rounds the probabilities
    ``P`` (at most 1) before ``P V`` and ``Pᵀ dO``, and the score gradients ``dS`` before
    ``dS K`` and ``dSᵀ Q``: each rounding is off by at most ``u_r |x| + eta``, ``u_r`` the
    unit roundoff of ``dtype`` and ``eta`` half its smallest subnormal (``2**-25`` for
    float16, ``2**-134`` for bfloat16), for results that underflow. Inputs whose dtype is
    the compute dtype are not rounded: ``(0, 0)``.
    """
    if dtype == compute_dtype(dtype):
        return 0.0, 0.0
    eta = {"float16": 2.0**-25, "bfloat16": 2.0**-134}[dtype]
    return UNIT_ROUNDOFF[dtype], eta


def base2_terms(dtype: str, *, S: int, lse_max: float) -> dict[str, float]:
    """The extra error terms of a softmax computed in base 2 (``base2=True``).

    A kernel that exponentiates with ``exp2`` multiplies each score by ``fl(log2(e))``
    (rounding the constant and the product: ``2 u |s|``, with ``s`` the score, added by
    :func:`score_error`), converts its base-2 log-sum-exp back with ``fl(ln 2)`` and, in the
    backward pass, the saved log-sum-exp forth with ``fl(log2(e))`` (``2 u |lse|`` each).
    On a GPU ``exp2`` and ``log2`` are hardware approximations: an ``exp2`` is off by up to
    ``EXP2_ERROR u`` relative instead of ``u``, and ``log2(l)`` of a row sum
    ``l in [1, S + 1]`` by up to ``EXP2_ERROR u`` absolute. With ``u`` the compute dtype's
    unit roundoff and ``x = EXP2_ERROR - 1`` the extra error of each ``exp2``:

    * ``weights``: each weight ``p_j / sum p`` gets ``2 x u`` more relative error, so the
      output (a convex combination of values) ``2 x u max|v|``: ``"output"`` is ``2 x u``,
      per unit of ``max|v|``;
    * ``lse = ln2 (m + log2 l)``: ``l``'s extra ``x u`` relative error, ``log2``'s
      ``EXP2_ERROR u`` (times ``ln 2 < 1``), and ``2 u |lse|`` from the conversions:
      ``"lse" = (x + EXP2_ERROR) u + 2 u max|lse|``;
    * the backward's ``P = exp2(t - lse log2(e))``: ``x u`` from ``exp2`` and ``2 u |lse|``
      from the conversion, relative: ``"weights" = x u + 2 u max|lse|`` (added to the
      relative error ``eps`` of :func:`vjp_oracle_and_bounds`);
    * a soft-cap's ``tanh(y) = (1 - e) / (1 + e)`` with ``e = exp2(-2 log2(e) |y|)``: the
      argument's scaling (``2 u``, at most ``2 u`` of ``tanh`` after the factor
      ``2 e |y| <= 1``), ``exp2`` (``EXP2_ERROR u e`` relative, times ``2 / (1 + e)² <= 2``),
      ``1 - e``, ``1 + e`` and the division (``3 u``): ``|d tanh| <= (2 EXP2_ERROR + 5) u``
      instead of ``u``, so a capped score is off by ``"softcap" = (2 EXP2_ERROR + 4) u``
      more, per unit of ``softcap``.
    """
    u = UNIT_ROUNDOFF[compute_dtype(dtype)]
    x = EXP2_ERROR - 1
    return {
        "output": 2 * x * u,
        "lse": (x + EXP2_ERROR) * u + 2 * u * lse_max,
        "weights": x * u + 2 * u * lse_max,
        "softcap": (2 * EXP2_ERROR + 4) * u,
    }


def score_error(
    dtype: str,
    q: np.ndarray,
    k: np.ndarray,
    scale: float,
    bias: Any = None,
    softcap: float | None = None,
    bias_mod_max: float = 0.0,
    *,
    base2: bool = False,
) -> float:
    """Worst-case absolute error of one final score (see the module docstring).

    A soft-cap has derivative at most 1, so it passes the product's error through, and its
    own ``tanh``, division and multiplication add at most ``4 u_c * softcap``.

    ``base2``: the score is also multiplied by ``fl(log2(e))`` (``2 u_c |s|``, with
    ``|s| <= scale * max sum |q||k|`` or ``softcap``, plus the biases), and a soft-cap's
    ``tanh`` is formed from ``exp2`` (:func:`base2_terms`' ``"softcap"``).
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
    if base2:
        b_max = 0.0
        if bias is not None:
            finite_b = np.abs(np.asarray(bias, dtype=np.float64))
            finite_b = finite_b[np.isfinite(finite_b)]
            b_max = float(np.max(finite_b)) if finite_b.size else 0.0
        s_max = (softcap if softcap is not None else scale * qk) + b_max + bias_mod_max
        err += 2 * u * s_max
        if softcap is not None:
            err += base2_terms(dtype, S=0, lse_max=0.0)["softcap"] * softcap
    return float(err + 3 * u * bias_mod_max)


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


def output_bound(
    dtype: str,
    *,
    S: int,
    ds: float,
    v_max: float,
    out_max: float,
    base2: bool = False,
    rounded_operands: bool = False,
) -> float:
    """Error bound for ``out`` (``v_max = 1`` gives the bound for the weights).

    ``base2``: plus :func:`base2_terms`' ``"output"`` times ``v_max``. ``rounded_operands``:
    the unnormalised probabilities ``exp(s - m) <= 1`` are rounded to ``dtype`` before
    ``P V`` (their row sum is not): each is off by ``u_r p + eta``
    (:func:`operand_rounding`), and the row sum is at least 1 (the row's largest term is
    ``exp(0)``), so the output moves by at most ``(u_r + S eta) v_max`` more (``v_max``
    including dropout's ``1 / (1 - p)``).
    """
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    u_o = UNIT_ROUNDOFF[dtype]
    bound = v_max * (2 * ds + (2 * S + 6) * u_c) + u_o * out_max
    if base2:
        bound += base2_terms(dtype, S=S, lse_max=0.0)["output"] * v_max
    if rounded_operands:
        u_r, eta = operand_rounding(dtype)
        bound += (u_r + S * eta) * v_max
    return bound


def weights_from_lse_bound(dtype: str, *, ds: float, lse_error: float, grow: float = 1.0) -> float:
    """Error bound for weights formed as ``w = exp(z - lse)`` from a kernel's log-sum-exp.

    With the scores ``z`` off by ``ds`` and ``lse`` by ``lse_error``, ``exp`` maps them to a
    relative error ``ds + lse_error`` of ``w <= 1``; rounding ``z - lse`` (relative ``u_c``)
    moves ``w`` by ``u_c w |log w| <= u_c / e``, ``exp`` and dropout's multiplication by
    ``1 / (1 - p)`` (``grow``) round once each (``u_c w``), and the result is rounded to
    ``dtype``: ``bound = grow (ds + lse_error + 3 u_c) + u_o grow``.
    """
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    u_o = UNIT_ROUNDOFF[dtype]
    return grow * (ds + lse_error + 3 * u_c) + u_o * grow


def lse_bound(dtype: str, *, S: int, ds: float, lse_max: float, base2: bool = False) -> float:
    """Error bound for the log-sum-exp (``base2``: plus :func:`base2_terms`' ``"lse"``)."""
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    bound = ds + (S + 4) * u_c * (1 + lse_max)
    if base2:
        bound += base2_terms(dtype, S=S, lse_max=lse_max)["lse"]
    return bound


def vjp_oracle_and_bounds(
    dtype: str,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    base2: bool = False,
    rounded_operands: bool = False,
    grad_lse: np.ndarray | None = None,
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

    Fused kernels (keywords, both off by default):

    * ``base2``: the score error ``ds`` gets :func:`score_error`'s ``base2`` terms and the
      relative error of ``P`` :func:`base2_terms`' ``"weights"`` (``eps`` grows by it).
    * ``rounded_operands`` (:func:`operand_rounding`'s ``u_r``, ``eta``): the forward's
      output ``O``, which ``D = rowsum(dO * O)`` reads, was rounded to the inputs' dtype
      (``u_r |O|``) after a product with rounded probabilities (``u_r P + eta`` per weight,
      see :func:`output_bound`); with ``|O| <= P |V|`` both move ``D`` by at most
      ``u_r W``, and the subnormals by ``eta rowsum(A [admissible])``: ``e_D`` grows by
      ``2 u_r W + eta rowsum(A [admissible])`` (and so ``e_Z``, ``dBias`` and ``dSinks``).
      ``dV = (P M)ᵀ dO`` reads ``P M`` rounded: ``e_P M`` grows by ``u_r P M + eta
      [admissible]``; ``dQ`` and ``dK`` read ``dS`` rounded: ``e_S`` grows by
      ``u_r |dS| + eta [admissible]`` in them.

    A cotangent ``h`` of the log-sum-exp (``grad_lse``, ``(..., Hq, L)``): since
    ``d lse_i / d z_ij = P_ij`` (the softmax before dropout; ``p_sink_i`` for a sink), the
    expected gradients gain those of ``dZ = P h`` (``dS = dZ`` times ``1 - tanh²`` under a
    soft-cap, then ``dQ``, ``dK``, ``dBias``, ``dSinks = Σ_i p_sink_i h_i`` and ``dScale``
    as above; ``dV`` gains nothing). An implementation folds it into ``D' = D - h``, so
    ``|D'| <= W + |h|``: ``R = A + W + |h|`` bounds ``|dP - D'|``, the subtraction adds
    ``u (W + |h|)`` to ``e_D``, and ``dSinks``' terms read ``W + |h|`` for ``W``.

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
    ds = score_error(dtype, q, k, scale, bias, softcap, extent, base2=base2)
    eps = 3 * ds + (2 * S + 10) * u + 2 * u * lse_max
    if base2:
        eps += base2_terms(dtype, S=S, lse_max=lse_max)["weights"]
    u_r, eta = operand_rounding(dtype) if rounded_operands else (0.0, 0.0)
    dO = np.abs(d_out)
    A = np.matmul(dO, np.swapaxes(np.abs(prep["v_rep"]), -1, -2))
    keep = fwd["keep"] if fwd["keep"] is not None else 1.0
    A = A * keep
    W = np.sum(P * A, axis=-1, keepdims=True)
    W_D = W  # bounds |D|, or |D - h| with a log-sum-exp cotangent h
    if grad_lse is not None:
        h = np.broadcast_to(np.asarray(grad_lse, dtype=np.float64), P.shape[:-1])[..., None]
        W_D = W + np.abs(h)
        expected, d_sinks, d_scale = _add_lse_cotangent(
            expected, d_sinks, d_scale, h, fwd, q, k, bias, options
        )
    R = A + W_D
    e_P = eps * P + u * admissible
    e_D = (eps + (S + Ev + 3) * u) * W + u * np.sum(A * admissible, axis=-1, keepdims=True)
    if grad_lse is not None:
        e_D = e_D + u * W_D
    if rounded_operands:
        e_D = e_D + 2 * u_r * W + eta * np.sum(A * admissible, axis=-1, keepdims=True)
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
    e_S_products, e_PM = e_S, e_P * keep
    if rounded_operands:
        e_S_products = e_S + u_r * S_abs + eta * admissible
        e_PM = e_PM + u_r * P * keep + eta * admissible
    terms = [
        (scale * np.matmul(e_S_products, K), scale * np.matmul(S_abs, K), S, False),
        (
            scale * np.matmul(T(e_S_products, -1, -2), Q),
            scale * np.matmul(T(S_abs, -1, -2), Q),
            L,
            True,
        ),
        (np.matmul(T(e_PM, -1, -2), dO), np.matmul(T(P * keep, -1, -2), dO), L, True),
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
        err = np.sum((eps * p_sink + u) * W_D + p_sink * e_D, axis=(-2, -1))
        mag = np.sum(p_sink * W_D, axis=(-2, -1))
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


def _add_lse_cotangent(
    expected: list[np.ndarray],
    d_sinks: np.ndarray | None,
    d_scale: np.ndarray | None,
    h: np.ndarray,
    fwd: dict[str, Any],
    q: np.ndarray,
    k: np.ndarray,
    bias: np.ndarray | None,
    options: dict[str, Any],
) -> tuple[list[np.ndarray], np.ndarray | None, np.ndarray | None]:
    """The oracle's gradients plus those of ``sum(lse * h)`` (``h`` as ``(..., L, 1)``):
    ``dZ = P h``, through the soft-cap, ``Q`` and ``K`` as every score gradient (float64)."""
    softcap = options.get("softcap")
    scale = fwd["scale"]
    d_z = fwd["weights"] * h
    d_s = d_z if softcap is None else d_z * (1.0 - np.tanh(fwd["raw"] / softcap) ** 2)
    d_q = scale * np.matmul(d_s, fwd["k_rep"])
    d_k = reference.unrepeat_heads(
        scale * np.matmul(np.swapaxes(d_s, -1, -2), fwd["q"]), fwd["group"]
    )
    out = [
        expected[0] + reference.sum_to_shape(d_q, q.shape),
        expected[1] + reference.sum_to_shape(d_k, k.shape),
        expected[2],
    ]
    if bias is not None:
        out.append(expected[3] + reference.sum_to_shape(d_z, bias.shape))
    if d_sinks is not None:
        per_head = np.sum(fwd["sink_weight"] * h[..., 0], axis=-1)
        d_sinks = d_sinks + reference.sum_to_shape(per_head, np.shape(options["sinks"]))
    if d_scale is not None:
        d_scale = d_scale + np.sum(d_s * fwd["raw"]) / scale
    return out, d_sinks, d_scale
