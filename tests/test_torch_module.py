"""``sdpa_array.MultiheadAttention`` against ``torch.nn.MultiheadAttention`` on the same weights.

Both in float64, with the bound of ``tests/test_multi_head.py`` (three chained dot products
of lengths ``Ein``, ``S`` and ``H * Dv``): outputs, weights, and the gradients of the inputs
and of every parameter; the ``state_dict`` loads both ways; torch's argument forms (boolean
and floating masks, 2-D and 3-D ``attn_mask``, sequence-first and batch-first, unbatched
inputs, ``add_bias_kv``, ``add_zero_attn``, ``kdim``/``vdim``) give torch's results.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_array  # noqa: E402
from tests.test_multi_head import U64, _bound  # noqa: E402

#: (constructor keywords, forward keywords builder) cases: every constructor option and
#: every mask form, alone and combined.
MODULE_CASES = {
    "self-batch-first": ({"batch_first": True}, {}),
    "sequence-first-kdim-vdim": ({"kdim": 5, "vdim": 3}, {}),
    "no-bias": ({"bias": False, "batch_first": True}, {}),
    "bias-kv-zero-attn": ({"add_bias_kv": True, "add_zero_attn": True, "batch_first": True}, {}),
    "key-padding-bool": ({"batch_first": True}, {"kpm": "bool"}),
    "key-padding-bool-attn-3d": ({"batch_first": True}, {"kpm": "bool", "attn": "3d-bool"}),
    "key-padding-float-attn-3d": ({"batch_first": True}, {"kpm": "float", "attn": "3d-float"}),
    "attn-float-heads-kept": ({}, {"attn": "float", "average_attn_weights": False}),
    "causal-hint": ({"batch_first": True}, {"attn": "causal", "is_causal": True}),
    "no-weights-bias-kv-mask": ({"add_bias_kv": True}, {"kpm": "bool", "need_weights": False}),
}


def _module_inputs(name: str, mod: Any) -> tuple[list, dict]:
    kw, fwd = MODULE_CASES[name]
    rng = np.random.default_rng(len(name))
    N, L, S, E = 3, 5, 6, mod.embed_dim
    if fwd.get("attn") == "causal":
        S = L
    Ek, Ev = mod.kdim, mod.vdim
    shapes = [(N, L, E), (N, S, Ek), (N, S, Ev)]
    xs = [torch.tensor(rng.standard_normal(s), requires_grad=True) for s in shapes]
    if not kw.get("batch_first"):
        xs = [x.detach().transpose(0, 1).contiguous().requires_grad_() for x in xs]
    call: dict[str, Any] = {
        k: v for k, v in fwd.items() if k in ("need_weights", "average_attn_weights", "is_causal")
    }
    kpm = fwd.get("kpm")
    if kpm:
        padded = np.zeros((N, S), dtype=bool)
        padded[0, -2:] = True
        padded[2, -1] = True
        call["key_padding_mask"] = (
            torch.tensor(padded)
            if kpm == "bool"
            else torch.tensor(np.where(padded, -1e4, rng.standard_normal((N, S))))
        )
    attn = fwd.get("attn")
    if attn == "3d-bool":
        blocked = rng.random((N * mod.num_heads, L, S)) < 0.3
        blocked[..., 0] = False  # every row keeps a key
        call["attn_mask"] = torch.tensor(blocked)
    elif attn == "3d-float":
        call["attn_mask"] = torch.tensor(rng.standard_normal((N * mod.num_heads, L, S)))
    elif attn == "float":
        call["attn_mask"] = torch.tensor(rng.standard_normal((L, S)))
    elif attn == "causal":
        call["attn_mask"] = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=1)
    return xs, call


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_module_matches_torch_and_shares_its_state_dict(name):
    kw, _ = MODULE_CASES[name]
    torch.manual_seed(0)
    ours = sdpa_array.MultiheadAttention(8, 2, dtype=torch.float64, **kw)
    theirs = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64, **kw)
    theirs.load_state_dict(ours.state_dict())  # our names load into torch's module
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())  # and back
    xs, call = _module_inputs(name, ours)
    out, weights = ours(*xs, **call)
    xs2 = [x.detach().clone().requires_grad_() for x in xs]
    expected, expected_weights = theirs(*xs2, **call)
    p = {k: v.detach().numpy() for k, v in ours._params().items() if k.endswith("weight")}
    p.update(v_bias=np.zeros(1), out_bias=np.zeros(1))
    if ours.in_proj_bias is not None:
        p["v_bias"] = ours.in_proj_bias.detach().numpy()
        p["out_bias"] = ours.out_proj.bias.detach().numpy()
    S = xs[1].shape[1 if kw.get("batch_first") else 0] + 2
    n = 8 + S + 8
    bound = _bound(p, xs[2].detach().numpy(), n, 2)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out.detach(), expected.detach(), rtol=0, atol=bound)
    if call.get("need_weights", True):
        assert weights.shape == expected_weights.shape
        np.testing.assert_allclose(weights.detach(), expected_weights.detach(), rtol=0,
                                   atol=16 * n * U64)  # fmt: skip
    else:
        assert weights is None
        assert expected_weights is None
    g = torch.tensor(np.random.default_rng(9).standard_normal(out.shape))
    ours_grads = torch.autograd.grad(out, [*xs, *ours.parameters()], g)
    theirs_grads = torch.autograd.grad(expected, [*xs2, *theirs.parameters()], g)
    for a, b in zip(ours_grads, theirs_grads, strict=True):
        scale = max(1.0, float(b.abs().max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=bound * scale)


def test_module_unbatched_inputs_match_torch():
    torch.manual_seed(1)
    ours = sdpa_array.MultiheadAttention(8, 4, dtype=torch.float64)
    theirs = torch.nn.MultiheadAttention(8, 4, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64)
    kpm = torch.tensor([False, False, False, True, True])
    out, w = ours(x, x, x, key_padding_mask=kpm)
    expected, expected_w = theirs(x, x, x, key_padding_mask=kpm)
    assert out.shape == expected.shape == (5, 8)
    np.testing.assert_allclose(out.detach(), expected.detach(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.detach(), expected_w.detach(), rtol=0, atol=1e-13)


def test_module_dropout_in_training_only_and_bad_calls():
    torch.manual_seed(2)
    mod = sdpa_array.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 4, 8)
    mod.eval()
    a, _ = mod(x, x, x)
    b, _ = mod(x, x, x)
    assert torch.equal(a, b)  # no dropout in evaluation
    mod.train()
    c, w = mod(x, x, x)
    assert not torch.equal(a, c)
    kept = (w > 0).float().mean().item()
    assert 0.2 < kept < 0.8  # half the weights dropped, averaged over 2 heads
    with pytest.raises(ValueError, match="is_causal is a hint"):
        mod(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        mod(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be"):
        mod(x, x, x, attn_mask=torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be a boolean or floating"):
        mod(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        sdpa_array.MultiheadAttention(8, 3)


def test_the_nn_module_names_the_same_class_and_imports_torch_on_first_use():
    """``sdpa_array.nn.MultiheadAttention`` (as ``torch.nn.MultiheadAttention`` is named) is
    the same class; importing ``sdpa_array`` and ``sdpa_array.nn`` imports no torch."""
    import subprocess
    import sys

    from sdpa_array.nn import MultiheadAttention

    assert MultiheadAttention is sdpa_array.MultiheadAttention
    assert sdpa_array.nn.MultiheadAttention is MultiheadAttention
    with pytest.raises(AttributeError, match=r"module 'sdpa_array\.nn' has no attribute 'Linear'"):
        sdpa_array.nn.Linear  # noqa: B018
    code = (
        "import sys, sdpa_array, sdpa_array.nn; import sdpa_array.nn as n; "
        "assert n is sdpa_array.nn; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
