"""Trainable data of bias and score functions: ALiBi's slopes, T5's relative position
table, a temperature per head, and a temperature beside ALiBi's slopes.

* ``scaled_dot_product_attention_vjp(return_mod_gradients=True)`` on every backend, dtype
  and generic path (materialized, blocked with small tiles) against the oracle, with
  causal attention, GQA, a window, softcap and lengths, within the derived bounds
  (:func:`sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds`);
* the oracle's derivation (a bias function's Jacobian formed column by column, a score
  function's from its ``parameter_derivatives``) against central differences of its own
  forward;
* torch autograd and ``jax.grad`` (eager and under ``jax.jit``) give a trainable table its
  gradient on every path: through the autograd wrappers of the blocked kernel (which take
  the table as an input) and through the library's autodiff of the materialized one; a
  table captured by a function of the caller's (no declared parameters) gets its gradient
  (on the blocked path too: tests/test_autograd.py);
* the sums by head and bucket in blocks of rows equal the sums in one block;
* bad input: no trainable function, a bias or score function without parameters,
  parameters of another library, a flag that is not a bool.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import sdpa_array
from sdpa_array import mods, reference
from sdpa_array._arrays.compat import array_namespace
from sdpa_array._problem import mod_parameters
from sdpa_array.testing import assert_vjp_close_to_oracle

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

B, H, L, S, E = 2, 4, 9, 11, 4
BUCKETS, MAX_DISTANCE = 8, 6


def _arrays(seed: int = 0, heads_kv: int = H) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, g = rng.standard_normal((B, H, L, E)), rng.standard_normal((B, H, L, E))
    k, v = rng.standard_normal((B, heads_kv, S, E)), rng.standard_normal((B, heads_kv, S, E))
    return q, k, v, g


def _mod(kind: str, parameter: object) -> object:
    if kind == "alibi":
        return mods.alibi(parameter)
    if kind == "temperature":
        return mods.temperature(parameter)
    return mods.relative_position_bias(parameter, num_buckets=BUCKETS, max_distance=MAX_DISTANCE)


def _parameter(kind: str) -> np.ndarray:
    if kind == "alibi":
        return mods.alibi_slopes(H) * 8.0  # slopes that matter over a few positions
    if kind == "temperature":
        return np.array([0.5, 0.8, 1.25, 2.0])
    return np.random.default_rng(9).standard_normal((H, BUCKETS))


#: Each case's trainable functions, by keyword: a bias function's table, a score function's
#: temperatures, and both together (score_mod's gradients come first).
KINDS = {
    "alibi": {"bias_mod": "alibi"},
    "t5": {"bias_mod": "t5"},
    "temperature": {"score_mod": "temperature"},
    "temperature+alibi": {"score_mod": "temperature", "bias_mod": "alibi"},
}


def _parameters(kind: str) -> list[np.ndarray]:
    """The case's parameters, in the order of their gradients."""
    return [_parameter(KINDS[kind][n]) for n in ("score_mod", "bias_mod") if n in KINDS[kind]]


def _options(kind: str, *parameters: object) -> dict[str, object]:
    """The keywords holding the case's functions with ``parameters`` (as
    :func:`_parameters` orders them)."""
    names = [n for n in ("score_mod", "bias_mod") if n in KINDS[kind]]
    return {n: _mod(KINDS[kind][n], a) for n, a in zip(names, parameters, strict=True)}


