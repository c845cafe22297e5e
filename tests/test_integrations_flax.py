"""The Flax adapter (:func:`sdpa_array.integrations.flax.attention_fn`) against Flax's own
``dot_product_attention`` on the same weights and inputs, and against the float64 oracle.

NNX and linen multi-head attention (self and cross, causal and padding masks, grouped key
and value heads), under ``jit``, ``grad`` and ``vmap``, in float64; dropout with its seed
drawn from Flax's ``dropout_rng`` under ``jit``. Flax's own attention
is not float64-accurate: it differs from the float64 oracle by ``1.4e-7`` (max abs,
outputs of order one: a few float32 ulps; standard normal inputs of shape (2, 6, 4, 8),
Flax 0.12.8), while this library is within its derived float64 bound. Against Flax the
tolerance is therefore float32's: ``TOL = 100 * 2**-24`` (6e-6) relative to the largest
value, loose for a correct adapter, while a wrong layout, mask, scale or head grouping
changes the output by order one. The
function itself is checked against the oracle with the library's derived bound. Masks
here leave every query at least one key (Flax's own function averages the values of a
fully masked row, this library returns zero).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")

import sdpa_array  # noqa: E402
from sdpa_array.integrations.flax import attention_fn  # noqa: E402
from sdpa_array.testing import assert_close_to_oracle  # noqa: E402

jnp = jax.numpy
TOL = 100 * 2.0**-24


@pytest.fixture(autouse=True)
def _float64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def _close(ours, theirs, what):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    scale = 1.0 + float(np.abs(theirs).max())
    err = float(np.abs(ours - theirs).max())
    assert err <= TOL * scale, f"{what}: max abs difference {err:.3e} > {TOL * scale:.3e}"


def _inputs(L=7, S=7, batch=2, features=16, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, L, features)))
    kv = jnp.asarray(rng.standard_normal((batch, S, features)))
    pad = np.ones((batch, S), dtype=bool)
    pad[1, -2:] = False  # the second sequence's last two keys are padding (right padding:
    # with causal masks every query keeps a key)
    return x, kv, jnp.asarray(pad)


def _nnx_pair(**options):
    def build(fn):
        return nnx.MultiHeadAttention(
            num_heads=4,
            in_features=16,
            qkv_features=32,
            decode=False,
            param_dtype=jnp.float64,
            attention_fn=fn,
            rngs=nnx.Rngs(0),
            **options,
        )

    return build(attention_fn), build(nnx.dot_product_attention)


CASES = {
    "self-causal": dict(cross=False, causal=True),
    "self-padding": dict(cross=False, causal=False),
    "cross-padding": dict(cross=True, causal=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nnx_multi_head_attention_under_jit_and_grad(case):
    cross, causal = CASES[case]["cross"], CASES[case]["causal"]
    x, kv, pad = _inputs(S=9 if cross else 7)
    mask = pad[:, None, None, :]
    if causal:
        mask = mask & nnx.make_causal_mask(jnp.ones(x.shape[:2]), dtype=bool)
    ours, theirs = _nnx_pair()

    @nnx.jit
    def run(layer, x, kv, mask):
        return layer(x, kv if cross else None, mask=mask)

    _close(run(ours, x, kv, mask), run(theirs, x, kv, mask), "output")

    def loss(layer):
        return (layer(x, kv if cross else None, mask=mask) ** 2).sum()

    g_ours = nnx.jit(nnx.grad(loss))(ours)
    g_theirs = nnx.jit(nnx.grad(loss))(theirs)
    leaves = jax.tree.leaves_with_path(nnx.state(g_theirs))
    assert leaves
    for (path, expected), got in zip(leaves, jax.tree.leaves(nnx.state(g_ours)), strict=True):
        _close(got, expected, f"gradient {jax.tree_util.keystr(path)}")


def test_grouped_key_value_heads():
    x, _, pad = _inputs()
    ours, theirs = _nnx_pair(num_kv_heads=2)
    mask = pad[:, None, None, :]
    _close(ours(x, mask=mask), theirs(x, mask=mask), "output")


def test_is_causal_mask_and_vmap_against_the_oracle():
    """Called directly with Flax's layout: ``is_causal``, a Flax causal mask (0/1 floats)
    and ``jax.vmap`` over an extra leading axis, each within the library's derived bound
    of the float64 oracle (on the inputs moved to heads-first)."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 2, 6, 4, 8))) for _ in range(3))
    causal = nnx.make_causal_mask(jnp.ones((2, 6)))
    heads_first = [jnp.swapaxes(x, -3, -2) for x in (q, k, v)]

    # Flax's own function, one leading index at a time (it does not broadcast a 4-D mask
    # against 5-D inputs)
    flax_out = jnp.stack(
        [nnx.dot_product_attention(q[i], k[i], v[i], mask=causal) for i in range(3)]
    )

    def check(out, what):
        assert_close_to_oracle(jnp.swapaxes(out, -3, -2), *heads_first, is_causal=True)
        _close(out, flax_out, what)

    check(jax.jit(lambda a, b, c: attention_fn(a, b, c, is_causal=True))(q, k, v), "is_causal")
    check(attention_fn(q, k, v, mask=causal), "Flax's causal mask")
    check(jax.vmap(lambda a, b, c: attention_fn(a, b, c, mask=causal))(q, k, v), "vmap")


