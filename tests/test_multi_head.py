"""The multi-head layer: :func:`sdpa_array.multi_head_attention` on every float64 backend
against an oracle composed in NumPy, and :class:`sdpa_array.MultiheadAttention` against
``torch.nn.MultiheadAttention`` on the same weights.

Error bound
-----------
Both sides compute in float64. An output element is a chain of three dot products: the
projection (length ``Ein``), the attention average over ``S`` keys (softmax weights in
``[0, 1]`` summing to 1, each computed with a few roundings of ``exp`` and a sum of ``S``
terms) and the output projection (length ``H * Dv``). The textbook bound ``gamma_n = n u /
(1 - n u)`` of a length-``n`` dot product on these magnitudes, with ``n = Ein + S + H *
Dv`` and a factor 16 for the softmax's ``exp``, ``log`` and division, gives ``|out - out*| <=
16 n u A``, where ``A = H Dv max|Wo| (Ein max|Wv| max|x_v| + max|bv|) + max|bo|`` bounds the
terms' magnitudes (a weighted average of values is no larger than the largest value); the
weights, in ``[0, 1]``, are off by at most ``16 n u``. Gradients are compared the same way
with the bound scaled by the largest gradient's magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest

from sdpa_array import multi_head_attention, reference

U64 = np.finfo(np.float64).eps / 2


def _params(rng: np.random.Generator, E: int, Ek: int, Ev: int, H: int, Hkv: int) -> dict:
    D = E // H
    return {
        "q_weight": rng.standard_normal((H * D, E)) / np.sqrt(E),
        "k_weight": rng.standard_normal((Hkv * D, Ek)) / np.sqrt(Ek),
        "v_weight": rng.standard_normal((Hkv * D, Ev)) / np.sqrt(Ev),
        "out_weight": rng.standard_normal((E, H * D)) / np.sqrt(E),
        "q_bias": rng.standard_normal(H * D),
        "k_bias": rng.standard_normal(Hkv * D),
        "v_bias": rng.standard_normal(Hkv * D),
        "out_bias": rng.standard_normal(E),
    }


def _oracle(x_q, x_k, x_v, p, H, Hkv, **options):
    """Projections in NumPy float64, heads by explicit loops, the float64 oracle per head."""
    q = x_q @ p["q_weight"].T + p["q_bias"]
    k = x_k @ p["k_weight"].T + p["k_bias"]
    v = x_v @ p["v_weight"].T + p["v_bias"]
    D, Dv = q.shape[-1] // H, v.shape[-1] // Hkv
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        out = reference.scaled_dot_product_attention(
            q[..., h * D : (h + 1) * D],
            k[..., g * D : (g + 1) * D],
            v[..., g * Dv : (g + 1) * Dv],
            **options,
        )
        heads.append(out)
    return np.concatenate(heads, axis=-1) @ p["out_weight"].T + p["out_bias"]


def _bound(p: dict, x_v: np.ndarray, n: int, H: int) -> float:
    v_max = x_v.shape[-1] * np.abs(p["v_weight"]).max() * np.abs(x_v).max()
    v_max += np.abs(p["v_bias"]).max()
    a = p["out_weight"].shape[1] * np.abs(p["out_weight"]).max() * v_max
    return 16 * n * U64 * (a + np.abs(p["out_bias"]).max())


@pytest.mark.parametrize(
    ("H", "Hkv", "options"),
    [
        (4, 4, {}),
        (4, 2, {"is_causal": True}),
        (2, 1, {"window": (2, 1), "softcap": 3.0}),
        (4, 4, {"key_lengths": 5}),
    ],
    ids=["plain", "gqa-causal", "mqa-window-softcap", "lengths"],
)
def test_functional_layer_matches_the_oracle(float64_backend, H, Hkv, options):
    backend = float64_backend
    rng = np.random.default_rng(H * 10 + Hkv)
    B, L, S, E, Ek, Ev = 2, 6, 7, 8, 5, 3
    x_q, x_k, x_v = (rng.standard_normal((B, n, e)) for n, e in ((L, E), (S, Ek), (S, Ev)))
    p = _params(rng, E, Ek, Ev, H, Hkv)
    arrays = {name: backend.asarray(a, "float64") for name, a in p.items()}
    got = multi_head_attention(
        *(backend.asarray(a, "float64") for a in (x_q, x_k, x_v)),
        arrays,
        num_heads=H,
        num_kv_heads=Hkv,
        **options,
    )
    expected = _oracle(x_q, x_k, x_v, p, H, Hkv, **options)
    assert got.shape == (B, L, E)
    bound = _bound(p, x_v, E + S + E, H)
    np.testing.assert_allclose(reference.to_numpy(got), expected, rtol=0, atol=bound)


def test_functional_layer_returns_the_weights_and_checks_its_arguments():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 8))
    p = _params(rng, 8, 8, 8, 2, 2)
    out, weights = multi_head_attention(x, x, x, p, num_heads=2, return_weights=True)
    assert out.shape == (2, 4, 8)
    assert weights.shape == (2, 2, 4, 4)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=0, atol=16 * 4 * U64)
    with pytest.raises(ValueError, match="params\\['out_weight'\\] is required"):
        multi_head_attention(x, x, x, {k: v for k, v in p.items() if k != "out_weight"},
                             num_heads=2)  # fmt: skip
    with pytest.raises(TypeError, match="unknown names \\['in_proj'\\]"):
        multi_head_attention(x, x, x, {**p, "in_proj": p["q_weight"]}, num_heads=2)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        multi_head_attention(x, x, x, p, num_heads=0)
    with pytest.raises(ValueError, match="multiple of num_heads = 3 rows"):
        multi_head_attention(x, x, x, p, num_heads=3)
    with pytest.raises(ValueError, match="q_bias"):
        multi_head_attention(x, x, x, {**p, "q_bias": p["q_bias"][:3]}, num_heads=2)
    with pytest.raises(ValueError, match="bias_k'\\] and params\\['bias_v'\\] go together"):
        multi_head_attention(x, x, x, {**p, "bias_k": p["k_bias"]}, num_heads=2)
