"""Each experiment of :mod:`sdpa_array.lab` on every CPU backend, against its theory."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from sdpa_array import lab, reference
from sdpa_array.testing.backends import Backend

#: The lab's experiments on JAX compile every new shape: they run in `nox -s tests-slow`.
pytestmark = pytest.mark.slow_on("jax")


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in NumPy, independent of the code under test."""
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# --------------------------------------------------------------------------------------
# 1. variance of the dot product
# --------------------------------------------------------------------------------------


def test_dot_product_variance_within_interval(backend: Backend) -> None:
    # Nine widths, and for each a sample mean and a sample variance: 18 checks. The scaled
    # moments are the same samples divided by sqrt(d_k), not new checks. To make the whole
    # family hold with probability 0.999 (Bonferroni), each interval covers 1 - 0.001 / 18.
    checks = 2 * len(lab.D_KS)
    r = lab.dot_product_variance(
        n_samples=2048, backend=backend, confidence=1 - 0.001 / checks, seed=1
    )
    assert r.z == pytest.approx(NormalDist().inv_cdf(1 - 0.001 / (2 * checks)))
    lo, hi = r.variance_interval()
    assert np.all((lo < r.variance) & (r.variance < hi)), (r.variance, lo, hi)
    mlo, mhi = r.mean_interval()
    assert np.all((mlo < r.mean) & (r.mean < mhi)), (r.mean, mlo, mhi)
    slo, shi = r.variance_interval(scaled=True)
    assert np.all((slo < r.scaled_variance) & (r.scaled_variance < shi))
    smlo, smhi = r.mean_interval(scaled=True)
    assert np.all((smlo < r.scaled_mean) & (r.scaled_mean < smhi))
    # The scaled moments were computed on the backend from the scaled products.
    np.testing.assert_allclose(r.scaled_variance, r.variance / r.d_k, rtol=1e-12)
    np.testing.assert_allclose(r.scaled_mean, r.mean / np.sqrt(r.d_k), rtol=1e-9, atol=1e-15)
    # Without the scale the variance is nowhere near 1 once d_k >= 8.
    assert np.all(lo[1:] > 1.0)


def test_variance_standard_error_formula() -> None:
    """The derived SE(S²) = d_k sqrt(2/(N-1) + 6/(d_k N)) matches replicated experiments.

    With d_k = 4 the kurtosis term 6/(d_k N) is 3/4 of the normal-theory term 2/(N-1), so
    the check also tells the derived formula from the normal-theory one. The spread of 400
    replicate sample variances estimates SE with relative error about 1/sqrt(800) = 3.5%.
    """
    d, n, reps = 4, 256, 400
    variances = np.array(
        [lab.dot_product_variance(d_ks=(d,), n_samples=n, seed=s).variance[0] for s in range(reps)]
    )
    derived = lab.dot_product_variance(d_ks=(d,), n_samples=n).variance_stderr[0]
    gaussian_only = d * math.sqrt(2 / (n - 1))
    observed = variances.std(ddof=1)
    assert abs(observed / derived - 1) < 0.15
    assert abs(observed / gaussian_only - 1) > 0.15
    assert abs(variances.mean() / d - 1) < 4 * derived / d / math.sqrt(reps)


# --------------------------------------------------------------------------------------
# 2. softmax saturation
# --------------------------------------------------------------------------------------


