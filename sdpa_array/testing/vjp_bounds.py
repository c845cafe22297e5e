"""Error bounds for the gradients: the float64 oracle's VJP and an element-wise bound for
each gradient, derived step by step through the backward pass (the forward's bounds are in
:mod:`sdpa_array.testing.bounds`, whose terms this module reuses)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference
from .bounds import (
    SCORE_MOD_ROUNDINGS,
    UNIT_ROUNDOFF,
    base2_terms,
    compute_dtype,
    dtype_name,
    mod_bias_extent,
    mod_score_derivative,
    operand_rounding,
    scale_is_array,
    score_error,
)

__all__ = ["vjp_oracle_and_bounds"]


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
    rounded_output: bool = False,
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
    * ``score_mod`` ``f`` (``x`` above is then ``f(raw) / softcap``): ``dRaw = dS f'(raw)``,
      with ``f'`` evaluated at a score off by at most ``e_0``, the product's own error
      (:func:`score_error` without the other terms), and rounded (``SCORE_MOD_ROUNDINGS u``):
      ``e_S`` becomes ``e_S |f'| + |dS| (Δ + SCORE_MOD_ROUNDINGS u |f'|)`` with
      ``Δ = max_± |f'(raw ± e_0) - f'(raw)|`` element-wise (first order, as the rest), and
      ``|dS|`` becomes ``|dS| |f'|``.
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

    A backward given the forward's output in the inputs' dtype (``rounded_output``: the
    caller's ``out=``) reads ``D = rowsum(dO * O)`` from ``O`` rounded to ``dtype``: ``e_D``
    grows by the same ``2 u_r W + eta rowsum(A [admissible])`` (the other terms of
    ``rounded_operands`` do not apply; a fused kernel has them all).

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

    Parameters
    ----------
    dtype : str
        Name of the inputs' dtype, which is the gradients'.
    q, k, v : numpy.ndarray
        The queries, keys and values the implementation received, as float64.
    d_out : numpy.ndarray
        The cotangent of the output, as float64.
    mask : numpy.ndarray of bool, optional
        The call's ``mask``.
    bias : numpy.ndarray, optional
        The call's ``bias``, as float64; its gradient is then expected.
    base2 : bool, default False
        Add the terms of a kernel that computes the softmax in base 2 (see above).
    rounded_operands : bool, default False
        Add the terms of a kernel that rounds ``P`` and ``dS`` to ``dtype`` before its
        matrix products (see above).
    rounded_output : bool, default False
        Add the term of a backward that reads the forward's output rounded to ``dtype``
        (see above).
    grad_lse : numpy.ndarray, optional
        A cotangent ``h`` of the log-sum-exp, broadcastable to ``(..., Hq, L)`` (see above).
    **options
        The call's other keyword arguments (``scale``, ``softcap``, ``is_causal``,
        ``sinks``...), passed on to the oracle.

    Returns
    -------
    expected : list of numpy.ndarray
        The oracle's ``dQ, dK, dV[, dBias][, dSinks][, dScale]`` (float64), ``dSinks`` when
        ``sinks`` is given and ``dScale`` when ``scale`` is an array.
    bounds : list of numpy.ndarray
        The element-wise bound of each, in the same order and shapes.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.testing import vjp_oracle_and_bounds
    >>> q = np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32)
    >>> x = q.astype(np.float64)  # what a float32 implementation received
    >>> expected, bounds = vjp_oracle_and_bounds("float32", x, x, x, np.ones_like(x))
    >>> [e.shape for e in expected]
    [(2, 5, 4), (2, 5, 4), (2, 5, 4)]
    >>> bool(np.all(bounds[0] < 1e-3))
    True
    """
    softcap = options.get("softcap")
    with_parameters = bool(options.get("return_mod_gradients", False))
    trained = [n for n in ("score_mod", "bias_mod") if hasattr(options.get(n), "parameters")]
    for name in trained if with_parameters else []:
        mod: Any = options[name]
        if hasattr(mod, "with_parameters"):
            # the oracle reads the parameters on the host (lazy or 16-bit ones included)
            host = [reference.to_numpy(a).astype(np.float64) for a in mod.parameters]
            options[name] = mod.with_parameters(*host)
    expected = list(
        reference.scaled_dot_product_attention_vjp(q, k, v, d_out, mask=mask, bias=bias, **options)
    )
    options.pop("return_mod_gradients", None)
    n_params = sum(len(options[n].parameters) for n in trained) if with_parameters else 0
    d_params = expected[len(expected) - n_params :]
    del expected[len(expected) - n_params :]
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
    score_mod = options.get("score_mod")
    slope = None if score_mod is None else np.abs(mod_score_derivative(score_mod, fwd["raw"]))
    mod = None
    if slope is not None:
        modded = np.abs(fwd["modded"][np.isfinite(fwd["modded"])])
        mod = (float(np.max(slope, initial=0.0)), float(np.max(modded, initial=0.0)))
    ds = score_error(dtype, q, k, scale, bias, softcap, extent, base2=base2, score_mod=mod)
    eps = 3 * ds + (2 * S + 10) * u + 2 * u * lse_max
    if base2:
        eps += base2_terms(dtype, S=S, lse_max=lse_max)["weights"]
    u_r, eta = operand_rounding(dtype) if rounded_operands or rounded_output else (0.0, 0.0)
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
    if rounded_operands or rounded_output:
        e_D = e_D + 2 * u_r * W + eta * np.sum(A * admissible, axis=-1, keepdims=True)
    e_Z = e_P * R + P * ((Ev + 2) * u * A + e_D) + 2 * u * P * R
    Z_abs = P * R
    if softcap is not None:
        x = np.abs(fwd["modded"]) / softcap
        c = 1.0 - np.tanh(x) ** 2
        e_S = e_Z * c + Z_abs * (2 * (ds / softcap + u * x) + 4 * u)
        S_abs = Z_abs * c
    else:
        e_S, S_abs = e_Z, Z_abs
    e_M, M_abs = e_S, S_abs  # the gradient of score_mod's values
    if slope is not None:
        shift = _slope_shift(score_mod, fwd["raw"], score_error(dtype, q, k, scale))
        e_S = e_S * slope + S_abs * (shift + SCORE_MOD_ROUNDINGS * u * slope)
        S_abs = S_abs * slope
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
    if with_parameters:
        h_z = None if grad_lse is None else P * h
        params = iter(d_params)
        if "score_mod" in trained:
            e0 = score_error(dtype, q, k, scale)
            h_m = h_z
            if h_z is not None and softcap is not None:
                h_m = h_z * (1.0 - np.tanh(fwd["modded"] / softcap) ** 2)
            for jacobian, shift_j in _score_jacobians(score_mod, fwd["raw"], e0):
                e_j = shift_j + SCORE_MOD_ROUNDINGS * u * np.abs(jacobian)
                d_param = next(params)
                _parameter_terms(
                    d_param, jacobian, e_M, M_abs, e_j, h_m, dtype, u, expected, bounds
                )
        if "bias_mod" in trained:
            for jacobian in _jacobian(options["bias_mod"], q, P.shape):
                d_param = next(params)
                _parameter_terms(
                    d_param, jacobian, e_Z, Z_abs, None, h_z, dtype, u, expected, bounds
                )
    return expected, bounds