#: (id, options): the options the tables combine with.
CASES = [
    ("causal", {"is_causal": True}),
    ("gqa-bottom-right", {"is_causal": True, "alignment": "bottom_right", "enable_gqa": True}),
    ("window-softcap", {"window": (3, 2), "softcap": 2.0}),
    ("lengths", {"query_lengths": np.array([9, 4]), "key_lengths": np.array([11, 5])}),
]
PATHS = {"materialized": {}, "blocked": {"block_q": 4, "block_k": 4}}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("case", "options"), CASES, ids=[c[0] for c in CASES])
def test_vjp_returns_the_table_gradient(backend_dtype, path, kind, case, options):
    backend, dtype = backend_dtype
    heads_kv = 2 if options.get("enable_gqa") else H
    q, k, v, g = (backend.asarray(a, dtype) for a in _arrays(heads_kv=heads_kv))
    # a table in float32 beside 16-bit inputs (NumPy, which the oracle reads it with,
    # has no bfloat16)
    table_dtype = "float64" if dtype == "float64" else "float32"
    params = [backend.asarray(a, table_dtype) for a in _parameters(kind)]
    kw = {**options, **_options(kind, *params), "return_mod_gradients": True}
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, v, g, implementation=path, **PATHS[path], **kw
    )
    assert len(grads) == 3 + len(params)
    assert_vjp_close_to_oracle(grads, q, k, v, g, **kw)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_oracle_matches_central_differences(kind):
    """The oracle's parameter gradients (a bias function's Jacobian formed exactly, a
    score function's from its own derivatives) against central differences of the
    oracle's forward."""
    q, k, v, g = _arrays(seed=3)
    params = _parameters(kind)
    options = {"is_causal": True, "softcap": 3.0}
    grads = reference.scaled_dot_product_attention_vjp(
        q, k, v, g, **_options(kind, *params), return_mod_gradients=True, **options
    )
    assert len(grads) == 3 + len(params)

    def loss(ps: list[np.ndarray]) -> float:
        out = reference.scaled_dot_product_attention(q, k, v, **_options(kind, *ps), **options)
        return float(np.sum(out * g))

    h = 1e-6
    for i, (param, d_param) in enumerate(zip(params, grads[3:], strict=True)):
        numeric = np.zeros_like(param)
        for index in np.ndindex(param.shape):
            plus, minus = [p.copy() for p in params], [p.copy() for p in params]
            plus[i][index] += h
            minus[i][index] -= h
            numeric[index] = (loss(plus) - loss(minus)) / (2 * h)
        # central differences of a smooth function: error O(h²) plus rounding ~1e-15 / h
        np.testing.assert_allclose(d_param, numeric, rtol=0, atol=1e-7)
        assert np.abs(d_param).max() > 1e-2  # the tables matter here


