"""Eager JAX calls are compiled whole (:mod:`sdpa_array._api.jax_eager`), once per setup.

An eager call on concrete JAX arrays runs a cached ``jax.jit`` of the public function:
its result is checked against the oracle, later calls with the same setup reuse the
compiled program and give bit-identical results, calls inside a JAX transformation are
not compiled again, and the calls it does not compile (dropout, unhashable static options,
the environment switch) run operation by operation.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import sdpa_array  # noqa: E402
from sdpa_array._api import jax_eager  # noqa: E402
from sdpa_array.testing import (  # noqa: E402
    assert_close_to_oracle,
    assert_vjp_close_to_oracle,
    get_backend,
)

BACKEND = get_backend("jax")


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The static configurations traced (one entry per new ``jax.jit``)."""
    seen: list[tuple] = []
    jax_eager.clear_compiled()
    original = jax_eager._compiled.__wrapped__

    def recording(function, static):
        seen.append(static)
        return original(function, static)

    import functools

    monkeypatch.setattr(jax_eager, "_compiled", functools.lru_cache(maxsize=128)(recording))
    return seen


def _inputs(seed: int = 0, shape=(2, 2, 40, 8)):
    BACKEND.configure()
    rng = np.random.default_rng(seed)
    return [BACKEND.asarray(rng.standard_normal(shape), "float32") for _ in range(4)]


def test_eager_calls_compile_once_per_setup(compiled):
    q, k, v, g = _inputs()
    lengths = BACKEND.asarray(np.array([40, 17]))
    options = {"is_causal": True, "key_lengths": lengths}
    run = {**options, "implementation": "blocked", "block_q": 16}
    first = sdpa_array.scaled_dot_product_attention(q, k, v, **run)
    second = sdpa_array.scaled_dot_product_attention(q, k, v, **run)
    assert len(compiled) == 1  # compiled at the first call, reused by the second
    assert_close_to_oracle(first, q, k, v, **options)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))  # the same program
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    assert len(compiled) == 2
    sdpa_array.scaled_dot_product_attention(q, k, v, **{**run, "is_causal": False})
    assert len(compiled) == 3  # another static option: another program
    shorter = q[:, :, :20]
    for _ in range(2):
        out = sdpa_array.scaled_dot_product_attention(shorter, k, v, **run)
    assert len(compiled) == 3  # the same jitted function, which jax traces per shape
    assert_close_to_oracle(out, shorter, k, v, **options)
    off = pytest.MonkeyPatch()
    off.setenv(jax_eager.ENVIRONMENT_VARIABLE, "0")
    try:
        op_by_op = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    finally:
        off.undo()
    assert len(compiled) == 3
    for result in (grads, op_by_op):  # compiled or not, within the oracle's bound
        assert_vjp_close_to_oracle(result, q, k, v, g, **options)


def test_calls_inside_transformations_and_dropout_are_not_compiled_again(compiled):
    q, k, v, _ = _inputs(1)

    @jax.jit
    def traced(q, k, v):
        return sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = traced(q, k, v)
    assert compiled == []  # the tracers are not eager arrays
    assert_close_to_oracle(out, q, k, v, is_causal=True)
    dropped = {"dropout_p": 0.3, "dropout_seed": 5}
    out = sdpa_array.scaled_dot_product_attention(q, k, v, **dropped)
    assert compiled == []  # a new seed would compile a new program: run as it is
    assert_close_to_oracle(out, q, k, v, **dropped)


def test_mask_functions_and_numpy_scalars_keep_their_eager_meaning(compiled):
    """A mask function runs eagerly (its empty blocks are found on its values and skipped);
    a NumPy scalar ``scale`` stays a number (no gradient), as in an eager call."""
    q, k, v, g = _inputs(2)
    out = sdpa_array.scaled_dot_product_attention(q, k, v, mask_mod=lambda b, h, i, j: j <= i)
    assert compiled == []
    assert_close_to_oracle(out, q, k, v, is_causal=True)
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, scale=np.float32(0.3))
    assert len(grads) == 3
    assert len(compiled) == 1