def _score_jacobians(
    score_mod: Any, raw: np.ndarray, e0: float
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``d f / d theta`` of each parameter ``theta`` of the ``score_mod`` ``f`` at the
    oracle's scaled scores ``raw``, as the oracle forms it
    (:func:`sdpa_array.reference._mods.score_parameter_jacobian`), with its shift
    ``max_± |J(raw ± e0) - J(raw)|`` under the product's error ``e0``."""
    from ..reference._mods import index_grids, score_parameter_jacobian

    lead, (L, S) = raw.shape[:-2], raw.shape[-2:]
    grids = index_grids(np.zeros((*lead, L, 1)), lead, L, S)
    here = score_parameter_jacobian(score_mod, raw, grids)
    moved = [score_parameter_jacobian(score_mod, raw + sign * e0, grids) for sign in (1, -1)]
    return [
        (j, np.maximum(np.abs(up - j), np.abs(down - j)))
        for j, up, down in zip(here, *moved, strict=True)
    ]


def _jacobian(bias_mod: Any, q: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    """``d bias / d theta`` of each parameter ``theta`` of ``bias_mod`` on the scores'
    ``shape``, as the oracle forms it (:func:`sdpa_array.reference._mods.parameter_jacobian`)."""
    from ..reference._mods import index_grids, parameter_jacobian

    grids = index_grids(q, shape[:-2], shape[-2], shape[-1])
    return parameter_jacobian(bias_mod, grids, shape)


def _parameter_terms(
    d_param: np.ndarray,
    jacobian: np.ndarray,
    e_z: np.ndarray,
    z_abs: np.ndarray,
    e_j: np.ndarray | None,
    h_z: np.ndarray | None,
    dtype: str,
    u: float,
    expected: list[np.ndarray],
    bounds: list[np.ndarray],
) -> None:
    """Append a parameter's expected gradient ``Σ dZ ⊙ J`` (plus ``Σ (P h) ⊙ J`` for a
    log-sum-exp cotangent) and its bound: the propagated ``dZ`` bound ``Σ |J| e_Z``, the
    error of ``J`` itself where it is computed from the scores (``e_j``: a score
    function's, ``Σ |dZ| e_j``), the rounding of the products and of a sum of every score
    (``(N + 3) u Σ |J| |dZ|`` with ``N`` the scores' count), and the rounding to ``dtype``.

    For a bias function ``dZ`` is the score gradient and ``J`` exact (its values are data);
    for a score function ``dZ`` is the gradient of its values (through the soft-cap: the
    ``e_S``, ``|dS|`` above, before the function's slope) and ``h_z`` is ``P h`` through the
    soft-cap too."""
    axes = tuple(range(d_param.ndim, jacobian.ndim))
    j_abs = np.abs(jacobian)
    if h_z is not None:
        d_param = d_param + np.sum(jacobian * h_z, axis=axes)
    n = int(np.prod(jacobian.shape[d_param.ndim :]))
    err = np.sum(j_abs * e_z, axis=axes) + (n + 3) * u * np.sum(j_abs * z_abs, axis=axes)
    if e_j is not None:
        err = err + np.sum(z_abs * e_j, axis=axes)
    expected.append(d_param)
    bounds.append(err + UNIT_ROUNDOFF[dtype] * np.abs(d_param))


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
    d_s = d_z if softcap is None else d_z * (1.0 - np.tanh(fwd["modded"] / softcap) ** 2)
    if options.get("score_mod") is not None:
        d_s = d_s * mod_score_derivative(options["score_mod"], fwd["raw"])
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


def _slope_shift(score_mod: Any, raw: np.ndarray, e0: float) -> np.ndarray:
    """``max_± |f'(raw ± e0) - f'(raw)|`` element-wise, ``f`` the ``score_mod``."""
    here = mod_score_derivative(score_mod, raw)
    shifts = [np.abs(mod_score_derivative(score_mod, raw + sign * e0) - here) for sign in (1, -1)]
    return np.asarray(np.maximum(*shifts))
