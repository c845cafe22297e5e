"""Plans kept for repeated calls (``_plan/cache.py``).

A repeated call of the same signature skips validation and dispatch and gives the same
result; a change of any part of the signature (shape, dtype, gradient flag, an option's
value or type, the outputs, the implementation, the blocks) is validated anew, so bad input
after a good call still raises; calls whose options hold arrays or functions, and arrays of
other libraries, are never kept; at most ``MAX_ENTRIES`` signatures are.
"""

from __future__ import annotations

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference
from sdpa_array._plan import cache
from sdpa_array._plan import plan as plan_module


@pytest.fixture
def validations(monkeypatch):
    """The number of calls validated so far (a list to read after each call)."""
    seen: list[int] = []
    original = plan_module.validate

    def counting(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(plan_module, "validate", counting)
    return seen


def _arrays(seed=0, shape=(2, 3, 5, 4)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(3)]


def test_repeated_numpy_call_is_planned_once(validations):
    q, k, v = _arrays()
    first = sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=True)
    q2, k2, v2 = _arrays(seed=1)
    second = sdpa_array.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    assert len(validations) == 1
    want = reference.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    np.testing.assert_allclose(second, want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(first, second)


def test_repeated_torch_call_is_planned_once(validations):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(a) for a in _arrays())
    sdpa_array.scaled_dot_product_attention(q, k, v)
    q2, k2, v2 = (torch.from_numpy(a).requires_grad_() for a in _arrays(seed=2))
    out = sdpa_array.scaled_dot_product_attention(q2, k2, v2)  # another signature
    out2 = sdpa_array.scaled_dot_product_attention(q2, k2, v2)
    assert len(validations) == 2
    want = reference.scaled_dot_product_attention(*(a.detach().numpy() for a in (q2, k2, v2)))
    np.testing.assert_allclose(out2.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    out.sum().backward()  # the kept plan of a tensor that requires a gradient still has one
    assert q2.grad is not None


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda q, k, v, o: ((q[:, :, :4], k, v), o), id="shape"),
        pytest.param(
            lambda q, k, v, o: (tuple(a.astype(np.float32) for a in (q, k, v)), o), id="dtype"
        ),
        pytest.param(lambda q, k, v, o: ((q, k, v), {**o, "is_causal": False}), id="value"),
        pytest.param(lambda q, k, v, o: ((q, k, v), {**o, "window": (2, None)}), id="window"),
        pytest.param(lambda q, k, v, o: ((q, k, v), {**o, "return_lse": True}), id="outputs"),
        pytest.param(lambda q, k, v, o: ((q, k, v), {**o, "implementation": "blocked"}), id="impl"),
        pytest.param(lambda q, k, v, o: ((q, k, v), {**o, "block_q": 2}), id="blocks"),
    ],
)
def test_any_change_of_the_signature_is_validated(validations, change):
    q, k, v = _arrays()
    options = {"is_causal": True}
    sdpa_array.scaled_dot_product_attention(q, k, v, **options)
    arrays, changed = change(q, k, v, options)
    sdpa_array.scaled_dot_product_attention(*arrays, **changed)
    assert len(validations) == 2


@pytest.mark.parametrize(
    ("options", "error"),
    [
        pytest.param({"is_causal": 1}, TypeError, id="int-for-bool"),
        pytest.param({"is_causal": True, "scale": -1.0}, ValueError, id="bad-scale"),
        pytest.param({"is_causal": True, "implementation": "nope"}, ValueError, id="impl"),
        pytest.param({"is_causal": True, "block_q": True}, ValueError, id="bool-block"),
    ],
)
def test_bad_input_after_a_good_call_still_raises(options, error):
    """Also a mixed dtype after calls of one dtype, and ``1`` where ``True`` was kept."""
    q, k, v = _arrays()
    sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=True, block_q=2)
    sdpa_array.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(error):
        sdpa_array.scaled_dot_product_attention(q, k, v, **options)
    with pytest.raises(TypeError, match="share one dtype"):
        sdpa_array.scaled_dot_product_attention(q.astype(np.float32), k, v, is_causal=True)


def test_calls_with_arrays_or_functions_among_their_options_are_not_kept(validations):
    q, k, v = _arrays()
    mask = np.ones((5, 5), dtype=bool)
    lengths = np.array([5, 3])
    for _ in range(2):
        sdpa_array.scaled_dot_product_attention(q, k, v, mask=mask)
        sdpa_array.scaled_dot_product_attention(q, k, v, key_lengths=lengths)
        sdpa_array.scaled_dot_product_attention(q, k, v, mask_mod=sdpa_array.mods.causal())
    assert len(validations) == 6
    sdpa_array.scaled_dot_product_attention(q, k, v, key_lengths=3)  # an int is a number
    sdpa_array.scaled_dot_product_attention(q, k, v, key_lengths=3)
    assert len(validations) == 7


def test_other_libraries_are_not_kept(validations):
    strict = pytest.importorskip("array_api_strict")
    q, k, v = (strict.asarray(a) for a in _arrays())
    sdpa_array.scaled_dot_product_attention(q, k, v)
    sdpa_array.scaled_dot_product_attention(q, k, v)
    assert len(validations) == 2


def test_at_most_max_entries_are_kept(monkeypatch, validations):
    monkeypatch.setattr(cache, "MAX_ENTRIES", 2)
    q, k, v = _arrays()
    for L in (5, 4, 3):  # three signatures: the first is dropped
        sdpa_array.scaled_dot_product_attention(q[:, :, :L], k, v)
    sdpa_array.scaled_dot_product_attention(q[:, :, :3], k, v)  # kept
    assert len(validations) == 3
    sdpa_array.scaled_dot_product_attention(q, k, v)  # dropped: validated again
    assert len(validations) == 4


def test_explain_matches_the_kept_plan():
    """A kept native choice plans the kernel's call with each call's arrays: ``explain``
    names the kernel, and the call runs that planned call."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(a) for a in _arrays())
    cold = sdpa_array.explain(q, k, v)
    sdpa_array.scaled_dot_product_attention(q, k, v)
    warm = sdpa_array.explain(q, k, v)
    assert cold.forward_kernel == "torch.nn.functional.scaled_dot_product_attention"
    assert warm == cold
    kept = plan_module.plan_forward(q, k, v, *_plain_call())
    request, _ = kept.choice.planned
    assert request.inputs is kept.inputs


def _plain_call():
    from sdpa_array._problem.options import Options
    from sdpa_array._problem.outputs import Outputs

    return Options(), Outputs.of(False, False, False), "auto", (None, None)