@pytest.mark.parametrize("implementation", ["auto", "materialized", "blocked"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_torch_autograd_gives_the_table_its_gradient(torch_backend, kind, implementation):
    import torch

    q, k, v, g = (torch_backend.asarray(a, "float64") for a in _arrays(seed=1))
    for inputs_need_grad in (True, False):
        leaves = [x.detach().requires_grad_(inputs_need_grad) for x in (q, k, v)]
        params = [
            torch_backend.asarray(a, "float64").requires_grad_(True) for a in _parameters(kind)
        ]
        kw = {**_options(kind, *params), "is_causal": True}
        out = sdpa_array.scaled_dot_product_attention(*leaves, implementation=implementation, **kw)
        (out * g).sum().backward()
        if inputs_need_grad:
            grads = (*(x.grad for x in leaves), *(a.grad for a in params))
            assert_vjp_close_to_oracle(grads, q, k, v, g, **kw, return_mod_gradients=True)
        else:
            expected = sdpa_array.scaled_dot_product_attention_vjp(
                q, k, v, g, **kw, return_mod_gradients=True
            )[3:]
            for a, e in zip(params, expected, strict=True):
                torch.testing.assert_close(a.grad, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize("implementation", ["auto", "materialized", "blocked"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_jax_grad_gives_the_table_its_gradient(jax_backend, kind, implementation):
    import jax

    q, k, v, g = (jax_backend.asarray(a, "float64") for a in _arrays(seed=1))
    params = tuple(jax_backend.asarray(a, "float64") for a in _parameters(kind))

    def loss(q, k, v, params):
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, **_options(kind, *params), is_causal=True, implementation=implementation
        )
        return (out * g).sum()

    options = {**_options(kind, *params), "is_causal": True, "return_mod_gradients": True}
    for grad in (jax.grad(loss, argnums=(0, 1, 2, 3)), jax.jit(jax.grad(loss, (0, 1, 2, 3)))):
        dq, dk, dv, dparams = grad(q, k, v, params)
        assert_vjp_close_to_oracle((dq, dk, dv, *dparams), q, k, v, g, **options)


def test_torch_func_vmap_of_grad_over_temperatures(torch_backend):
    """``torch.func.vmap(torch.func.grad(loss))`` over a batch of temperatures, through the
    blocked kernel's autograd wrapper (its forward runs the function on the tensors it is
    given, which functorch wraps per level): each row equals the gradient of that row
    alone. ``hessian`` (forward mode over the wrapper) fails loudly."""
    import torch

    q, k, v, g = (torch_backend.asarray(a, "float64") for a in _arrays(seed=12))
    temperatures = torch_backend.asarray(np.array([[0.5, 0.8, 1.25, 2.0], [1.0] * 4]), "float64")

    def loss(t):
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, score_mod=mods.temperature(t), implementation="blocked", block_q=4
        )
        return (out * g).sum()

    batched = torch.func.vmap(torch.func.grad(loss))(temperatures)
    for row, t in zip(batched, temperatures, strict=True):
        expected = sdpa_array.scaled_dot_product_attention_vjp(
            q, k, v, g, score_mod=mods.temperature(t), return_mod_gradients=True
        )[-1]
        torch.testing.assert_close(row, expected, rtol=0, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, on forward mode
        with pytest.raises(NotImplementedError, match="jvp"):
            torch.func.hessian(loss)(temperatures[0])


def test_jax_jacrev_and_vmap_of_grad_over_temperatures(jax_backend):
    """``jax.jacrev`` (the VJP under ``vmap``) and ``jax.vmap(jax.grad(...))`` over the
    temperatures, through the blocked kernel's ``jax.custom_vjp``, against the VJP row by
    row (batched tracers have no device: the gradients are not moved)."""
    import jax
    import jax.numpy as jnp

    q, k, v, g = (jax_backend.asarray(a, "float64") for a in _arrays(seed=13))
    t = jnp.asarray([0.5, 0.8, 1.25, 2.0])

    def out(t):
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, score_mod=mods.temperature(t), implementation="blocked", block_q=4
        )

    jacobian = jax.jacrev(lambda t: jnp.sum(out(t) * g, axis=(0, 2, 3)))(t)  # (H, H)
    for h in range(H):
        gh = g * (jnp.arange(H) == h)[None, :, None, None]
        expected = sdpa_array.scaled_dot_product_attention_vjp(
            q, k, v, gh, score_mod=mods.temperature(t), return_mod_gradients=True
        )[-1]
        np.testing.assert_allclose(jacobian[h], expected, rtol=0, atol=1e-12)
    batch = jnp.stack([t, 2 * t])
    rows = jax.vmap(jax.grad(lambda t: jnp.sum(out(t) * g)))(batch)
    for row, tt in zip(rows, batch, strict=True):
        expected = sdpa_array.scaled_dot_product_attention_vjp(
            q, k, v, g, score_mod=mods.temperature(tt), return_mod_gradients=True
        )[-1]
        np.testing.assert_allclose(row, expected, rtol=0, atol=1e-12)


def test_torch_blocked_refuses_undeclared_data_when_only_mods_need_grad(torch_backend):
    """A temperature that requires grad beside ALiBi slopes of another library (NumPy):
    the wrapper cannot take them both as inputs, so the call goes where torch
    differentiates it whole even when no input requires grad (``"auto"``: the materialized
    kernel, correct gradient) and an explicit ``"blocked"`` refuses, rather than torch
    differentiating every tile (``O(L · S)`` memory)."""
    import torch

    q, k, v, g = (torch_backend.asarray(a, "float64") for a in _arrays(seed=14))
    slopes = _parameter("alibi")
    t = torch_backend.asarray(_parameter("temperature"), "float64").requires_grad_(True)
    kw = {"score_mod": mods.temperature(t), "bias_mod": mods.alibi(slopes), "is_causal": True}
    (sdpa_array.scaled_dot_product_attention(q, k, v, block_q=4, **kw) * g).sum().backward()
    expected = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, v, g, score_mod=mods.temperature(t.detach()),
        bias_mod=mods.alibi(torch_backend.asarray(slopes, "float64")),
        is_causal=True, return_mod_gradients=True,
    )[3]  # fmt: skip
    torch.testing.assert_close(t.grad, expected, rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="require grad"):
        sdpa_array.scaled_dot_product_attention(q, k, v, implementation="blocked", **kw)


class _HeadBias:
    """A bias function of the caller's with declared parameters but no
    ``with_parameters``: ``table[head]`` for every key."""

    def __init__(self, table):
        self.table = table

    @property
    def parameters(self):
        return (self.table,)

    def __call__(self, b, h, i, j):
        xp = array_namespace({"h": h})
        values = xp.take(self.table, xp.reshape(h, (-1,)), axis=0)
        return xp.reshape(values, tuple(h.shape)) + 0.0 * xp.astype(i - j, self.table.dtype)

    def parameter_cotangents(self, cotangent, b, h, i, j):
        xp = array_namespace({"c": cotangent})
        return (mod_parameters.sum_by_index(xp, cotangent, h, int(self.table.shape[0])),)


class _HeadGain:
    """A score function of the caller's with a trainable gain per head:
    ``score * gain[head]``, with every member the protocol names."""

    def __init__(self, gain):
        self.gain = gain

    @property
    def parameters(self):
        return (self.gain,)

    def with_parameters(self, gain):
        return type(self)(gain)

    def _per_head(self, like, h):
        xp = array_namespace({"s": like})
        values = xp.take(xp.astype(self.gain, like.dtype), xp.reshape(h, (-1,)), axis=0)
        return xp.reshape(values, tuple(h.shape))

    def __call__(self, s, b, h, i, j):
        return s * self._per_head(s, h)

    def derivative(self, s, b, h, i, j):
        return self._per_head(s, h) + 0.0 * s

    def parameter_cotangents(self, cotangent, s, b, h, i, j):
        xp = array_namespace({"c": cotangent})
        return (mod_parameters.sum_by_index(xp, cotangent * s, h, int(self.gain.shape[0])),)

    def parameter_derivatives(self, s, b, h, i, j):
        units = np.reshape(np.arange(int(self.gain.shape[0])), (-1,) + (1,) * s.ndim)
        return (np.where(units == h[None, ...], s[None, ...], 0.0),)


class _Unchanged(_HeadGain):
    """Returns the scores it is given, the same array: the kernels must keep the scores
    for the parameter cotangents apart from it (later steps write into the result). Its
    parameter does nothing: each cotangent is ``0 * score`` summed, NaN if a masked
    ``-inf`` reached the kept scores."""

    def __call__(self, s, b, h, i, j):
        return s

    def derivative(self, s, b, h, i, j):
        return 1.0 + 0.0 * s

    def parameter_cotangents(self, cotangent, s, b, h, i, j):
        return super().parameter_cotangents(cotangent * 0.0, s, b, h, i, j)

    def parameter_derivatives(self, s, b, h, i, j):
        return (np.zeros((int(self.gain.shape[0]), *s.shape)),)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("function", [_HeadGain, _Unchanged])
def test_a_score_function_of_the_callers_declares_its_parameters(backend, function, path):
    """A score function of the caller's with ``parameters``, ``parameter_cotangents`` and
    ``parameter_derivatives`` (for the oracle) gets its gradients from the VJP on every
    backend and path, beside a trainable bias function, under causal masking."""
    q, k, v, g = (backend.asarray(a, "float32") for a in _arrays(seed=11))
    gain = backend.asarray(np.array([0.5, 1.5, 1.0, 2.0]), "float32")
    slopes = backend.asarray(_parameter("alibi"), "float32")
    kw = {"score_mod": function(gain), "bias_mod": mods.alibi(slopes), "is_causal": True}
    grads = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, v, g, implementation=path, **PATHS[path], **kw, return_mod_gradients=True
    )
    assert len(grads) == 5
    assert_vjp_close_to_oracle(grads, q, k, v, g, **kw, return_mod_gradients=True)


def test_declared_parameters_without_with_parameters_under_saved_tensor_hooks(torch_backend):
    """torch autograd through the blocked kernel of a function with ``parameters`` and
    ``parameter_cotangents`` only, while saved tensors hooks unpack copies (activation
    offloading): the copies hold the same values, so the function is kept."""
    import torch

    q, k, v, g = (torch_backend.asarray(a, "float64") for a in _arrays(seed=5))
    table = torch_backend.asarray(np.linspace(-1.0, 1.0, H), "float64")
    expected = reference.scaled_dot_product_attention_vjp(
        *(reference.to_numpy(a) for a in (q, k, v, g)),
        bias=reference.to_numpy(table)[None, :, None, None] * np.ones((B, H, L, S)),
        is_causal=True,
    )[3]
    leaf = table.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x.clone(), lambda x: x):
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, bias_mod=_HeadBias(leaf), is_causal=True, implementation="blocked"
        )
        (grad,) = torch.autograd.grad((out * g).sum(), [leaf])
    np.testing.assert_allclose(
        reference.to_numpy(grad), expected.sum(axis=(0, 2, 3)), rtol=0, atol=1e-12
    )


