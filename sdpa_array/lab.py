"""The design notes' claims about attention, as experiments that run on any backend.

Each experiment is an Array-API function: it draws its random inputs with NumPy
(``np.random.default_rng(seed)``; the Array API has no random numbers), moves them to the
chosen backend from :mod:`sdpa_array.backends`, does the arithmetic there, and returns a
small frozen dataclass of host (NumPy) summaries. Nothing here plots;
``python -m sdpa_array explain`` and the documentation's gallery draw the figures.

========================================  ==============================================
experiment                                claim checked
========================================  ==============================================
:func:`dot_product_variance`              ``Var(q·k) = d_k``, and 1 after ``/ sqrt(d_k)``
:func:`softmax_saturation`                large logits make softmax one-hot and its
                                          Jacobian ``diag(p) - p pᵀ`` vanish
:func:`gradient_flow`                     the gradient reaching ``Q`` collapses with
                                          scale 1, shrinks with ``1/d_k``, and stays put
                                          with ``1/sqrt(d_k)``
:func:`additive_attention`,               the cost of additive (Bahdanau) attention, and
:func:`attention_cost`                    how much of the quoted ``O(n² d²)`` is avoidable
:func:`query_key_asymmetry`               ``softmax(S) != softmax(Sᵀ)ᵀ`` and
                                          ``dL/dQ = dS K`` differs from ``dL/dK = dSᵀ Q``
:func:`worked_example`                    the notes' numerical example, exactly, and which
                                          published rounded figures are wrong
:func:`attention_patterns`                what ``is_causal``, ``alignment``, ``window``,
                                          GQA and a padding mask do to the weights
========================================  ==============================================

Examples
--------
>>> from sdpa_array import lab
>>> r = lab.dot_product_variance(d_ks=(16, 256), n_samples=2048)
>>> bool(abs(r.scaled_variance[1] - 1.0) < 3.3 * r.scaled_variance_stderr[1])
True
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from statistics import NormalDist
from typing import Any

import numpy as np

from ._compat import array_namespace, device
from ._vjp import scaled_dot_product_attention_vjp
from .backends import Backend, get_backend
from .reference import to_numpy

__all__ = [
    "AttentionCost",
    "DotProductVariance",
    "FlopCount",
    "GradientFlow",
    "PublishedFigure",
    "QueryKeyAsymmetry",
    "SoftmaxSaturation",
    "WeightsPanel",
    "WorkedExample",
    "additive_attention",
    "additive_attention_flops",
    "attention_cost",
    "attention_patterns",
    "attention_vjp",
    "attention_vjp_from_derivation",
    "dot_product_attention_flops",
    "dot_product_variance",
    "gradient_flow",
    "query_key_asymmetry",
    "softmax",
    "softmax_jacobian",
    "softmax_saturation",
    "worked_example",
]

#: Default key widths of the variance and gradient experiments: 4, 8, ..., 1024.
D_KS: tuple[int, ...] = tuple(2**i for i in range(2, 11))

#: Logit variances of the saturation experiment (those of design note 003).
VARIANCES: tuple[float, ...] = (1.0, 10.0, 20.0, 30.0, 50.0, 100.0)


# --------------------------------------------------------------------------------------
# plumbing
# --------------------------------------------------------------------------------------


def _backend(backend: Backend | str) -> Backend:
    return get_backend(backend) if isinstance(backend, str) else backend


def _ns(**arrays: Any) -> Any:
    return array_namespace(arrays)


def _normal(backend: Backend, rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> Any:
    """Standard normal draws made by NumPy, copied onto the backend's device."""
    return backend.asarray(rng.standard_normal(shape), dtype)


def _host(x: Any) -> np.ndarray:
    """A float64 NumPy copy of a backend array (computes Dask, copies from GPUs)."""
    return to_numpy(x).astype(np.float64)


def softmax(x: Any, /, *, axis: int = -1) -> Any:
    """Numerically stable softmax along ``axis``: ``exp(x - max) / sum(exp(x - max))``.

    Parameters
    ----------
    x : array
        Finite logits of a real floating dtype.
    axis : int, default -1
        Axis along which the result sums to 1.

    Returns
    -------
    array
        Same shape, dtype, library and device as ``x``.
    """
    xp = _ns(x=x)
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


def softmax_jacobian(p: Any, /) -> Any:
    """Jacobian ``J = diag(p) - p pᵀ`` of softmax at probabilities ``p``.

    ``J[..., j, k] = ∂p_j / ∂z_k = p_j (δ_jk - p_k)`` (design note 000, §2.7).

    Parameters
    ----------
    p : array, shape (..., n)
        Probability vectors (rows summing to 1).

    Returns
    -------
    array, shape (..., n, n)
        Symmetric; its rows and columns sum to 0.

    Notes
    -----
    Its Frobenius norm has the closed form ``||J||_F² = Σ p_j² - 2 Σ p_j³ + (Σ p_j²)²``, so for
    ``p`` uniform over ``m`` positions ``||J||_F = sqrt(m - 1) / m`` (0 when one-hot). The
    sum of absolute entries is ``2 (1 - Σ p_j²)``, which bounds ``||J||_F`` and goes to 0 as
    ``p`` becomes one-hot.
    """
    xp = _ns(p=p)
    n = p.shape[-1]
    eye = xp.eye(n, dtype=p.dtype, device=device(p))
    return eye * p[..., :, None] - p[..., :, None] * p[..., None, :]


def _frobenius(x: Any, xp: Any) -> Any:
    return xp.sqrt(xp.sum(x * x, axis=(-2, -1)))


