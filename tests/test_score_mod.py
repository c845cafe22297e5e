"""Score functions (``score_mod``) in attention and its VJP.

* the ready-made score functions of :mod:`sdpa_array.mods` and one of the caller's with its
  derivative (:func:`sdpa_array.mods.score_function`), with softcap, causal, GQA, bias,
  sinks, lengths and dropout, on every path (:mod:`tests.paths`) against the oracle;
* the oracle against the textbook: ``tanh_softcap(c)`` is ``softcap=c``, ``temperature``
  divides each head's scores, a score function is applied before the softcap; its VJP
  against central differences of its forward;
* torch's and JAX's autodiff of a score function without a derivative (torch autograd,
  ``torch.func.grad``, double backward; ``jax.grad`` under ``jax.jit``) against the oracle;
* the blocked kernel calls the function per tile (never on the whole score grid);
* errors: not callable, wrong dtype or shape, a derivative of the wrong shape, no derivative
  for a gradient on a library without autodiff; the native and Triton kernels refuse it.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array import mods, reference
from sdpa_array._arrays.compat import array_namespace
from sdpa_array.testing import assert_close_to_oracle, assert_vjp_close_to_oracle
from tests.helpers import KV, Q_GQA, Q, assert_within, vjp_oracle_and_bounds
from tests.paths import FeatureCase, check_on_path, random_normal

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")


def _head_scaled(s, b, h, i, j):
    """A score function of the score and every index: each head's scores scaled, minus a
    distance penalty (exact in every dtype but the two roundings of ``*`` and ``-``)."""
    xp = array_namespace({"s": s})
    gain = 1.0 + 0.25 * xp.astype(h, s.dtype) + 0.125 * xp.astype(b, s.dtype)
    return s * gain - 0.125 * xp.astype(xp.abs(i - j), s.dtype)


def _head_scaled_slope(s, b, h, i, j):
    xp = array_namespace({"s": s})
    return 1.0 + 0.25 * xp.astype(h, s.dtype) + 0.125 * xp.astype(b, s.dtype)


def _squash(s, b, h, i, j):
    """A non-linear score function written with the scores' library only."""
    xp = array_namespace({"s": s})
    return 2.0 * xp.tanh(s / 2.0) + 0.5 * s


def _squash_slope(s, b, h, i, j):
    xp = array_namespace({"s": s})
    t = xp.tanh(s / 2.0)
    return 1.5 - t * t


HEAD_SCALED = mods.score_function(_head_scaled, _head_scaled_slope)
SQUASH = mods.score_function(_squash, _squash_slope)

#: Every score function with every option it combines with, on every path.
PATH_CASES = [
    FeatureCase("tanh-softcap", Q, KV, KV, {"score_mod": mods.tanh_softcap(1.5)}),
    FeatureCase(
        "temperature+causal+gqa",
        Q_GQA,
        KV,
        KV,
        {
            "score_mod": mods.temperature(np.array([0.5, 1.0, 2.0, 4.0])),
            "is_causal": True,
            "alignment": "bottom_right",
            "enable_gqa": True,
        },
    ),
    FeatureCase(
        "head-scaled+softcap+bias",
        Q,
        KV,
        KV,
        {"score_mod": HEAD_SCALED, "softcap": 2.5, "bias": random_normal(2, 1, 6, 7, seed=3)},
    ),
    FeatureCase(
        "squash+sinks+lengths",
        Q,
        KV,
        KV,
        {
            "score_mod": SQUASH,
            "sinks": random_normal(2, seed=4),
            "key_lengths": np.array([7, 3]),
            "query_lengths": np.array([6, 4]),
        },
    ),
    FeatureCase(
        "squash+dropout+window",
        Q,
        KV,
        KV,
        {"score_mod": SQUASH, "dropout_p": 0.25, "dropout_seed": 7, "window": (2, 1)},
    ),
]


def test_on_every_path(path_case):
    """Output, log-sum-exp, maximum scores and gradients on every path against the oracle
    given the same score function."""
    check_on_path(path_case)


def _arrays(seed=0, shape_q=(2, 3, 5, 4), shape_k=(2, 3, 6, 4)):
    rng = np.random.default_rng(seed)
    q, g = rng.standard_normal(shape_q), rng.standard_normal((*shape_q[:-1], 4))
    k, v = rng.standard_normal(shape_k), rng.standard_normal((*shape_k[:-1], 4))
    return q, k, v, g