def test_softmax_saturation_theory(backend: Backend) -> None:
    r = lab.softmax_saturation(n_rows=64, backend=backend)
    p = r.probabilities
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=0, atol=1e-12)
    # The rows at each variance rescale one draw: the peak grows and the entropy falls,
    # row by row (p_max = 1 / Σ exp(β (z_j - z_max)), dH/dβ = -β Var_p(z)).
    assert np.all(np.diff(r.max_probability, axis=0) > 0)
    assert np.all(np.diff(r.entropy, axis=0) < 0)
    assert np.all(r.entropy <= math.log(r.n_positions) + 1e-12)
    # ||J||_F from the formed Jacobian equals the closed form Σp² - 2Σp³ + (Σp²)², and is
    # bounded by 2 (1 - Σp²) <= 4 (1 - p_max), which vanishes as p becomes one-hot.
    s2, s3 = (p**2).sum(-1), (p**3).sum(-1)
    np.testing.assert_allclose(r.jacobian_norm**2, s2 - 2 * s3 + s2**2, rtol=0, atol=1e-13)
    np.testing.assert_allclose(r.jacobian_bound, 2 * (1 - s2), rtol=0, atol=1e-13)
    assert np.all(r.jacobian_norm <= r.jacobian_bound + 1e-13)
    assert np.all(r.jacobian_bound <= 4 * (1 - r.max_probability) + 1e-13)
    # Once the mass concentrates (variance >= 10) the mean norm falls with the variance; at
    # variance 1 the 64 probabilities are all small, so the norm is small for that reason.
    mean_norm = r.jacobian_norm.mean(axis=1)
    assert np.all(np.diff(mean_norm[1:]) < 0), mean_norm
    assert mean_norm[0] < mean_norm[1]


@pytest.mark.parametrize(("n", "m"), [(64, 1), (64, 2), (64, 5), (64, 64), (3, 3)])
def test_softmax_jacobian_closed_form(backend: Backend, n: int, m: int) -> None:
    """Uniform over m of n positions: ||J||_F = sqrt(m - 1) / m (0 for one-hot)."""
    p = np.zeros(n)
    p[:m] = 1.0 / m
    jac = reference.to_numpy(lab.softmax_jacobian(backend.asarray(p, "float64")))
    assert jac.shape == (n, n)
    np.testing.assert_array_equal(jac, jac.T)
    np.testing.assert_allclose(jac.sum(0), 0.0, atol=1e-15)
    assert np.linalg.norm(jac) == pytest.approx(math.sqrt(m - 1) / m, rel=1e-12, abs=1e-15)


def test_softmax_jacobian_matches_finite_differences(backend: Backend) -> None:
    rng = np.random.default_rng(3)
    z = rng.standard_normal(6) * 2
    p = reference.to_numpy(lab.softmax(backend.asarray(z, "float64")))
    jac = reference.to_numpy(lab.softmax_jacobian(backend.asarray(p, "float64")))
    h = 1e-6
    numeric = np.stack(
        [(_softmax_rows(z + h * e) - _softmax_rows(z - h * e)) / (2 * h) for e in np.eye(6)],
        axis=1,
    )
    np.testing.assert_allclose(jac, numeric, rtol=0, atol=1e-9)


# --------------------------------------------------------------------------------------
# 3. gradient flow
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vjp", ["attention_vjp", "attention_vjp_from_derivation"])
@pytest.mark.parametrize("scale", [None, 1.0, 0.05])
def test_attention_vjp_matches_oracle(backend: Backend, scale: float | None, vjp: str) -> None:
    """The experiments' VJP (the library's) and the written-out derivation, vs the oracle."""
    rng = np.random.default_rng(4)
    shapes = {"q": (2, 5, 6), "k": (2, 7, 6), "v": (2, 7, 3), "do": (2, 5, 3)}
    data = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    args = [backend.asarray(data[name], "float64") for name in ("q", "k", "v", "do")]
    got = getattr(lab, vjp)(*args, scale=scale)
    want = reference.scaled_dot_product_attention_vjp(
        data["q"], data["k"], data["v"], data["do"], scale=scale
    )
    for g, w in zip(got, want, strict=True):
        g_np = reference.to_numpy(g)
        assert g_np.dtype == np.float64
        np.testing.assert_allclose(g_np, w, rtol=1e-10, atol=1e-12)