def test_a_captured_table_of_the_callers_gets_its_gradient(autograd_backend):
    """A bias function of the caller's closing over a trainable table (no declared
    parameters) gets its gradient, through "auto" (the materialized path at these sizes)
    and "blocked" (which takes the table as an input); the oracle's derivation is that of
    the same table in ``relative_position_bias``."""
    backend = autograd_backend
    q, k, v, g = (backend.asarray(a, "float64") for a in _arrays(seed=2))
    table = _parameter("t5")
    buckets = mods.relative_position_bias(table, num_buckets=BUCKETS, max_distance=MAX_DISTANCE)

    def by_bucket(t):
        def bias(b, h, i, j):
            return _mod("t5", t)(b, h, i, j)

        return bias

    expected = sdpa_array.scaled_dot_product_attention_vjp(
        q, k, v, g, bias_mod=_mod("t5", backend.asarray(table, "float64")),
        is_causal=True, return_mod_gradients=True,
    )[-1]  # fmt: skip
    reference_grad = reference.scaled_dot_product_attention_vjp(
        *(reference.to_numpy(a) for a in (q, k, v, g)),
        bias_mod=buckets, is_causal=True, return_mod_gradients=True,
    )[-1]  # fmt: skip
    np.testing.assert_allclose(reference.to_numpy(expected), reference_grad, rtol=0, atol=1e-12)
    for run in ({}, {"implementation": "blocked", "block_q": 4}):
        if backend.library == "torch":
            t = backend.asarray(table, "float64").requires_grad_(True)
            out = sdpa_array.scaled_dot_product_attention(
                q, k, v, bias_mod=by_bucket(t), is_causal=True, **run
            )
            (out * g).sum().backward()
            got = t.grad
        else:
            import jax

            def loss(t, run=run):
                out = sdpa_array.scaled_dot_product_attention(
                    q, k, v, bias_mod=by_bucket(t), is_causal=True, **run
                )
                return (out * g).sum()

            got = jax.jit(jax.grad(loss))(backend.asarray(table, "float64"))
        np.testing.assert_allclose(
            reference.to_numpy(got), reference_grad, rtol=0, atol=1e-12, err_msg=str(run)
        )