def test_oracle_textbook():
    """The oracle: ``tanh_softcap(c)`` is ``softcap=c``; ``temperature`` divides each
    head's scaled scores; a score function runs after the scale and before the softcap
    and the bias; the maximum scores are taken before it."""
    q, k, v, _ = _arrays()
    bias = random_normal(2, 3, 5, 6, seed=1)
    capped = reference.scaled_dot_product_attention(q, k, v, softcap=1.5, bias=bias)
    modded = reference.scaled_dot_product_attention(
        q, k, v, score_mod=mods.tanh_softcap(1.5), bias=bias
    )
    np.testing.assert_allclose(modded, capped, rtol=1e-14, atol=1e-14)

    t = np.array([0.5, 2.0, 3.0])
    scores = (q @ np.swapaxes(k, -1, -2)) * 0.5 / t[:, None, None]
    scores = 3.0 * np.tanh(scores / 3.0) + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out, best = reference.scaled_dot_product_attention(
        q, k, v, score_mod=mods.temperature(t), softcap=3.0, bias=bias, return_max_scores=True
    )
    np.testing.assert_allclose(out, weights @ v, rtol=1e-13, atol=1e-14)
    expected = np.max((q @ np.swapaxes(k, -1, -2)) * 0.5, axis=(-2, -1))
    np.testing.assert_allclose(best, expected, rtol=1e-14)


def test_oracle_vjp_matches_central_differences():
    """The oracle's VJP through a score function (its ``derivative``) against central
    differences of the oracle's forward, entry by entry of the query and key."""
    q, k, v, g = _arrays(seed=2, shape_q=(1, 2, 3, 4), shape_k=(1, 2, 4, 4))
    options = {"score_mod": SQUASH, "softcap": 2.0, "is_causal": True}
    dq, dk, _ = reference.scaled_dot_product_attention_vjp(q, k, v, g, **options)

    def loss(q_, k_):
        return float(np.sum(reference.scaled_dot_product_attention(q_, k_, v, **options) * g))

    h = 1e-6
    for x, dx, which in ((q, dq, 0), (k, dk, 1)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            args_plus = (plus, k) if which == 0 else (q, plus)
            args_minus = (minus, k) if which == 0 else (q, minus)
            numeric[idx] = (loss(*args_plus) - loss(*args_minus)) / (2 * h)
        # central differences of a smooth function: error O(h²) plus rounding ~1e-16 / h
        np.testing.assert_allclose(dx, numeric, rtol=0, atol=1e-8)


def test_blocked_calls_it_per_tile(host_backend):
    """The blocked kernel evaluates the score function on tiles, never on the whole
    ``(L, S)`` grid of a batch element."""
    q, k, v, _ = _arrays(shape_q=(1, 1, 40, 4), shape_k=(1, 1, 48, 4))
    seen = []

    def spy(s, b, h, i, j):
        seen.append(tuple(s.shape[-2:]))
        return _squash(s, b, h, i, j)

    spied = mods.score_function(spy, _squash_slope)
    arrays = [host_backend.asarray(a, "float32") for a in (q, k, v)]
    out = sdpa_array.scaled_dot_product_attention(
        *arrays, score_mod=spied, implementation="blocked", block_q=16, block_k=16
    )
    calls = [shape for shape in seen if shape != (1, 1)]  # (1, 1): the validation's probe
    assert calls
    assert all(r <= 16 and c <= 16 for r, c in calls), calls
    assert_close_to_oracle(out, *arrays, score_mod=SQUASH)


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_autodiff_without_derivative(autograd_backend_dtype, implementation):
    """torch autograd and ``jax.grad`` differentiate a score function that has no
    derivative method: torch's and JAX's forward-mode autodiff give it to the blocked
    backward kernel, and they differentiate the materialized path themselves."""
    backend, dtype = autograd_backend_dtype
    q, k, v, g = (backend.asarray(a, dtype) for a in _arrays(seed=5))
    run = {"score_mod": _squash, "softcap": 3.0, "implementation": implementation}
    if backend.library == "torch":
        import torch

        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = sdpa_array.scaled_dot_product_attention(*xs, **run)
        grads = torch.autograd.grad(out, xs, g)
    else:
        import jax

        def loss(*xs):
            return jax.numpy.sum(sdpa_array.scaled_dot_product_attention(*xs, **run) * g)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert_vjp_close_to_oracle(tuple(grads), q, k, v, g, score_mod=SQUASH, softcap=3.0)


def test_torch_func_and_double_backward(torch_cpu_backend):
    """``torch.func.grad`` through the blocked kernel with a score function without a
    derivative, and double backward: the gradient of the gradient equals that of the
    materialized path, which torch differentiates end to end."""
    import torch

    q, k, v, g = (torch.tensor(a) for a in _arrays(seed=6))
    run = {"score_mod": _squash, "block_q": 2, "block_k": 4}

    def loss(q_, implementation):
        options = dict(run) if implementation == "blocked" else {"score_mod": _squash}
        out = sdpa_array.scaled_dot_product_attention(
            q_, k, v, implementation=implementation, **options
        )
        return torch.sum(out * g)

    first = torch.func.grad(lambda q_: loss(q_, "blocked"))(q)
    dq = sdpa_array.scaled_dot_product_attention_vjp(
        q.numpy(), k.numpy(), v.numpy(), g.numpy(), score_mod=SQUASH
    )[0]
    np.testing.assert_allclose(first.numpy(), dq, rtol=0, atol=1e-12)
    second = {
        impl: torch.func.grad(lambda q_, impl=impl: torch.sum(torch.func.grad(
            lambda x: loss(x, impl))(q_) ** 2))(q)
        for impl in ("blocked", "materialized")
    }  # fmt: skip
    np.testing.assert_allclose(second["blocked"], second["materialized"], rtol=1e-10, atol=1e-12)


def test_dask_is_lazy(dask_backend):
    """On Dask the call stays lazy, and computes what the oracle does."""
    q, k, v, g = (dask_backend.asarray(a, "float64") for a in _arrays(seed=7))
    out = sdpa_array.scaled_dot_product_attention(q, k, v, score_mod=HEAD_SCALED)
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, score_mod=HEAD_SCALED)
    assert all(hasattr(x, "dask") for x in (out, *grads))
    assert_close_to_oracle(out, q, k, v, score_mod=HEAD_SCALED)
    assert_vjp_close_to_oracle(tuple(grads), q, k, v, g, score_mod=HEAD_SCALED)