def test_gradient_flow_per_scale(backend: Backend) -> None:
    g = lab.gradient_flow(backend=backend)
    i_one, i_sqrt, i_lin = (g.scales.index(s) for s in ("1", "1/sqrt(E)", "1/E"))
    med = g.median
    # 1/sqrt(d_k): the typical row's gradient does not depend on d_k.
    assert med[i_sqrt].max() / med[i_sqrt].min() < 1.25, med[i_sqrt]
    # 1/d_k: it falls like d_k^(-1/2) (log-log slope between d_k = 16 and 1024).
    d = g.d_k.astype(float)
    lo, hi = list(g.d_k).index(16), len(d) - 1
    slope = math.log(med[i_lin, hi] / med[i_lin, lo]) / math.log(d[hi] / d[lo])
    assert -0.6 < slope < -0.4, slope
    # 1: saturation; from d_k = 64 on the typical gradient collapses, and at d_k = 1024 a
    # tenth of the rows get essentially nothing, while the weights approach one-hot.
    tail = med[i_one, list(g.d_k).index(64) :]
    assert np.all(np.diff(tail) < 0), tail
    assert med[i_one, -1] < 0.05 * med[i_sqrt, -1]
    assert g.quantile(0.1)[i_one, -1] < 1e-6
    assert g.max_weight[i_one, -1] > 0.9
    assert np.all(np.diff(g.max_weight[i_one]) > 0)
    # ... but the few nearly tied rows still get large gradients: the RMS does not vanish.
    assert g.rms[i_one, -1] > g.rms[i_sqrt, -1]


# --------------------------------------------------------------------------------------
# 4. dot-product versus additive attention
# --------------------------------------------------------------------------------------


def _additive_loop(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, w_q: np.ndarray, w_k: np.ndarray, v_a: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Additive attention pair by pair, as the formula reads."""
    *batch, n, _ = q.shape
    out = np.empty((*batch, n, v.shape[-1]))
    weights = np.empty((*batch, n, k.shape[-2]))
    for idx in np.ndindex(*batch):
        for i in range(n):
            scores = np.array(
                [v_a @ np.tanh(w_q @ q[idx][i] + w_k @ k[idx][j]) for j in range(k.shape[-2])]
            )
            weights[idx][i] = _softmax_rows(scores)
            out[idx][i] = weights[idx][i] @ v[idx]
    return out, weights


def test_additive_attention_matches_loop(backend: Backend) -> None:
    rng = np.random.default_rng(5)
    b, n, m, dq, dk, da, dv = 2, 3, 5, 4, 6, 7, 2
    data = [
        rng.standard_normal(s)
        for s in ((b, n, dq), (b, m, dk), (b, m, dv), (da, dq), (da, dk), (da,))
    ]
    out, weights = lab.additive_attention(
        *(backend.asarray(x, "float64") for x in data), return_weights=True
    )
    want_out, want_weights = _additive_loop(*data)
    np.testing.assert_allclose(reference.to_numpy(out), want_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(reference.to_numpy(weights), want_weights, rtol=1e-12, atol=1e-14)


class _Counted:
    """NumPy operations that tally their flops as they run: a product of ``(a, k)`` and
    ``(k, b)`` costs ``2 a k b``, an element-wise operation one per result element and a
    reduction one per element reduced (the convention of :mod:`sdpa_array.lab.cost`)."""

    def __init__(self) -> None:
        self.flops = 0

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = a @ b
        self.flops += 2 * out.size * a.shape[-1]
        return out

    def elementwise(self, fn, *args: np.ndarray) -> np.ndarray:
        out = fn(*args)
        self.flops += out.size
        return out

    def reduce(self, fn, a: np.ndarray) -> np.ndarray:
        self.flops += a.size
        return fn(a, axis=-1, keepdims=True)

    def softmax(self, s: np.ndarray) -> np.ndarray:
        top = self.reduce(np.max, s)
        e = self.elementwise(np.exp, self.elementwise(np.subtract, s, top))
        return self.elementwise(np.divide, e, self.reduce(np.sum, e))


@pytest.mark.parametrize(
    ("n", "m", "dq", "dk", "da", "dv"), [(128, 128, 64, 64, 64, 64), (3, 5, 2, 7, 11, 13)]
)
def test_flop_counts_are_those_of_the_computation(
    n: int, m: int, dq: int, dk: int, da: int, dv: int
) -> None:
    """The lab's flop counts equal the flops tallied while computing each attention step by
    step (and the step-by-step results equal the lab's and the oracle's)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape) for shape in ((n, dk), (m, dk), (m, dv)))
    dot = _Counted()
    scores = dot.elementwise(np.multiply, dot.matmul(q, k.T), np.full((n, m), dk**-0.5))
    out = dot.matmul(dot.softmax(scores), v)
    assert dot.flops == lab.dot_product_attention_flops(n, m, dk, dv).total
    np.testing.assert_allclose(out, reference.scaled_dot_product_attention(q, k, v))

    q, k = rng.standard_normal((n, dq)), rng.standard_normal((m, dk))
    w, u, v_a = (rng.standard_normal(shape) for shape in ((da, dq), (da, dk), (da,)))
    for once in (True, False):
        add = _Counted()
        if once:
            hidden = add.elementwise(
                np.add, add.matmul(q, w.T)[:, None, :], add.matmul(k, u.T)[None, :, :]
            )
        else:  # W q_i and U k_j again for every pair
            pairs_q = np.broadcast_to(q[:, None, None, :], (n, m, 1, dq))
            pairs_k = np.broadcast_to(k[None, :, None, :], (n, m, 1, dk))
            hidden = add.elementwise(
                np.add, add.matmul(pairs_q, w.T)[..., 0, :], add.matmul(pairs_k, u.T)[..., 0, :]
            )
        scores = add.matmul(add.elementwise(np.tanh, hidden), v_a[:, None])[..., 0]
        out = add.matmul(add.softmax(scores), v)
        counted = lab.additive_attention_flops(n, m, dq, dk, da, dv, project_once=once)
        assert add.flops == counted.total, (once, add.flops, counted.terms)
        np.testing.assert_allclose(out, lab.additive_attention(q, k, v, w, u, v_a), rtol=1e-10)


