"""Error bounds for comparing an attention result with the float64 oracle.

The oracle receives exactly the same (already rounded) inputs, converted to float64, so only
the arithmetic of the implementation under test is measured. With unit roundoff ``u_c`` of the
compute dtype (float32 for float16/bfloat16 inputs) and ``u_o`` of the output dtype:

* each score ``s_ij = scale * sum_e q_ie k_je`` (plus a bias and a soft-cap, whose derivative is
  at most 1) is off by at most ``|ds| <= (E + 2) u_c * scale * max_ij sum_e |q_ie||k_je|
  + 2 u_c * max|bias| + 3 u_c * max|bias_mod| (+ 4 u_c * softcap)``, the standard
  ``gamma_E`` bound for a dot product of length ``E``; a bias is rounded to the compute
  dtype and added (``2 u_c``), a ``bias_mod``'s value may also be computed in it (a
  rounded factor times an exact index difference, ``+ u_c``); a ``score_mod`` ``f``, applied
  to the scaled product before the rest, multiplies the product's error by at most
  ``max |f'|`` (first order, over the oracle's scores) and adds its own arithmetic,
  :data:`SCORE_MOD_ROUNDINGS` ``u_c * max |f|``;
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

The gradients' bounds (:func:`sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds`) follow
the same steps through the backward pass; its docstring writes them out.

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

from ..reference._mods import evaluate_mod, evaluate_score, index_grids

__all__ = [
    "EXP2_ERROR",
    "SCORE_MOD_ROUNDINGS",
    "UNIT_ROUNDOFF",
    "base2_terms",
    "compute_dtype",
    "dtype_name",
    "lse_bound",
    "mod_bias_extent",
    "mod_score_derivative",
    "operand_rounding",
    "output_bound",
    "scale_is_array",
    "score_error",
    "weights_from_lse_bound",
]

UNIT_ROUNDOFF = {
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float32": 2.0**-24,
    "float64": 2.0**-53,
}


def dtype_name(x: Any) -> str:
    """The name of an array's floating dtype (``"float32"``, ``"bfloat16"``...).

    Parameters
    ----------
    x : array
        An array of any library.

    Returns
    -------
    str
        ``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"float64"``.

    Raises
    ------
    TypeError
        If the dtype is none of these.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.testing import dtype_name
    >>> dtype_name(np.zeros(3, dtype=np.float16))
    'float16'
    """
    name = str(x.dtype).rsplit(".", 1)[-1].strip("'>")
    if name not in UNIT_ROUNDOFF:
        raise TypeError(f"not a floating dtype the bounds know: {x.dtype}")
    return name


def scale_is_array(scale: Any) -> bool:
    """Whether ``scale`` was given as an array (which has a gradient), not as a number."""
    return hasattr(scale, "shape") and not isinstance(scale, np.generic)


def compute_dtype(dtype: str) -> str:
    """Dtype in which scores and softmax run for inputs of ``dtype`` (at least float32).

    Parameters
    ----------
    dtype : str
        Name of the inputs' dtype.

    Returns
    -------
    str
        ``"float64"`` for float64 inputs, ``"float32"`` for the others.

    Examples
    --------
    >>> from sdpa_array.testing import compute_dtype
    >>> compute_dtype("bfloat16"), compute_dtype("float64")
    ('float32', 'float64')
    """
    return "float64" if dtype == "float64" else "float32"


#: Relative error of one ``exp2`` (and absolute error of one ``log2`` of a number in
#: ``[1, 2**24]``) in units of the compute dtype's unit roundoff: a GPU's ``ex2.approx.f32``
#: is within 2 ulp (``4 u``) of ``2**x``, ``lg2.approx.f32`` within ``2**-22``; correctly
#: rounded functions (NumPy, the interpreter) are within ``1 u``.
EXP2_ERROR = 4

#: The rounding of a ``score_mod``'s own arithmetic in the compute dtype, in units of ``u_c``
#: times its largest value: a few operations, each correctly rounded or, for ``tanh``
#: and ``exp``, within one more ulp (the ready-made score functions of
#: :mod:`sdpa_array.mods` take at most three: a division, a ``tanh`` and a product). A
#: function with longer arithmetic needs a larger bound than these helpers derive.
SCORE_MOD_ROUNDINGS = 4


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
    score_mod: tuple[float, float] | None = None,
) -> float:
    """Worst-case absolute error of one final score (see the module docstring).

    A soft-cap has derivative at most 1, so it passes the product's error through, and its
    own ``tanh``, division and multiplication add at most ``4 u_c * softcap``.

    ``base2``: the score is also multiplied by ``fl(log2(e))`` (``2 u_c |s|``, with
    ``|s| <= scale * max sum |q||k|`` or ``softcap``, plus the biases), and a soft-cap's
    ``tanh`` is formed from ``exp2`` (:func:`base2_terms`' ``"softcap"``).

    Parameters
    ----------
    dtype : str
        Name of the inputs' dtype; the unit roundoff is that of its :func:`compute_dtype`.
    q : numpy.ndarray, shape (..., L, E)
        The queries the implementation received, as float64.
    k : numpy.ndarray, shape (..., S, E)
        The keys, likewise.
    scale : float
        The scores' scale.
    bias : array_like, optional
        The additive bias; its largest finite magnitude enters the bound.
    softcap : float, optional
        The soft-cap, if the call has one.
    bias_mod_max : float, default 0.0
        Largest finite ``|bias_mod|`` over the scores (0 without a ``bias_mod``).
    base2 : bool, default False
        Add the terms of a kernel that exponentiates in base 2 (see above).
    score_mod : tuple of float, optional
        ``(max |f'|, max |f|)`` of the call's ``score_mod`` ``f`` over the oracle's scaled
        scores (:func:`mod_score_derivative` gives ``f'``).

    Returns
    -------
    float
        Bound of the absolute error ``|ds|`` of any one score.

    Examples
    --------
    Eight float32 queries and 32 keys of width 16, scale 1/4:

    >>> import numpy as np
    >>> from sdpa_array.testing import score_error
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((8, 16)), rng.standard_normal((32, 16))
    >>> f"{score_error('float32', q, k, 0.25):.1e}"
    '5.2e-06'
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
    if score_mod is not None:
        err = score_mod[0] * err + SCORE_MOD_ROUNDINGS * u * score_mod[1]
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
        product = scale * qk if score_mod is None else score_mod[1]
        s_max = (softcap if softcap is not None else product) + b_max + bias_mod_max
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


def mod_score_derivative(score_mod: Any, raw: np.ndarray) -> np.ndarray:
    """``score_mod'(raw)`` for the oracle's scaled scores ``raw`` (``(..., Hq, L, S)``),
    from the function's ``derivative`` method, evaluated by the oracle's own code.

    Raises
    ------
    TypeError
        If ``score_mod`` has no ``derivative`` method: the bounds need it (give the
        function to the implementation alone, and :func:`sdpa_array.mods.score_function`
        of it to the oracle, to check an implementation's autodiff).
    """
    derivative = getattr(score_mod, "derivative", None)
    if not callable(derivative):
        raise TypeError("the bounds of a score_mod need its derivative method")
    grids = index_grids(np.empty(0), raw.shape[:-2], *raw.shape[-2:])
    return np.asarray(evaluate_score("score_mod.derivative", derivative, raw, grids))


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

    Parameters
    ----------
    dtype : str
        Name of the inputs' dtype, which is the output's.
    S : int
        Length of each softmax row: the keys, plus one with sinks.
    ds : float
        The score error of :func:`score_error`.
    v_max : float
        ``max|v|``, times dropout's ``1 / (1 - p)``; 1 (times it) for the weights.
    out_max : float
        ``max|out|`` of the oracle's result.
    base2 : bool, default False
        Add the terms of a softmax computed in base 2 (see above).
    rounded_operands : bool, default False
        Add the terms of probabilities rounded to ``dtype`` before ``P V`` (see above).

    Returns
    -------
    float
        Bound of the absolute error of every entry of ``out``.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.testing import output_bound, score_error
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((8, 16)), rng.standard_normal((32, 16))
    >>> ds = score_error("float32", q, k, 0.25)
    >>> f"{output_bound('float32', S=32, ds=ds, v_max=1.0, out_max=1.0):.1e}"
    '1.5e-05'
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
    """Error bound for the log-sum-exp (``base2``: plus :func:`base2_terms`' ``"lse"``).

    Parameters
    ----------
    dtype : str
        Name of the inputs' dtype.
    S : int
        Length of each softmax row: the keys, plus one with sinks.
    ds : float
        The score error of :func:`score_error`.
    lse_max : float
        Largest finite ``|lse|`` of the oracle's result.
    base2 : bool, default False
        Add the terms of a softmax computed in base 2.

    Returns
    -------
    float
        Bound of the absolute error of every finite log-sum-exp, ``ds + (S + 4) u_c (1 +
        lse_max)`` without ``base2``.

    Examples
    --------
    >>> from sdpa_array.testing import lse_bound
    >>> f"{lse_bound('float32', S=32, ds=5.2e-06, lse_max=4.0):.1e}"
    '1.6e-05'
    """
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    bound = ds + (S + 4) * u_c * (1 + lse_max)
    if base2:
        bound += base2_terms(dtype, S=S, lse_max=lse_max)["lse"]
    return bound