def _wrong_dtype(s, b, h, i, j):
    return i - j


def _wrong_shape(s, b, h, i, j):
    xp = array_namespace({"s": s})
    return xp.zeros((3, 1, 1, 1, 1), dtype=s.dtype)


def _first_column(s, b, h, i, j):
    """Not element by element: each row's first score, broadcast (it would depend on the
    tiles' size)."""
    return s[..., :1]


@pytest.mark.parametrize(
    ("score_mod", "error", "match"),
    [
        pytest.param(3.0, TypeError, "score_mod must be a callable", id="not-callable"),
        pytest.param(_wrong_dtype, TypeError, "score_mod .* real floating", id="integers"),
        pytest.param(_wrong_shape, ValueError, r"score_mod .* not the shape", id="shape"),
        pytest.param(
            _first_column,
            ValueError,
            r"score_mod .* returned shape \(1, 1, 2, 1\), not the shape \(1, 1, 2, 2\)",
            id="not-element-wise",
        ),
        pytest.param(
            mods.score_function(_squash, _wrong_shape),
            ValueError,
            "score_mod.derivative .* does not broadcast",
            id="derivative-shape",
        ),
        pytest.param(
            mods.score_function(_squash, _wrong_dtype),
            TypeError,
            "score_mod.derivative .* real floating",
            id="derivative-integers",
        ),
    ],
)
def test_bad_score_mod_is_named(backend, score_mod, error, match):
    """A bad score function (or derivative) fails before any work, naming it."""
    q, k, v, _ = (backend.asarray(a, "float32") for a in _arrays())
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention(q, k, v, score_mod=score_mod)