def test_flop_orders() -> None:
    """Projected once, additive attention is O(n² d) like dot-product attention."""
    d = 64
    ratios = [
        lab.additive_attention_flops(n, n, d, d, d, d).total
        / lab.dot_product_attention_flops(n, n, d, d).total
        for n in (256, 1024, 4096, 16384)
    ]
    limit = (4 * d + 5 + 2 * d) / (2 * d + 6 + 2 * d)  # pairwise terms only
    assert abs(ratios[-1] - limit) < 0.02
    assert np.all(np.diff(ratios) < 0)
    naive = [
        lab.additive_attention_flops(256, 256, d, d, d, d, project_once=False).total
        / lab.dot_product_attention_flops(256, 256, d, d).total
        for d in (16, 64, 256)
    ]
    assert naive[1] / naive[0] > 3  # grows like d
    assert naive[2] / naive[1] > 3.5


def test_attention_cost_runs(backend: Backend) -> None:
    c = lab.attention_cost(dims=(8, 16), n=16, backend=backend, repeats=1)
    assert c.backend == backend.id
    assert np.all(np.isfinite(c.dot_seconds) & (c.dot_seconds > 0))
    assert np.all(np.isfinite(c.additive_seconds) & (c.additive_seconds > 0))
    for i, d in enumerate(c.dims):
        assert c.dot_flops[i] == lab.dot_product_attention_flops(16, 16, d, d).total
        assert c.additive_flops[i] == lab.additive_attention_flops(16, 16, d, d, d, d).total


# --------------------------------------------------------------------------------------
# 5. query/key asymmetry
# --------------------------------------------------------------------------------------


def test_query_key_asymmetry(backend: Backend) -> None:
    r = lab.query_key_asymmetry(backend=backend)
    np.testing.assert_allclose(r.weights.sum(1), 1.0, atol=1e-12)
    np.testing.assert_allclose(r.swapped_weights.sum(1), 1.0, atol=1e-12)
    np.testing.assert_allclose(r.swapped_weights, _softmax_rows(r.scores.T), atol=1e-12)
    assert r.max_swap_difference > 0.05
    assert np.ptp(r.received) > 0.2  # keys receive unequal totals
    # Rows of dS sum to 0, columns do not; so Σ_j dK_j = 0 while Σ_i dQ_i is not.
    np.testing.assert_allclose(r.grad_scores.sum(1), 0.0, atol=1e-12)
    assert np.abs(r.grad_scores.sum(0)).max() > 0.1
    np.testing.assert_allclose(r.grad_key_sum, 0.0, atol=1e-12)
    assert np.linalg.norm(r.grad_query_sum) > 0.1
    # Same data, different structure: the two gradients are different matrices.
    assert np.abs(r.grad_query - r.grad_key).max() > 0.1