def test_sums_in_blocks_of_rows_equal_one_block(monkeypatch):
    rng = np.random.default_rng(4)
    values = rng.standard_normal((3, 2, 7, 13))
    head = np.arange(2).reshape(1, 2, 1, 1)
    bucket = rng.integers(0, 5, (7, 13))
    xp = array_namespace({"values": values})
    whole = mod_parameters.sum_by_head_and_bucket(xp, values, head, bucket, 3, 5)
    monkeypatch.setattr(mod_parameters, "BUCKET_CHUNK", 13 * 5 * 2)  # two rows a block
    blocks = mod_parameters.sum_by_head_and_bucket(xp, values, head, bucket, 3, 5)
    expected = np.zeros((3, 5))
    for h in range(2):
        for n in range(5):
            expected[h, n] = values[:, h][:, bucket == n].sum()
    np.testing.assert_allclose(whole, expected, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(blocks, expected, rtol=1e-13, atol=1e-13)


class _ParametersOnly:
    """A bias function with ``parameters`` and no ``parameter_cotangents``."""

    parameters = (np.ones(H),)

    def __call__(self, b, h, i, j):
        return 0.0 * (i - j)


BAD_REQUESTS = [
    ({}, TypeError, r"needs a score_mod or bias_mod with trainable .* got no score_mod or bias"),
    (
        {"bias_mod": lambda b, h, i, j: 0.0 * (i - j)},
        TypeError,
        r"needs a score_mod or bias_mod with trainable parameters .* got bias_mod",
    ),
    (
        {"score_mod": mods.tanh_softcap(2.0)},
        TypeError,
        r"with trainable parameters .* got score_mod tanh_softcap\(2.0\)",
    ),
    ({"bias_mod": mods.alibi(np.ones(H)), "return_mod_gradients": 1}, TypeError, r"bool"),
    (  # beside a trainable score function, its gradients would silently be left out
        {"score_mod": mods.temperature(np.ones(H)), "bias_mod": _ParametersOnly()},
        TypeError,
        r"bias_mod .* has 'parameters' but no 'parameter_cotangents'",
    ),
    (
        {"bias_mod": mods.alibi(np.ones(H - 1))},
        ValueError,
        r"bias_mod alibi.* holds data for 3 query heads, but the call has 4",
    ),
    (
        {"score_mod": mods.temperature(np.ones(H - 1))},
        ValueError,
        r"score_mod temperature.* holds data for 3 query heads, but the call has 4",
    ),
]


@pytest.mark.parametrize(("options", "error", "match"), BAD_REQUESTS)
def test_bad_requests_are_refused(options, error, match):
    q, k, v, g = _arrays()
    options = {"return_mod_gradients": True, **options}
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **options)


