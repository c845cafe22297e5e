"""Why the scores are divided by ``sqrt(d_k)``: three experiments.

* :func:`dot_product_variance`: ``Var(q·k) = d_k``, and 1 after ``/ sqrt(d_k)``;
* :func:`softmax_saturation`: large logits make softmax one-hot and its Jacobian vanish;
* :func:`gradient_flow`: the gradient reaching ``Q`` for scales 1, ``1/sqrt(d_k)`` and
  ``1/d_k``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from ..testing.backends import Backend
from ._plumbing import configured, host, namespace_of, normal
from .backward import attention_vjp
from .softmax_and_jacobian import softmax, softmax_jacobian

__all__ = [
    "D_KS",
    "SCALES",
    "VARIANCES",
    "DotProductVariance",
    "GradientFlow",
    "SoftmaxSaturation",
    "dot_product_variance",
    "gradient_flow",
    "softmax_saturation",
]

#: Default key widths of the variance and gradient experiments: 4, 8, ..., 1024.
D_KS: tuple[int, ...] = tuple(2**i for i in range(2, 11))

#: Logit variances of the saturation experiment: those of unscaled logits for d_k = 1 to 100.
VARIANCES: tuple[float, ...] = (1.0, 10.0, 20.0, 30.0, 50.0, 100.0)


def _frobenius(x: Any, xp: Any) -> Any:
    """Frobenius norm over the last two axes."""
    return xp.sqrt(xp.sum(x * x, axis=(-2, -1)))


# --------------------------------------------------------------------------------------
# 1. variance of the dot product
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DotProductVariance:
    """Empirical moments of ``s = q·k`` and of ``s / sqrt(d_k)``, per key width.

    Made by :func:`dot_product_variance`; each parameter is the field of the same name.

    Parameters
    ----------
    d_k : numpy.ndarray of int
        Key widths.
    n_samples : int
        Independent ``(q, k)`` pairs per width.
    confidence : float
        Coverage of the ``*_interval`` methods.
    mean : numpy.ndarray
        Sample mean of ``q·k`` (theory: 0).
    variance : numpy.ndarray
        Unbiased sample variance of ``q·k`` (theory: ``d_k``).
    scaled_mean : numpy.ndarray
        Sample mean of ``q·k / sqrt(d_k)`` (theory: 0), computed on the backend from the
        scaled products.
    scaled_variance : numpy.ndarray
        Unbiased sample variance of ``q·k / sqrt(d_k)`` (theory: 1), likewise.
    variance_stderr : numpy.ndarray
        Standard error of :attr:`variance` under the theory (see
        :func:`dot_product_variance`).
    scaled_variance_stderr : numpy.ndarray
        Standard error of :attr:`scaled_variance` under the theory.
    mean_stderr : numpy.ndarray
        Standard error of :attr:`mean`, ``sqrt(d_k / N)``.
    scaled_mean_stderr : numpy.ndarray
        Standard error of :attr:`scaled_mean`, ``sqrt(1 / N)``.
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

        Parameters
        ----------
        scaled : bool, default False
            Interval for :attr:`scaled_variance` (around 1) instead of :attr:`variance`
            (around ``d_k``).

        Returns
        -------
        low : numpy.ndarray
            ``theory - z · stderr``, one per key width.
        high : numpy.ndarray
            ``theory + z · stderr``, one per key width.
        """
        theory = np.ones_like(self.variance) if scaled else self.d_k.astype(np.float64)
        se = self.scaled_variance_stderr if scaled else self.variance_stderr
        return theory - self.z * se, theory + self.z * se

    def mean_interval(self, *, scaled: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Interval around 0 that the sample mean falls in: ``± z · stderr``.

        Parameters
        ----------
        scaled : bool, default False
            Interval for :attr:`scaled_mean` instead of :attr:`mean`.

        Returns
        -------
        low : numpy.ndarray
            ``-z · stderr``, one per key width.
        high : numpy.ndarray
            ``z · stderr``, one per key width.
        """
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
        :data:`sdpa_array.testing.backends.BACKENDS`.
    dtype : str, default "float64"
        Floating dtype on the backend.
    confidence : float, default 0.999
        Coverage of the intervals the result reports.
    seed : int, default 0
        Seed of the NumPy generator.

    Returns
    -------
    DotProductVariance
        Sample moments of ``q·k`` and ``q·k / sqrt(d_k)`` per width, with their standard
        errors under the theory.

    Notes
    -----
    With ``q_l, k_l`` independent, mean 0, variance 1 (see :ref:`theory-scaling`),
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
    b = configured(backend)
    rng = np.random.default_rng(seed)
    n = int(n_samples)
    stats = []
    for d in d_ks:
        q = normal(b, rng, (n, d), dtype)
        k = normal(b, rng, (n, d), dtype)
        xp = namespace_of(q=q, k=k)
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
    shared by all variances, so the rows differ only by the scale of their logits. Made by
    :func:`softmax_saturation`; each parameter is the field of the same name.

    Parameters
    ----------
    variances : numpy.ndarray, shape (V,)
        Logit variances.
    logits : numpy.ndarray, shape (V, R, n)
        The logit rows.
    probabilities : numpy.ndarray, shape (V, R, n)
        Their softmax.
    max_probability : numpy.ndarray, shape (V, R)
        Largest probability of each row.
    entropy : numpy.ndarray, shape (V, R)
        Entropy of each row in nats (``log n`` when uniform).
    jacobian_norm : numpy.ndarray, shape (V, R)
        Frobenius norm of each row's ``diag(p) - p pᵀ``, computed from the formed Jacobian.
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
        Variances of the logits (unscaled logits have variance ``d_k``; see :ref:`theory-scaling`).
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
        The logits, their softmax, and per row the peak probability, entropy, Jacobian norm
        and its bound.

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
    is the saturation described in :ref:`theory-softmax`; it is what happens to attention logits of
    variance ``d_k`` without the ``1/sqrt(d_k)`` scale.
    """
    b = configured(backend)
    rng = np.random.default_rng(seed)
    v = np.asarray(variances, dtype=np.float64)
    z = rng.standard_normal((n_rows, n_positions))
    logits_np = np.sqrt(v)[:, None, None] * z[None, :, :]
    logits = b.asarray(logits_np, dtype)
    xp = namespace_of(logits=logits)
    p = softmax(logits)
    # Per variance, so that only one (R, n, n) stack of Jacobians is alive at a time.
    jac_norm = xp.stack([_frobenius(softmax_jacobian(p[i, ...]), xp) for i in range(len(v))])
    safe_log = xp.log(xp.where(p > 0, p, xp.ones_like(p)))
    entropy = -xp.sum(p * safe_log, axis=-1)
    return SoftmaxSaturation(
        variances=v,
        logits=logits_np,
        probabilities=host(p),
        max_probability=host(xp.max(p, axis=-1)),
        entropy=host(entropy),
        jacobian_norm=host(jac_norm),
        jacobian_bound=host(2.0 * (1.0 - xp.sum(p * p, axis=-1))),
    )


# --------------------------------------------------------------------------------------
# 3. gradient flow
# --------------------------------------------------------------------------------------


#: Scales compared by :func:`gradient_flow`, by name: ``d`` is the key width ``E``.
SCALES: dict[str, Any] = {
    "1": lambda d: 1.0,
    "1/sqrt(E)": lambda d: 1.0 / math.sqrt(d),
    "1/E": lambda d: 1.0 / d,
}


@dataclass(frozen=True)
class GradientFlow:
    """Size of the gradient reaching ``Q`` through attention, per scale and key width.

    Made by :func:`gradient_flow`; each parameter is the field of the same name.

    Parameters
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
        """Quantile ``q`` of the row norms, per scale and key width.

        Parameters
        ----------
        q : float
            Quantile level in ``[0, 1]`` (0.5: the median).

        Returns
        -------
        numpy.ndarray, shape (len(scales), len(d_k))
            The quantile of :attr:`grad_query_norms` over the query rows.
        """
        return np.asarray(np.quantile(self.grad_query_norms, q, axis=-1))

    @property
    def median(self) -> np.ndarray:
        """Median row norm: the gradient a typical query receives."""
        return self.quantile(0.5)

    @property
    def rms(self) -> np.ndarray:
        """Root-mean-square row norm, ``||dQ||_F / sqrt(rows)``: dominated by the largest rows."""
        return np.asarray(np.sqrt(np.mean(self.grad_query_norms**2, axis=-1)))


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
        Key widths ``d_k``.
    n_queries, n_keys : int, default 64
        ``L`` and ``S``.
    d_v : int, default 32
        Value width.
    batch : int, default 8
        Independent problems (leading axis); the statistics run over all ``batch · L`` rows.
    backend : Backend or str, default "numpy"
        Where the inputs are placed and the gradients computed: a backend or its id in
        :data:`sdpa_array.testing.backends.BACKENDS`.
    dtype : str, default "float64"
        Floating dtype on the backend.
    seed : int, default 0
        Seed of the NumPy generator.

    Returns
    -------
    GradientFlow
        The row norms of ``dL/dQ`` and the mean largest weight, per scale and key width.

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
    b = configured(backend)
    rng = np.random.default_rng(seed)
    value = normal(b, rng, (batch, n_keys, d_v), dtype)
    grad_output = normal(b, rng, (batch, n_queries, d_v), dtype)
    norms = np.empty((len(SCALES), len(d_ks), batch * n_queries))
    peak = np.empty(norms.shape[:2])
    for j, d in enumerate(d_ks):
        query = normal(b, rng, (batch, n_queries, d), dtype)
        key = normal(b, rng, (batch, n_keys, d), dtype)
        xp = namespace_of(query=query, key=key)
        scores = xp.matmul(query, xp.matrix_transpose(key))
        for i, scale_of in enumerate(SCALES.values()):
            scale = scale_of(d)
            grad_query, _, _ = attention_vjp(query, key, value, grad_output, scale=scale)
            row_norms = xp.sqrt(xp.sum(grad_query * grad_query, axis=-1))
            norms[i, j, :] = host(row_norms).reshape(-1)
            peak[i, j] = float(xp.mean(xp.max(softmax(scores * scale), axis=-1)))
    return GradientFlow(
        d_k=np.asarray(d_ks, dtype=np.int64),
        scales=tuple(SCALES),
        grad_query_norms=norms,
        max_weight=peak,
    )