# --------------------------------------------------------------------------------------
# 6. the worked example
# --------------------------------------------------------------------------------------


def _exact_example() -> tuple[np.ndarray, np.ndarray]:
    """Weights and output of the note's example from the closed form, in Python floats."""
    scores = [[17, 23, 29], [39, 53, 67]]
    weights = []
    for row in scores:
        e = [math.exp((s - max(row)) / math.sqrt(2)) for s in row]
        weights.append([x / math.fsum(e) for x in e])
    w = np.array(weights)
    v = np.array(lab.EXAMPLE_VALUE)
    return w, np.array(
        [[math.fsum(w[i, j] * v[j, c] for j in range(3)) for c in range(3)] for i in range(2)]
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_worked_example_exact(backend: Backend, dtype: str) -> None:
    ex = lab.worked_example(backend=backend, dtype=dtype)
    weights, output = _exact_example()
    np.testing.assert_array_equal(ex.scores, [[17, 23, 29], [39, 53, 67]])
    np.testing.assert_allclose(ex.scaled, ex.scores / math.sqrt(2), rtol=1e-6)
    np.testing.assert_allclose(ex.weights, weights, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ex.output, output, rtol=0, atol=1e-6)


def test_worked_example_published_discrepancies(backend: Backend) -> None:
    ex = lab.worked_example(backend=backend)
    wrong = {(f.matrix, f.index) for f in ex.discrepancies}
    assert wrong == {
        ("weights", (0, 0)),  # 2.06e-4, exact 2.035e-4
        ("weights", (0, 1)),  # 0.016, exact 0.01416
        ("weights", (0, 2)),  # 0.984, exact 0.98563
        ("weights", (1, 0)),  # 1.67e-9, exact 2.520e-9
        ("output", (0, 0)),  # 0.984, exact 0.98584
        ("output", (1, 1)),  # 0.9999, exact 0.9999999975
        ("output", (1, 2)),  # 0.0001, exact 2.5e-9
    }
    assert len(ex.published) == 18
    by_key = {(f.matrix, f.index): f for f in ex.published}
    assert by_key["weights", (0, 0)].half_unit == pytest.approx(5e-7)
    assert by_key["weights", (0, 0)].correctly_rounded == "2.04e-04"
    assert by_key["output", (0, 1)].half_unit == pytest.approx(5e-4)
    assert by_key["output", (0, 1)].correctly_rounded == "1.000"
    assert by_key["output", (1, 1)].correctly_rounded == "1.0000"
    assert by_key["weights", (1, 1)].consistent  # 0.0001 for 5.02e-5: rounds up, fine


# --------------------------------------------------------------------------------------
# attention patterns
# --------------------------------------------------------------------------------------


def test_attention_patterns(backend: Backend) -> None:
    panels = lab.attention_patterns(backend=backend)
    i8, j8 = np.ogrid[:8, :8]
    i4, j4 = np.ogrid[:4, :8]
    expected = [
        j8 <= i8,  # causal
        j4 <= i4,  # top_left: query i's diagonal is key i
        j4 <= i4 + 4,  # bottom_right: key i + S - L
        (i8 - 2 <= j8) & (j8 <= i8 + 1),  # window (2, 1)
        (i8 - 2 <= j8) & (j8 <= i8),  # causal sliding window (2, 0)
        np.broadcast_to(j8 < 5, (8, 8)),  # padding
    ]
    for panel, allowed in zip(panels[:6], expected, strict=True):
        np.testing.assert_array_equal(panel.weights > 0, allowed, err_msg=panel.title)
        np.testing.assert_allclose(panel.weights.sum(-1), 1.0, atol=1e-12)
    gqa = panels[6].weights
    assert gqa.shape == (4, 8, 8)
    np.testing.assert_array_equal(gqa[0], gqa[1])
    np.testing.assert_array_equal(gqa[2], gqa[3])
    assert np.abs(gqa[0] - gqa[2]).max() > 0.1