def test_gradient_without_derivative_is_refused():
    """NumPy has no autodiff: the VJP of a score function without a derivative is a
    ``TypeError`` that says how to give one; the forward works."""
    q, k, v, g = _arrays()
    sdpa_array.scaled_dot_product_attention(q, k, v, score_mod=_squash)
    with pytest.raises(TypeError, match=r"no derivative.*mods\.score_function"):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, score_mod=_squash)
    with pytest.raises(TypeError, match="needs score_mod's derivative"):
        reference.scaled_dot_product_attention_vjp(q, k, v, g, score_mod=_squash)


def test_native_refuses(torch_cpu_backend):
    """torch's kernels do not apply a score function: ``"native"`` refuses before any
    work, naming it; ``"auto"`` runs a generic kernel."""
    q, k, v, _ = (torch_cpu_backend.asarray(a, "float32") for a in _arrays())
    with pytest.raises(sdpa_array.CannotDelegateError, match="score_mod"):
        sdpa_array.scaled_dot_product_attention(q, k, v, score_mod=SQUASH, implementation="native")
    explained = sdpa_array.explain(q, k, v, score_mod=SQUASH)
    assert explained.forward != "native"


@pytest.mark.parametrize(
    ("factory", "argument", "match"),
    [
        (mods.tanh_softcap, 0.0, "cap must be a positive finite number"),
        (mods.tanh_softcap, float("inf"), "cap must be a positive finite number"),
        (mods.temperature, [[1.0]], "values must be 1-D"),
        (mods.temperature, np.array([1, 2]), "values must have a real floating dtype"),
    ],
)
def test_factories_check_arguments(factory, argument, match):
    with pytest.raises((TypeError, ValueError), match=match):
        factory(argument)


def test_score_function_checks_callables():
    with pytest.raises(TypeError, match="derivative must be callable"):
        mods.score_function(_squash, 1.0)
    assert repr(mods.tanh_softcap(2.0)) == "tanh_softcap(2.0)"
    assert "_squash" in repr(SQUASH)


def test_traced_data_in_mods_under_jax_grad(jax_backend):
    """Mods closing over arrays traced under ``jax.jit`` (a temperature and ALiBi slopes
    being trained): the ready-made ones declare them as parameters, so every path
    differentiates them (the blocked kernel's ``jax.custom_vjp`` takes them as inputs)
    against the oracle. A function of the caller's closing over a tracer, with nothing
    declared: its tracer is hoisted out (``jax.closure_convert``) and becomes an input of
    the blocked kernel's ``jax.custom_vjp`` too, on ``"auto"`` and ``"blocked"``; the
    gradients of q, k, v and of the tracer against the oracle (``s * 0.5`` is
    ``temperature(2)`` on every head, whose gradient is ``-4`` times that of ``0.5``)."""
    import jax
    import jax.numpy as jnp

    q, k, v, g = (jax_backend.asarray(a, "float32") for a in _arrays(seed=8))
    t, slopes = jnp.asarray([1.5, 1.25, 2.0]), jnp.asarray([0.5, 0.25, 1.0])

    def gradients(implementation, **blocks):
        @jax.jit
        def loss(q, k, v, t, slopes):
            out = sdpa_array.scaled_dot_product_attention(
                q, k, v, implementation=implementation, **blocks,
                score_mod=mods.temperature(t), bias_mod=mods.alibi(slopes),
            )  # fmt: skip
            return jnp.sum(out * g)

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, t, slopes)

    options = {"score_mod": mods.temperature(t), "bias_mod": mods.alibi(slopes)}
    # with block sizes "auto" runs the blocked kernel
    for run in ({"implementation": "auto", "block_q": 2}, {"implementation": "blocked"}):
        got = gradients(**run)
        assert_vjp_close_to_oracle(got, q, k, v, g, **options, return_mod_gradients=True)

    def own_gradients(implementation, **blocks):
        def loss(q, k, v, w):
            score_mod = mods.score_function(lambda s, b, h, i, j: s * w, lambda *_: w)
            out = sdpa_array.scaled_dot_product_attention(
                q, k, v, implementation=implementation, score_mod=score_mod, **blocks
            )
            return jnp.sum(out * g)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, jnp.asarray(0.5))

    arrays64 = [np.asarray(a, dtype=np.float64) for a in (q, k, v, g)]
    expected, bounds = vjp_oracle_and_bounds(
        "float32", *arrays64, score_mod=mods.temperature(np.full(3, 2.0)),
        return_mod_gradients=True,
    )  # fmt: skip
    # d / dw of s * w at w = 1/2 is -4 times the sum over the heads of d / dt of s / t at 2
    d_w, bound_w = -4.0 * np.sum(expected[3]), 4.0 * np.sum(bounds[3])
    bound_w += 8 * 2.0**-24 * 4.0 * np.sum(np.abs(expected[3]))  # the sum's roundings
    for run in ({"implementation": "auto", "block_q": 2}, {"implementation": "blocked"}):
        got = own_gradients(**run)
        for name, x, e, b in zip(("dq", "dk", "dv"), got, expected, bounds, strict=False):
            assert_within(x, e, b, f"{name} {run}")
        assert abs(float(got[3]) - d_w) <= bound_w, (run, float(got[3]), d_w, bound_w)