# --------------------------------------------------------------------------------------
# 1. variance of the dot product
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DotProductVariance:
    """Empirical moments of ``s = q·k`` and of ``s / sqrt(d_k)``, per key width.

    Attributes
    ----------
    d_k : numpy.ndarray of int
        Key widths.
    n_samples : int
        Independent ``(q, k)`` pairs per width.
    confidence : float
        Coverage of the ``*_interval`` methods.
    mean, variance : numpy.ndarray
        Sample mean and unbiased sample variance of ``q·k`` (theory: 0 and ``d_k``).
    scaled_mean, scaled_variance : numpy.ndarray
        The same for ``q·k / sqrt(d_k)`` (theory: 0 and 1), computed on the backend from the
        scaled products.
    variance_stderr, scaled_variance_stderr : numpy.ndarray
        Standard error of the sample variance under the theory (see
        :func:`dot_product_variance`).
    mean_stderr, scaled_mean_stderr : numpy.ndarray
        ``sqrt(d_k / N)`` and ``sqrt(1 / N)``.
    """

    d_k: np.ndarray
    n_samples: int
    confidence: float
    mean: np.ndarray
    variance: np.ndarray
    scaled_mean: np.ndarray
    scaled_variance: np.ndarray
    variance_stderr: np.ndarray
    scaled_variance_stderr: np.ndarray
    mean_stderr: np.ndarray
    scaled_mean_stderr: np.ndarray

    @property
    def z(self) -> float:
        """Two-sided normal quantile of :attr:`confidence` (3.29 for 0.999)."""
        return NormalDist().inv_cdf(0.5 + self.confidence / 2)

    def variance_interval(self, *, scaled: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Interval around the theoretical variance that the sample variance falls in.

        ``theory ± z · stderr`` with theory ``d_k`` (or 1 if ``scaled``).
        """
        theory = np.ones_like(self.variance) if scaled else self.d_k.astype(np.float64)
        se = self.scaled_variance_stderr if scaled else self.variance_stderr
        return theory - self.z * se, theory + self.z * se

    def mean_interval(self, *, scaled: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Interval around 0 that the sample mean falls in: ``± z · stderr``."""
        se = self.scaled_mean_stderr if scaled else self.mean_stderr
        return -self.z * se, self.z * se


def dot_product_variance(
    d_ks: Sequence[int] = D_KS,
    n_samples: int = 4096,
    *,
    backend: Backend | str = "numpy",
    dtype: str = "float64",
    confidence: float = 0.999,
    seed: int = 0,
) -> DotProductVariance:
    r"""Mean and variance of ``q·k`` for i.i.d. standard normal components, per ``d_k``.

    Parameters
    ----------
    d_ks : sequence of int, default (4, 8, ..., 1024)
        Key widths ``d_k``.
    n_samples : int, default 4096
        Independent pairs ``(q, k)`` drawn per width (``N`` below).
    backend : Backend or str, default "numpy"
        Where the products and moments are computed: a backend or its id in
        :data:`sdpa_array.backends.BACKENDS`.
    dtype : str, default "float64"
        Floating dtype on the backend.
    confidence : float, default 0.999
        Coverage of the intervals the result reports.
    seed : int, default 0
        Seed of the NumPy generator.

    Returns
    -------
    DotProductVariance

    Notes
    -----
    With ``q_l, k_l`` independent, mean 0, variance 1 (design note 000, §2.3),
    ``s = Σ_l q_l k_l`` has mean 0 and variance ``d_k``, and ``s / sqrt(d_k)`` has variance 1.

    **Standard error of the sample variance.** For ``N`` i.i.d. draws of a variable with
    variance ``σ²`` and fourth central moment ``μ₄``, the unbiased sample variance ``S²`` has

    .. math:: \operatorname{Var}(S^2) = \frac{\mu_4}{N} - \frac{\sigma^4 (N - 3)}{N (N - 1)}
              = \sigma^4 \left( \frac{2}{N - 1} + \frac{\kappa - 3}{N} \right),

    with kurtosis ``κ = μ₄ / σ⁴``. Each term ``x_l = q_l k_l`` of a product of independent
    standard normals has ``E[x_l²] = 1`` and ``E[x_l⁴] = E[q⁴] E[k⁴] = 3 · 3 = 9``. The terms
    are independent with mean 0, so
    ``E[s⁴] = Σ_l E[x_l⁴] + 3 Σ_{l≠m} E[x_l²] E[x_m²] = 9 d_k + 3 d_k (d_k - 1)
    = 3 d_k² + 6 d_k``, i.e. ``κ(s) = 3 + 6 / d_k``. Therefore

    .. math:: \operatorname{SE}(S^2) = d_k \sqrt{\frac{2}{N - 1} + \frac{6}{d_k N}},

    and ``sqrt(2 / (N - 1) + 6 / (d_k N))`` after scaling (scaling by ``1/sqrt(d_k)`` leaves
    the kurtosis unchanged). The sample mean has standard error ``sqrt(d_k / N)``. For
    ``N`` in the thousands ``S²`` is close to normal (central limit theorem), so
    ``theory ± z · SE`` with ``z = 3.29`` covers it with probability about 0.999.

    Examples
    --------
    >>> r = dot_product_variance(d_ks=(64,), n_samples=4096)
    >>> lo, hi = r.variance_interval()
    >>> bool(lo[0] < r.variance[0] < hi[0])
    True
    """
    b = _backend(backend)
    rng = np.random.default_rng(seed)
    n = int(n_samples)
    stats = []
    for d in d_ks:
        q = _normal(b, rng, (n, d), dtype)
        k = _normal(b, rng, (n, d), dtype)
        xp = _ns(q=q, k=k)
        s = xp.sum(q * k, axis=-1)
        scaled = s * (1.0 / math.sqrt(d))
        stats.append(
            [
                float(xp.mean(s)),
                float(xp.var(s, correction=1)),
                float(xp.mean(scaled)),
                float(xp.var(scaled, correction=1)),
            ]
        )
    d_k = np.asarray(d_ks, dtype=np.int64)
    m = np.asarray(stats, dtype=np.float64).reshape(len(d_k), 4)
    rel_se = np.sqrt(2.0 / (n - 1) + 6.0 / (d_k * n))
    return DotProductVariance(
        d_k=d_k,
        n_samples=n,
        confidence=confidence,
        mean=m[:, 0],
        variance=m[:, 1],
        scaled_mean=m[:, 2],
        scaled_variance=m[:, 3],
        variance_stderr=d_k * rel_se,
        scaled_variance_stderr=rel_se,
        mean_stderr=np.sqrt(d_k / n),
        scaled_mean_stderr=np.full(d_k.shape, math.sqrt(1.0 / n)),
    )


# --------------------------------------------------------------------------------------
# 2. softmax saturation
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoftmaxSaturation:
    """Softmax of logit rows of growing variance, and the size of its Jacobian.

    Row ``r`` at variance ``v`` is ``sqrt(v) · z_r`` for one standard normal draw ``z_r``
    shared by all variances, so the rows differ only by the scale of their logits.

    Attributes
    ----------
    variances : numpy.ndarray, shape (V,)
        Logit variances.
    logits, probabilities : numpy.ndarray, shape (V, R, n)
        The logit rows and their softmax.
    max_probability, entropy, jacobian_norm : numpy.ndarray, shape (V, R)
        Per row: largest probability, entropy in nats (``log n`` when uniform), and the
        Frobenius norm of ``diag(p) - p pᵀ`` computed from the formed Jacobian.
    jacobian_bound : numpy.ndarray, shape (V, R)
        ``2 (1 - Σ p_j²)``, the sum of the Jacobian's absolute entries, an upper bound of
        :attr:`jacobian_norm` that vanishes as ``p`` becomes one-hot.
    """

    variances: np.ndarray
    logits: np.ndarray
    probabilities: np.ndarray
    max_probability: np.ndarray
    entropy: np.ndarray
    jacobian_norm: np.ndarray
    jacobian_bound: np.ndarray

    @property
    def n_positions(self) -> int:
        """Length ``n`` of each logit row."""
        return int(self.logits.shape[-1])


def softmax_saturation(
    variances: Sequence[float] = VARIANCES,
    n_positions: int = 64,
    n_rows: int = 256,
    *,
    backend: Backend | str = "numpy",
    dtype: str = "float64",
    seed: int = 0,
) -> SoftmaxSaturation:
    """Softmax distributions, their peak, entropy and Jacobian norm against logit variance.

    Parameters
    ----------
    variances : sequence of float, default (1, 10, 20, 30, 50, 100)
        Variances of the logits (design note 003).
    n_positions : int, default 64
        Length of each logit row.
    n_rows : int, default 256
        Independent rows per variance, to average over.
    backend : Backend or str, default "numpy"
        Where the softmax and the Jacobians are computed.
    dtype : str, default "float64"
        Floating dtype on the backend.
    seed : int, default 0
        Seed of the NumPy generator.

    Returns
    -------
    SoftmaxSaturation

    Notes
    -----
    Because every variance rescales the same draw ``z``, the peak probability grows and the
    entropy falls monotonically with the variance, row by row: ``p_max = 1 / Σ_j exp(β (z_j
    - z_max))`` with ``β = sqrt(v)`` has every term decreasing in ``β``, and
    ``dH/dβ = -β Var_p(z) <= 0``.

    The Jacobian norm is **not** monotone from variance 1: over 64 positions a variance-1
    row is spread out, so every ``p_j (δ_jk - p_k)`` is small; the norm peaks when a few
    positions share the mass (``1/2`` for two equal halves), then falls towards 0 below the
    bound ``2 (1 - Σ p_j²) <= 4 (1 - p_max)`` as one position takes all the mass. That fall
    is the saturation the design notes describe; it is what happens to attention logits of
    variance ``d_k`` without the ``1/sqrt(d_k)`` scale.
    """
    b = _backend(backend)
    rng = np.random.default_rng(seed)
    v = np.asarray(variances, dtype=np.float64)
    z = rng.standard_normal((n_rows, n_positions))
    logits_np = np.sqrt(v)[:, None, None] * z[None, :, :]
    logits = b.asarray(logits_np, dtype)
    xp = _ns(logits=logits)
    p = softmax(logits)
    # Per variance, so that only one (R, n, n) stack of Jacobians is alive at a time.
    jac_norm = xp.stack([_frobenius(softmax_jacobian(p[i, ...]), xp) for i in range(len(v))])
    safe_log = xp.log(xp.where(p > 0, p, xp.ones_like(p)))
    entropy = -xp.sum(p * safe_log, axis=-1)
    return SoftmaxSaturation(
        variances=v,
        logits=logits_np,
        probabilities=_host(p),
        max_probability=_host(xp.max(p, axis=-1)),
        entropy=_host(entropy),
        jacobian_norm=_host(jac_norm),
        jacobian_bound=_host(2.0 * (1.0 - xp.sum(p * p, axis=-1))),
    )


# --------------------------------------------------------------------------------------
# 3. gradient flow
# --------------------------------------------------------------------------------------


def _score_gradient(p: Any, grad_output: Any, value: Any) -> Any:
    """``dS = P ∘ (dP - rowsum(dP ∘ P))`` with ``dP = dO Vᵀ``: the cotangent of the scores."""
    xp = _ns(p=p, grad_output=grad_output, value=value)
    dp = xp.matmul(grad_output, xp.matrix_transpose(value))
    return p * (dp - xp.sum(dp * p, axis=-1, keepdims=True))


def attention_vjp_from_derivation(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    /,
    *,
    scale: float | None = None,
) -> tuple[Any, Any, Any]:
    """Gradients of ``softmax(scale · Q Kᵀ) V`` written out from the chain rule.

    Parameters
    ----------
    query : array, shape (..., L, E)
    key : array, shape (..., S, E)
    value : array, shape (..., S, Ev)
    grad_output : array, shape (..., L, Ev)
        Cotangent ``dO`` of the output.
    scale : float, optional
        Score scale; default ``1 / sqrt(E)``.

    Returns
    -------
    grad_query, grad_key, grad_value : array
        ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q`` and ``dV = Pᵀ dO``, in the inputs'
        library, dtype and device.

    Notes
    -----
    With ``P = softmax(scale · Q Kᵀ)`` row-wise: ``dV = Pᵀ dO``, ``dP = dO Vᵀ``; the softmax
    Jacobian ``diag(p) - p pᵀ`` applied to each row of ``dP`` gives
    ``dS = P ∘ (dP - rowsum(dP ∘ P))``; and ``S = scale · Q Kᵀ`` gives ``dQ = scale · dS K``
    and ``dK = scale · dSᵀ Q`` (design note 000, §4.1). No masks: the experiments do not need
    them.
    """
    xp = _ns(query=query, key=key, value=value, grad_output=grad_output)
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    p = softmax(xp.matmul(query, xp.matrix_transpose(key)) * s)
    ds = _score_gradient(p, grad_output, value)
    grad_query = xp.matmul(ds, key) * s
    grad_key = xp.matmul(xp.matrix_transpose(ds), query) * s
    grad_value = xp.matmul(xp.matrix_transpose(p), grad_output)
    return grad_query, grad_key, grad_value


#: The VJP the gradient experiments call: the library's own backward pass
#: (:func:`sdpa_array.scaled_dot_product_attention_vjp`), which
#: :func:`attention_vjp_from_derivation` spells out step by step for the unmasked case.
attention_vjp = scaled_dot_product_attention_vjp


#: Scales compared by :func:`gradient_flow`, by name: ``d`` is the key width ``d_k``.
SCALES: dict[str, Any] = {
    "1": lambda d: 1.0,
    "1/sqrt(d_k)": lambda d: 1.0 / math.sqrt(d),
    "1/d_k": lambda d: 1.0 / d,
}


@dataclass(frozen=True)
class GradientFlow:
    """Size of the gradient reaching ``Q`` through attention, per scale and key width.

    Attributes
    ----------
    d_k : numpy.ndarray of int
        Key widths.
    scales : tuple of str
        Scale names, keys of :data:`SCALES`.
    grad_query_norms : numpy.ndarray, shape (len(scales), len(d_k), rows)
        Euclidean norm of every row ``dL/dQ_i`` (``rows = batch · L``).
    max_weight : numpy.ndarray, shape (len(scales), len(d_k))
        Mean over query rows of the largest attention weight (1 = one-hot).
    """

    d_k: np.ndarray
    scales: tuple[str, ...]
    grad_query_norms: np.ndarray
    max_weight: np.ndarray

    def quantile(self, q: float) -> np.ndarray:
        """Quantile ``q`` of the row norms, shape ``(len(scales), len(d_k))``."""
        return np.quantile(self.grad_query_norms, q, axis=-1)

    @property
    def median(self) -> np.ndarray:
        """Median row norm: the gradient a typical query receives."""
        return self.quantile(0.5)

    @property
    def rms(self) -> np.ndarray:
        """Root-mean-square row norm, ``||dQ||_F / sqrt(rows)``: dominated by the largest rows."""
        return np.sqrt(np.mean(self.grad_query_norms**2, axis=-1))


def gradient_flow(
    d_ks: Sequence[int] = D_KS,
    *,
    n_queries: int = 64,
    n_keys: int = 64,
    d_v: int = 32,
    batch: int = 8,
    backend: Backend | str = "numpy",
    dtype: str = "float64",
    seed: int = 0,
) -> GradientFlow:
    """Norm of ``dL/dQ`` as ``d_k`` grows, for scales 1, ``1/sqrt(d_k)`` and ``1/d_k``.

    ``Q`` and ``K`` have i.i.d. standard normal entries (so ``Q Kᵀ`` has variance ``d_k``),
    and ``V`` and the upstream gradient ``dO`` are standard normal of fixed width ``d_v``, so
    only ``d_k`` and the scale change. The same draws are used for the three scales.

    Parameters
    ----------
    d_ks : sequence of int, default (4, 8, ..., 1024)
    n_queries, n_keys : int, default 64
        ``L`` and ``S``.
    d_v : int, default 32
        Value width.
    batch : int, default 8
        Independent problems (leading axis); the statistics run over all ``batch · L`` rows.
    backend : Backend or str, default "numpy"
    dtype : str, default "float64"
    seed : int, default 0

    Returns
    -------
    GradientFlow

    Notes
    -----
    Each row is ``dQ_i = scale · Σ_j dS_ij k_j``.

    * ``1/sqrt(d_k)``: the scaled scores of a row are close to ``N(0, 1)`` whatever ``d_k``,
      so ``dS`` has the same distribution for every ``d_k``, and ``||dQ_i||² ≈ (1/d_k) Σ_l
      (Σ_j dS_ij k_jl)² ≈ ||dS_i||²`` does not depend on ``d_k``.
    * ``1/d_k``: the scores shrink like ``1/sqrt(d_k)``, the weights tend to uniform, and
      ``||dQ_i||`` falls like ``1/sqrt(d_k)``.
    * ``1``: the scores have variance ``d_k``, most rows saturate to one-hot and their
      ``dS_i`` — hence ``dQ_i`` — collapses exponentially in the gap between the two largest
      scores (:func:`softmax_saturation`): the median row norm falls towards 0. The few rows
      whose two largest scores nearly tie still get large gradients (they grow with
      ``||k_j|| ≈ sqrt(d_k)``), so the root-mean-square norm grows: the gradient does not
      shrink uniformly, it concentrates on a handful of queries and vanishes for the rest.
    """
    b = _backend(backend)
    rng = np.random.default_rng(seed)
    value = _normal(b, rng, (batch, n_keys, d_v), dtype)
    grad_output = _normal(b, rng, (batch, n_queries, d_v), dtype)
    norms = np.empty((len(SCALES), len(d_ks), batch * n_queries))
    peak = np.empty(norms.shape[:2])
    for j, d in enumerate(d_ks):
        query = _normal(b, rng, (batch, n_queries, d), dtype)
        key = _normal(b, rng, (batch, n_keys, d), dtype)
        xp = _ns(query=query, key=key)
        scores = xp.matmul(query, xp.matrix_transpose(key))
        for i, scale_of in enumerate(SCALES.values()):
            scale = scale_of(d)
            grad_query, _, _ = attention_vjp(query, key, value, grad_output, scale=scale)
            row_norms = xp.sqrt(xp.sum(grad_query * grad_query, axis=-1))
            norms[i, j, :] = _host(row_norms).reshape(-1)
            peak[i, j] = float(xp.mean(xp.max(softmax(scores * scale), axis=-1)))
    return GradientFlow(
        d_k=np.asarray(d_ks, dtype=np.int64),
        scales=tuple(SCALES),
        grad_query_norms=norms,
        max_weight=peak,
    )


# --------------------------------------------------------------------------------------
# 4. dot-product versus additive attention
# --------------------------------------------------------------------------------------


def additive_attention(
    query: Any,
    key: Any,
    value: Any,
    w_query: Any,
    w_key: Any,
    v_a: Any,
    /,
    *,
    return_weights: bool = False,
) -> Any:
    """Additive (Bahdanau) attention: scores ``v_aᵀ tanh(W q_i + U k_j)``.

    Parameters
    ----------
    query : array, shape (..., L, Dq)
    key : array, shape (..., S, Dk)
    value : array, shape (..., S, Dv)
    w_query : array, shape (Da, Dq)
        ``W``, applied to every query once.
    w_key : array, shape (Da, Dk)
        ``U``, applied to every key once.
    v_a : array, shape (Da,)
        The vector that reduces ``tanh(W q_i + U k_j)`` to a score.
    return_weights : bool, default False
        Also return the softmax weights ``(..., L, S)``.

    Returns
    -------
    out : array, shape (..., L, Dv)
        ``softmax(scores) V``.
    weights : array, shape (..., L, S)
        Only if ``return_weights``.

    Notes
    -----
    The projections are computed once per query and once per key (``O(L Dq Da + S Dk Da)``);
    only the ``L S`` sums ``W q_i + U k_j``, their ``tanh`` and the dot products with ``v_a``
    are pairwise (``O(L S Da)``), materialized as an ``(..., L, S, Da)`` array. See
    :func:`additive_attention_flops`.
    """
    xp = _ns(query=query, key=key, value=value, w_query=w_query, w_key=w_key, v_a=v_a)
    projected_q = xp.matmul(query, xp.matrix_transpose(w_query))  # (..., L, Da)
    projected_k = xp.matmul(key, xp.matrix_transpose(w_key))  # (..., S, Da)
    hidden = xp.tanh(projected_q[..., :, None, :] + projected_k[..., None, :, :])
    weights = softmax(xp.sum(hidden * v_a, axis=-1))
    out = xp.matmul(weights, value)
    return (out, weights) if return_weights else out


@dataclass(frozen=True)
class FlopCount:
    """Floating-point operations of one attention evaluation, term by term.

    A multiply-add counts 2, and ``exp``/``tanh`` count 1 each; the softmax counts 5 per
    score (max, subtract, exp, sum, divide).

    Attributes
    ----------
    terms : tuple of (str, int)
        Named terms, in evaluation order.
    """

    terms: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        """Sum of the terms."""
        return sum(count for _, count in self.terms)


def dot_product_attention_flops(n: int, m: int, d_k: int, d_v: int) -> FlopCount:
    """Flops of ``softmax(Q Kᵀ / sqrt(d_k)) V`` for ``n`` queries and ``m`` keys.

    ``2 n m d_k`` (``Q Kᵀ``) + ``n m`` (scale) + ``5 n m`` (softmax) + ``2 n m d_v``
    (``P V``): ``O(n m d)``.

    Examples
    --------
    >>> dot_product_attention_flops(128, 128, 64, 64).total
    4292608
    """
    return FlopCount(
        (
            ("Q Kᵀ", 2 * n * m * d_k),
            ("scale", n * m),
            ("softmax", 5 * n * m),
            ("P V", 2 * n * m * d_v),
        )
    )


def additive_attention_flops(
    n: int, m: int, d_q: int, d_k: int, d_a: int, d_v: int, *, project_once: bool = True
) -> FlopCount:
    """Flops of additive attention ``softmax(v_aᵀ tanh(W q_i + U k_j)) V``.

    Parameters
    ----------
    n, m : int
        Numbers of queries and keys.
    d_q, d_k, d_a, d_v : int
        Widths of queries, keys, the hidden ``tanh`` layer and values.
    project_once : bool, default True
        ``True``: ``W q_i`` and ``U k_j`` are computed once per query and per key
        (``2 n d_a d_q + 2 m d_a d_k``), as :func:`additive_attention` does. ``False``: they
        are recomputed for every pair (``2 n m d_a (d_q + d_k)``), the count behind the
        often quoted ``O(n² d²)``.

    Returns
    -------
    FlopCount

    Notes
    -----
    Projected once, the pairwise work is ``n m d_a`` additions, ``n m d_a`` tanh and
    ``2 n m d_a`` for the products with ``v_a``: ``O(n m d_a + (n + m) d²)``, the same order
    as dot-product attention's ``O(n m d)``. What stays worse is the constant (``4 n m d_a``
    pairwise against ``2 n m d_k``), the ``n m d_a`` transcendental ``tanh`` evaluations, and
    that this work is elementwise on an ``n × m × d_a`` array instead of one matrix product.

    Examples
    --------
    >>> additive_attention_flops(128, 128, 64, 64, 64, 64).total
    8470528
    >>> additive_attention_flops(128, 128, 64, 64, 64, 64, project_once=False).total
    274808832
    """
    if project_once:
        projections = (
            ("W q (once per query)", 2 * n * d_a * d_q),
            ("U k (once per key)", 2 * m * d_a * d_k),
        )
    else:
        projections = (
            ("W q (per pair)", 2 * n * m * d_a * d_q),
            ("U k (per pair)", 2 * n * m * d_a * d_k),
        )
    return FlopCount(
        (
            *projections,
            ("W q + U k", n * m * d_a),
            ("tanh", n * m * d_a),
            ("v_aᵀ ·", 2 * n * m * d_a),
            ("softmax", 5 * n * m),
            ("P V", 2 * n * m * d_v),
        )
    )


@dataclass(frozen=True)
class AttentionCost:
    """Measured time and counted flops of dot-product and additive attention against ``d``.

    Attributes
    ----------
    dims : numpy.ndarray of int
        ``d = d_k = d_v = d_a`` (and the query/key width of additive attention).
    n : int
        Queries and keys (self-attention length).
    backend : str
        Backend id the times were measured on.
    dot_seconds, additive_seconds : numpy.ndarray
        Best time of one call of :func:`sdpa_array.scaled_dot_product_attention` and of
        :func:`additive_attention`.
    dot_flops, additive_flops, additive_naive_flops : numpy.ndarray of int
        :func:`dot_product_attention_flops` and :func:`additive_attention_flops` projected
        once and per pair.
    """

    dims: np.ndarray
    n: int
    backend: str
    dot_seconds: np.ndarray
    additive_seconds: np.ndarray
    dot_flops: np.ndarray
    additive_flops: np.ndarray
    additive_naive_flops: np.ndarray


def _best_time(run: Any, args: tuple[Any, ...], repeats: int) -> float:
    """Best wall time of ``run(*args)`` after one warm-up.

    Reducing the result to a Python float forces the work on every backend (computes Dask
    graphs, waits for GPU queues and JAX's asynchronous dispatch).
    """
    xp = _ns(first=args[0])
    float(xp.sum(run(*args)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        float(xp.sum(run(*args)))
        best = min(best, time.perf_counter() - start)
    return best


def attention_cost(
    dims: Sequence[int] = (16, 32, 64, 128, 256),
    n: int = 128,
    *,
    backend: Backend | str = "numpy",
    dtype: str = "float32",
    repeats: int = 5,
    seed: int = 0,
) -> AttentionCost:
    """Time dot-product and additive attention of width ``d``, and count their flops.

    Parameters
    ----------
    dims : sequence of int, default (16, 32, 64, 128, 256)
        Widths ``d`` (used for ``d_k``, ``d_v`` and ``d_a``).
    n : int, default 128
        Sequence length (``n`` queries attend ``n`` keys).
    backend : Backend or str, default "numpy"
    dtype : str, default "float32"
    repeats : int, default 5
        Timed calls per width; the best is kept.
    seed : int, default 0

    Returns
    -------
    AttentionCost
    """
    from . import scaled_dot_product_attention

    b = _backend(backend)
    rng = np.random.default_rng(seed)
    dot_t, add_t, flops = [], [], []
    for d in dims:
        q, k, v = (_normal(b, rng, (n, d), dtype) for _ in range(3))
        w_q = b.asarray(rng.standard_normal((d, d)) / math.sqrt(d), dtype)
        w_k = b.asarray(rng.standard_normal((d, d)) / math.sqrt(d), dtype)
        v_a = _normal(b, rng, (d,), dtype)
        dot_t.append(_best_time(scaled_dot_product_attention, (q, k, v), repeats))
        add_t.append(_best_time(additive_attention, (q, k, v, w_q, w_k, v_a), repeats))
        flops.append(
            (
                dot_product_attention_flops(n, n, d, d).total,
                additive_attention_flops(n, n, d, d, d, d).total,
                additive_attention_flops(n, n, d, d, d, d, project_once=False).total,
            )
        )
    f = np.asarray(flops, dtype=np.int64).reshape(len(dims), 3)
    return AttentionCost(
        dims=np.asarray(dims, dtype=np.int64),
        n=n,
        backend=b.id,
        dot_seconds=np.asarray(dot_t),
        additive_seconds=np.asarray(add_t),
        dot_flops=f[:, 0],
        additive_flops=f[:, 1],
        additive_naive_flops=f[:, 2],
    )


# --------------------------------------------------------------------------------------
# 5. query/key asymmetry
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryKeyAsymmetry:
    """Self-attention scores, their two softmaxes, and the gradients to ``Q`` and ``K``.

    Attributes
    ----------
    scores : numpy.ndarray, shape (n, n)
        ``S = scale · Q Kᵀ``; row ``i`` is query ``i``, column ``j`` key ``j``.
    weights : numpy.ndarray, shape (n, n)
        ``softmax(S)`` by rows: how each query distributes its attention (rows sum to 1).
    swapped_weights : numpy.ndarray, shape (n, n)
        ``softmax(Sᵀ)`` by rows, i.e. ``Q`` and ``K`` exchanged: row ``j`` is how key ``j``'s
        incoming attention splits over the queries (rows sum to 1).
    grad_scores : numpy.ndarray, shape (n, n)
        ``dS = P ∘ (dP - rowsum(dP ∘ P))`` for a random upstream gradient ``dO``.
    grad_query, grad_key : numpy.ndarray, shape (n, d_k)
        ``dL/dQ = scale · dS K`` and ``dL/dK = scale · dSᵀ Q``, from :data:`attention_vjp`.
    """

    scores: np.ndarray
    weights: np.ndarray
    swapped_weights: np.ndarray
    grad_scores: np.ndarray
    grad_query: np.ndarray
    grad_key: np.ndarray

    @property
    def received(self) -> np.ndarray:
        """Column sums of :attr:`weights`: the total attention each key receives."""
        return self.weights.sum(axis=0)

    @property
    def max_swap_difference(self) -> float:
        """``max |softmax(S) - softmax(Sᵀ)ᵀ|``: 0 only if both normalizations agree."""
        return float(np.max(np.abs(self.weights - self.swapped_weights.T)))

    @property
    def grad_query_sum(self) -> np.ndarray:
        """``Σ_i dL/dQ_i``: nothing forces it to 0."""
        return self.grad_query.sum(axis=0)

    @property
    def grad_key_sum(self) -> np.ndarray:
        """``Σ_j dL/dK_j = scale · Qᵀ (dS 1) = 0``, since every row of ``dS`` sums to 0.

        Adding one vector to every key adds a constant to each row of scores, which the
        row softmax ignores; this is the gradient of that invariance.
        """
        return self.grad_key.sum(axis=0)


def query_key_asymmetry(
    n: int = 8,
    d_k: int = 16,
    d_v: int = 16,
    *,
    backend: Backend | str = "numpy",
    dtype: str = "float64",
    seed: int = 0,
) -> QueryKeyAsymmetry:
    """Compare ``softmax(S)`` with ``softmax(Sᵀ)`` and ``dL/dQ`` with ``dL/dK`` on one problem.

    Parameters
    ----------
    n : int, default 8
        Sequence length (``n`` queries and ``n`` keys, as in self-attention).
    d_k, d_v : int, default 16
        Query/key and value widths.
    backend : Backend or str, default "numpy"
    dtype : str, default "float64"
    seed : int, default 0

    Returns
    -------
    QueryKeyAsymmetry

    Notes
    -----
    Design note 000, §4.1: the softmax normalizes over keys, so ``softmax(S)`` has unit row
    sums but arbitrary column sums, and exchanging ``Q`` and ``K`` normalizes over queries
    instead. In the backward pass the rows of ``dS`` sum to 0 (the Jacobian
    ``diag(p) - p pᵀ`` annihilates constants), so ``dL/dQ_i = scale · Σ_j dS_ij k_j`` is a
    zero-sum contrast of keys, while ``dL/dK_j = scale · Σ_i dS_ij q_i`` weights queries by
    column entries of ``dS`` that need not sum to 0; consequently
    ``Σ_j dL/dK_j = 0`` exactly and ``Σ_i dL/dQ_i`` is not.
    """
    b = _backend(backend)
    rng = np.random.default_rng(seed)
    query = _normal(b, rng, (n, d_k), dtype)
    key = _normal(b, rng, (n, d_k), dtype)
    value = _normal(b, rng, (n, d_v), dtype)
    grad_output = _normal(b, rng, (n, d_v), dtype)
    xp = _ns(query=query, key=key)
    scale = 1.0 / math.sqrt(d_k)
    scores = xp.matmul(query, xp.matrix_transpose(key)) * scale
    weights = softmax(scores)
    grad_query, grad_key, _ = attention_vjp(query, key, value, grad_output, scale=scale)
    return QueryKeyAsymmetry(
        scores=_host(scores),
        weights=_host(weights),
        swapped_weights=_host(softmax(xp.matrix_transpose(scores))),
        grad_scores=_host(_score_gradient(weights, grad_output, value)),
        grad_query=_host(grad_query),
        grad_key=_host(grad_key),
    )


# --------------------------------------------------------------------------------------
# 6. the worked example
# --------------------------------------------------------------------------------------

EXAMPLE_QUERY = ((1.0, 2.0), (3.0, 4.0))
EXAMPLE_KEY = ((5.0, 6.0), (7.0, 8.0), (9.0, 10.0))
EXAMPLE_VALUE = ((1.0, 0.0, 1.0), (0.0, 1.0, 0.0), (1.0, 1.0, 0.0))

#: The rounded figures design note 001 publishes, as printed there.
PUBLISHED: dict[str, tuple[tuple[str, ...], ...]] = {
    "scaled": (("12.02", "16.26", "20.51"), ("27.58", "37.48", "47.38")),
    "weights": (("2.06e-4", "0.016", "0.984"), ("1.67e-9", "0.0001", "0.9999")),
    "output": (("0.984", "1.000", "0.0002"), ("0.9999", "0.9999", "0.0001")),
}


@dataclass(frozen=True)
class PublishedFigure:
    """One rounded figure of the design note, against the exact value.

    Attributes
    ----------
    matrix : str
        ``"scaled"``, ``"weights"`` or ``"output"``.
    index : tuple of int
        ``(row, column)``.
    published : str
        The figure as printed.
    exact : float
        The exact value (float64).
    """

    matrix: str
    index: tuple[int, int]
    published: str
    exact: float

    @property
    def half_unit(self) -> float:
        """Half a unit in the last printed digit: the largest error honest rounding leaves."""
        exponent = Decimal(self.published).as_tuple().exponent
        assert isinstance(exponent, int)
        return 0.5 * 10.0**exponent

    @property
    def error(self) -> float:
        """``|published - exact|``."""
        return abs(float(self.published) - self.exact)

    @property
    def consistent(self) -> bool:
        """Whether the figure is the exact value correctly rounded (error <= half a unit)."""
        return self.error <= self.half_unit * (1 + 1e-9)

    @property
    def correctly_rounded(self) -> str:
        """The exact value rounded to the published figure's last digit, in its style."""
        if "e" in self.published.lower():
            digits = len(self.published.lower().split("e")[0].replace(".", "")) - 1
            return f"{self.exact:.{digits}e}"
        exponent = Decimal(self.published).as_tuple().exponent
        assert isinstance(exponent, int)
        return f"{self.exact:.{max(-exponent, 0)}f}"


@dataclass(frozen=True)
class WorkedExample:
    """Every intermediate of design note 001's example, exact, and its published figures.

    Attributes
    ----------
    query, key, value : numpy.ndarray
        ``Q`` (2×2), ``K`` (3×2), ``V`` (3×3).
    scores : numpy.ndarray
        ``Q Kᵀ`` = ``[[17, 23, 29], [39, 53, 67]]``.
    scaled : numpy.ndarray
        ``Q Kᵀ / sqrt(2)``.
    weights, output : numpy.ndarray
        From :func:`sdpa_array.scaled_dot_product_attention` with ``return_weights=True``.
    published : tuple of PublishedFigure
        The note's rounded figures, each with the exact value.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    scores: np.ndarray
    scaled: np.ndarray
    weights: np.ndarray
    output: np.ndarray
    published: tuple[PublishedFigure, ...]

    @property
    def discrepancies(self) -> tuple[PublishedFigure, ...]:
        """Published figures that are wrong beyond their rounding."""
        return tuple(f for f in self.published if not f.consistent)


def worked_example(*, backend: Backend | str = "numpy", dtype: str = "float64") -> WorkedExample:
    """Design note 001's example (``d_k = 2``, two queries, three keys), computed exactly.

    Parameters
    ----------
    backend : Backend or str, default "numpy"
    dtype : str, default "float64"

    Returns
    -------
    WorkedExample

    Notes
    -----
    The exact weights are ``[[2.035e-4, 0.01416, 0.98563], [2.52e-9, 5.02e-5, 0.99995]]``
    and the output ``[[0.98584, 0.99980, 2.035e-4], [0.99995, 1.0000, 2.5e-9]]``. Of the
    published figures, four of the weights and three of the outputs are wrong beyond their
    rounding (:attr:`WorkedExample.discrepancies`); the scaled scores are right.

    Examples
    --------
    >>> ex = worked_example()
    >>> ex.weights.round(4)
    array([[2.000e-04, 1.420e-02, 9.856e-01],
           [0.000e+00, 1.000e-04, 9.999e-01]])
    >>> [(f.matrix, f.index, f.published, f.correctly_rounded) for f in ex.discrepancies][:2]
    [('weights', (0, 0), '2.06e-4', '2.04e-04'), ('weights', (0, 1), '0.016', '0.014')]
    """
    from . import scaled_dot_product_attention

    b = _backend(backend)
    query = b.asarray(np.asarray(EXAMPLE_QUERY), dtype)
    key = b.asarray(np.asarray(EXAMPLE_KEY), dtype)
    value = b.asarray(np.asarray(EXAMPLE_VALUE), dtype)
    xp = _ns(query=query, key=key, value=value)
    scores = xp.matmul(query, xp.matrix_transpose(key))
    scaled = scores * (1.0 / math.sqrt(query.shape[-1]))
    output, weights = scaled_dot_product_attention(query, key, value, return_weights=True)
    exact = {"scaled": _host(scaled), "weights": _host(weights), "output": _host(output)}
    figures = tuple(
        PublishedFigure(name, (i, j), text, float(exact[name][i, j]))
        for name, rows in PUBLISHED.items()
        for i, row in enumerate(rows)
        for j, text in enumerate(row)
    )
    return WorkedExample(
        query=_host(query),
        key=_host(key),
        value=_host(value),
        scores=_host(scores),
        scaled=exact["scaled"],
        weights=exact["weights"],
        output=exact["output"],
        published=figures,
    )


# --------------------------------------------------------------------------------------
# attention patterns (masks, alignment, window, GQA)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsPanel:
    """Attention weights of one call, for a heatmap.

    Attributes
    ----------
    title : str
        What the panel shows.
    call : str
        The keyword arguments passed to :func:`sdpa_array.scaled_dot_product_attention`.
    weights : numpy.ndarray, shape (L, S) or (H, L, S)
        The returned weights (exact zeros where a key is excluded).
    """

    title: str
    call: str
    weights: np.ndarray


def attention_patterns(
    *, backend: Backend | str = "numpy", dtype: str = "float64", seed: int = 0
) -> tuple[WeightsPanel, ...]:
    """Weights of one random problem under each masking option of the library.

    Parameters
    ----------
    backend : Backend or str, default "numpy"
    dtype : str, default "float64"
    seed : int, default 0

    Returns
    -------
    tuple of WeightsPanel
        In order: causal (``L = S = 8``); causal with ``L = 4, S = 8`` under
        ``alignment="top_left"`` and ``"bottom_right"``; ``window=(2, 1)``; causal with
        ``window=(2, 0)`` (sliding-window decoding); a padding mask hiding the last 3 of 8
        keys; and grouped-query attention with 4 query heads sharing 2 key/value heads
        (weights of shape ``(4, 8, 8)``: every query head gets the same queries, so heads
        0–1 and heads 2–3 show identical weights).
    """
    from . import scaled_dot_product_attention

    b = _backend(backend)
    rng = np.random.default_rng(seed)
    E = 4

    def run(L: int, S: int, heads_kv: int = 0, heads_q: int = 0, **kwargs: Any) -> np.ndarray:
        q_shape = (heads_q, L, E) if heads_q else (L, E)
        kv_shape = (heads_kv, S, E) if heads_kv else (S, E)
        q = rng.standard_normal((L, E)) * 1.5
        q = b.asarray(np.broadcast_to(q, q_shape).copy(), dtype)
        k = _normal(b, rng, kv_shape, dtype)
        v = _normal(b, rng, (*kv_shape[:-1], 1), dtype)
        _, weights = scaled_dot_product_attention(q, k, v, return_weights=True, **kwargs)
        return _host(weights)

    padding = b.asarray((np.arange(8) < 5)[None, :], "bool")
    return (
        WeightsPanel("causal, L = S = 8", "is_causal=True", run(8, 8, is_causal=True)),
        WeightsPanel(
            "causal, L = 4, S = 8, top_left",
            "is_causal=True, alignment='top_left'",
            run(4, 8, is_causal=True, alignment="top_left"),
        ),
        WeightsPanel(
            "causal, L = 4, S = 8, bottom_right",
            "is_causal=True, alignment='bottom_right'",
            run(4, 8, is_causal=True, alignment="bottom_right"),
        ),
        WeightsPanel("window (2, 1)", "window=(2, 1)", run(8, 8, window=(2, 1))),
        WeightsPanel(
            "causal sliding window (2, 0)",
            "is_causal=True, window=(2, 0)",
            run(8, 8, is_causal=True, window=(2, 0)),
        ),
        WeightsPanel(
            "padding mask: keys 5-7 are padding",
            "mask=arange(8)[None, :] < 5  (shape (1, 8), broadcast over queries)",
            run(8, 8, mask=padding),
        ),
        WeightsPanel(
            "GQA: 4 query heads, 2 key/value heads",
            "enable_gqa=True, query (4, 8, E), key/value (2, 8, E)",
            run(8, 8, heads_kv=2, heads_q=4, enable_gqa=True),
        ),
    )