@pytest.mark.parametrize("name", ["score_mod", "bias_mod"])
def test_parameters_of_another_library_are_refused(name):
    torch = pytest.importorskip("torch")
    q, k, v, g = _arrays()
    values = torch.ones(H, dtype=torch.float64)
    mod = mods.temperature(values) if name == "score_mod" else mods.alibi(values)
    match = rf"{name}'s parameter 0 must be a real floating array of the inputs' library"
    with pytest.raises(TypeError, match=match + r" \(numpy\)"):
        sdpa_array.scaled_dot_product_attention_vjp(
            q, k, v, g, **{name: mod}, return_mod_gradients=True
        )


def test_diagonal_sums(backend):
    """``diagonal_sums`` against a loop over the diagonals, on every library."""
    values = np.random.default_rng(6).standard_normal((2, 5, 7))
    x = backend.asarray(values, "float64")
    got = mod_parameters.diagonal_sums(array_namespace({"x": x}), x)
    expected = np.zeros((2, 5 + 7 - 1))
    for i in range(5):
        for j in range(7):
            expected[:, j - i + 4] += values[:, i, j]
    np.testing.assert_allclose(reference.to_numpy(got), expected, rtol=1e-14, atol=1e-14)


def test_t5_cotangents_by_entry_and_by_offset_agree():
    """T5's table gradient from every entry (``parameter_cotangents``, for any indices)
    and from the sums along a tile's diagonals (``offset_cotangents``, what the kernels
    use), for a tile off the diagonal."""
    rng = np.random.default_rng(7)
    mod = _mod("t5", _parameter("t5"))
    dz = rng.standard_normal((B, H, 5, 8))
    rows, cols = slice(20, 25), slice(3, 11)
    batch = np.arange(B).reshape(B, 1, 1, 1)
    head = np.arange(H).reshape(1, H, 1, 1)
    q_idx = np.arange(rows.start, rows.stop).reshape(1, 1, -1, 1)
    kv_idx = np.arange(cols.start, cols.stop).reshape(1, 1, 1, -1)
    (by_entry,) = mod.parameter_cotangents(dz, batch, head, q_idx, kv_idx)
    sums = mod_parameters.diagonal_sums(array_namespace({"dz": dz}), dz.sum(axis=0, keepdims=True))
    offsets = np.arange(cols.start - rows.stop + 1, cols.stop - rows.start)
    (by_offset,) = mod.offset_cotangents(sums, head[..., 0], offsets)
    np.testing.assert_allclose(by_offset, by_entry, rtol=1e-13, atol=1e-13)
    assert np.abs(by_entry).max() > 0