def _oracle_temperature_gradient(q, k, v, g, t):
    """``d sum(out * g) / d t`` for ``score_mod=temperature(t)``, from the oracle's own
    float64 intermediates: ``dZ = P * (dP - rowsum(P * dP))`` with ``dP = g Vᵀ``, and
    ``d(raw / t_h) / d t_h = -raw / t_h²``, summed over each head's scores. Also the bound
    of a float64 computation of it: ``(n + 10) u`` times the sum of the magnitudes of its
    ``n`` terms per head."""
    fwd = reference.intermediates(q, k, v, score_mod=mods.temperature(t))
    P, raw = fwd["weights"], fwd["raw"]
    dP = g @ np.swapaxes(fwd["v_rep"], -1, -2)
    dZ = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    terms = dZ * (-raw / t[:, None, None] ** 2)
    expected = np.sum(terms, axis=(0, 2, 3))
    n = terms.size // t.size
    bound = (n + 10) * 2.0**-53 * np.sum(np.abs(terms), axis=(0, 2, 3))
    return expected, bound


def test_captured_temperature_gets_its_gradient(autograd_backend):
    """A temperature the score function captures, trainable (a torch tensor that requires
    grad, a JAX array differentiated with ``jax.grad``), gets its gradient on every path:
    the library's autodiff differentiates the materialized one, and the blocked kernel's
    autograd wrapper takes the temperatures ``mods.temperature`` declares as inputs. Against
    the oracle's own derivation in float64."""
    q, k, v, g = _arrays(seed=9)
    t = np.array([0.5, 2.0, 1.25])
    expected, bound = _oracle_temperature_gradient(q, k, v, g, t)
    arrays = [autograd_backend.asarray(a, "float64") for a in (q, k, v, g)]
    runs = (
        {"implementation": "materialized"},
        {"implementation": "auto", "block_q": 2},
        {"implementation": "blocked", "block_q": 2},
    )
    for run in runs:
        if autograd_backend.library == "torch":
            import torch

            xs = [x.clone().requires_grad_(True) for x in arrays[:3]]
            values = torch.tensor(t, requires_grad=True)
            out = sdpa_array.scaled_dot_product_attention(
                *xs, score_mod=mods.temperature(values), **run
            )
            out.backward(arrays[3])
            got = values.grad.numpy()
        else:
            import jax
            import jax.numpy as jnp

            def loss(values, run=run):
                out = sdpa_array.scaled_dot_product_attention(
                    *arrays[:3], score_mod=mods.temperature(values), **run
                )
                return jnp.sum(out * arrays[3])

            got = np.asarray(jax.grad(loss)(jnp.asarray(t)))
        assert np.all(np.abs(got - expected) <= bound), (run, got, expected, bound)
    if autograd_backend.library == "torch":
        # a function of the caller's closing over the tensor declares nothing: the blocked
        # kernel's wrapper takes the tensor as an input all the same
        import torch

        xs = [x.clone().requires_grad_(True) for x in arrays[:3]]
        w = torch.tensor(t, requires_grad=True)
        own = mods.score_function(
            lambda s, b, h, i, j: s / w[h], lambda s, b, h, i, j: 1.0 / w[h] + 0.0 * s
        )
        out = sdpa_array.scaled_dot_product_attention(
            *xs, score_mod=own, implementation="blocked", block_q=2
        )
        out.backward(arrays[3])
        got = w.grad.numpy()
        assert np.all(np.abs(got - expected) <= bound), (got, expected, bound)