def test_linen_multi_head_attention():
    x, _, pad = _inputs()
    mask = pad[:, None, None, :]

    def build(fn):
        return linen.MultiHeadDotProductAttention(
            num_heads=4, qkv_features=32, param_dtype=jnp.float64, attention_fn=fn
        )

    params = build(linen.dot_product_attention).init(jax.random.key(0), x, mask=mask)
    expected = build(linen.dot_product_attention).apply(params, x, mask=mask)
    _close(jax.jit(build(attention_fn).apply)(params, x, mask=mask), expected, "output")


def test_dropout_draws_its_seed_from_the_rng_under_jit():
    """Dropout in training: the seed comes from Flax's ``dropout_rng`` (traced under
    ``jit``), so the output is the library's call with that seed; another key gives
    another mask, and gradients flow under ``jit``."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 4, 8))) for _ in range(3))
    key = jax.random.key(3)

    def train(q, k, v, key):
        return attention_fn(q, k, v, dropout_rng=key, dropout_rate=0.4, deterministic=False)

    got = jax.jit(train)(q, k, v, key)
    seed = jax.random.randint(key, (), 0, 2**31 - 1)
    want = sdpa_array.scaled_dot_product_attention(
        q, k, v, layout="BLHE", dropout_p=0.4, dropout_seed=int(seed)
    )
    # the same mask: equal up to XLA's fused rounding under jit (a float64 ulp or two; a
    # weight dropped in one and kept in the other would differ by order one)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-13)
    other = jax.jit(train)(q, k, v, jax.random.key(4))
    assert not np.allclose(np.asarray(other), np.asarray(got))
    grads = jax.jit(jax.grad(lambda q: train(q, k, v, key).sum()))(q)
    assert bool(jnp.all(jnp.isfinite(grads)))
    assert_close_to_oracle(
        jnp.swapaxes(got, 1, 2), *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)),
        dropout_p=0.4, dropout_seed=int(seed),
    )  # fmt: skip


def test_nnx_layer_trains_with_dropout():
    x, _, _ = _inputs()
    layer = nnx.MultiHeadAttention(
        num_heads=4,
        in_features=16,
        decode=False,
        dropout_rate=0.1,
        deterministic=False,
        attention_fn=attention_fn,
        rngs=nnx.Rngs(0, dropout=1),
    )
    first, second = nnx.jit(lambda m, x: m(x))(layer, x), nnx.jit(lambda m, x: m(x))(layer, x)
    assert first.shape == x.shape
    assert not np.allclose(np.asarray(first), np.asarray(second))  # a new key each call
    layer.set_attributes(deterministic=True)
    assert layer(x).shape == x.shape
    with pytest.raises(ValueError, match="needs a dropout_rng"):
        attention_fn(*(jnp.swapaxes(a, 0, 0) for a in (x[..., None, :],) * 3), dropout_rate=0.5)
