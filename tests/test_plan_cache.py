"""Plans kept for repeated calls (``_plan/cache.py``).

A repeated call of the same signature skips validation and dispatch and gives the same
result; a change of any part of the signature (shape, dtype, gradient flag, an option's
value or type, the outputs, the implementation, the blocks) is validated anew, so bad input
after a good call still raises; calls whose options hold arrays or functions, and arrays of
other libraries, are never kept; at most ``MAX_ENTRIES`` signatures are.
"""

from __future__ import annotations

import contextlib
import inspect

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


# --------------------------------------------------------------------------------------
# direct calls: a kept plan that is torch's function on the three arrays alone
# --------------------------------------------------------------------------------------


def _tensors(shape=(2, 4, 6, 8), kv_shape=None, seed=0, dtype="float32"):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(rng.standard_normal(shape).astype(dtype))
    k, v = (torch.from_numpy(rng.standard_normal(kv_shape or shape).astype(dtype)) for _ in "kv")
    return q, k, v


@pytest.fixture
def direct_lookups(monkeypatch):
    """The direct calls the public forward found (``None`` where it found none)."""
    seen: list = []
    original = cache.direct

    def recording(*args, **kwargs):
        found = original(*args, **kwargs)
        seen.append(found)
        return found

    monkeypatch.setattr(cache, "direct", recording)
    return seen


@pytest.mark.parametrize(
    ("options", "kv_shape"),
    [
        pytest.param({}, None, id="plain"),
        pytest.param({"is_causal": True}, None, id="causal"),
        pytest.param({"is_causal": True}, (2, 4, 9, 8), id="causal-longer-keys"),
        pytest.param({"scale": 0.3}, None, id="scale"),
        pytest.param({"scale": 2}, None, id="int-scale"),
        pytest.param({"enable_gqa": True}, (2, 2, 6, 8), id="gqa"),
    ],
)
def test_a_direct_call_gives_the_planned_calls_result_and_gradients(
    validations, direct_lookups, options, kv_shape
):
    """The second call of a signature runs the kept direct call (no validation): the same
    bits as the planned call of the first, the same gradients, and the oracle's output."""
    torch = pytest.importorskip("torch")
    q, k, v = _tensors(kv_shape=kv_shape)
    planned = sdpa_array.scaled_dot_product_attention(q, k, v, **options)
    assert direct_lookups == [None]
    assert len(validations) == 1
    direct = sdpa_array.scaled_dot_product_attention(q, k, v, **options)
    assert direct_lookups[-1] is not None
    assert len(validations) == 1
    assert direct.dtype == q.dtype
    assert bool((direct == planned).all())
    want = reference.scaled_dot_product_attention(*(a.numpy() for a in (q, k, v)), **options)
    # float32 kernels against the float64 oracle: E = 8 features, |scores| of a few units
    np.testing.assert_allclose(direct.numpy(), want, rtol=1e-4, atol=1e-5)

    leaves = [[a.clone().requires_grad_() for a in (q, k, v)] for _ in range(2)]
    outs = [sdpa_array.scaled_dot_product_attention(*xs, **options) for xs in leaves]
    assert len(validations) == 2  # a tensor that requires a gradient: another signature
    assert direct_lookups[-1] is not None  # the second of those two calls was direct
    cotangent = torch.ones_like(outs[0])
    grads = [torch.autograd.grad(out, xs, cotangent) for out, xs in zip(outs, leaves, strict=True)]
    for planned_grad, direct_grad in zip(*grads, strict=True):
        assert bool((planned_grad == direct_grad).all())


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda q, k, v: ((q, k, v), {"return_lse": True}), id="lse"),
        pytest.param(lambda q, k, v: ((q, k, v), {"window": (2, 0)}), id="window"),
        pytest.param(lambda q, k, v: ((q, k, v), {"key_lengths": 4}), id="lengths"),
        pytest.param(lambda q, k, v: ((q, k, v), {"softcap": 5.0}), id="softcap"),
        pytest.param(lambda q, k, v: ((q[:1], k, v), {}), id="broadcast-batch"),
        pytest.param(lambda q, k, v: ((q.half(), k.half(), v.half()), {}), id="cpu-half-cast"),
        pytest.param(lambda q, k, v: ((q, k, v), {"implementation": "blocked"}), id="blocked"),
        pytest.param(
            lambda q, k, v: ((q, k, v), {"is_causal": True, "alignment": "bottom_right"}),
            id="bottom-right",
        ),
        pytest.param(
            lambda q, k, v: ((q.double(), k.double(), v.double()), {"scale": q.new_tensor(0.5)}),
            id="array-scale",
        ),
        pytest.param(lambda q, k, v: ((q, k[:, :, :0], v[:, :, :0]), {}), id="no-keys"),
        pytest.param(lambda q, k, v: ((q[:, :, :0], k, v), {}), id="no-queries"),
        pytest.param(lambda q, k, v: ((q, k, v), {"is_causal": np.True_}), id="numpy-bool"),
        pytest.param(lambda q, k, v: ((q, k, v), {"scale": np.float64(0.5)}), id="numpy-float"),
    ],
)
def test_calls_a_direct_call_would_change_keep_no_direct_call(call):
    """Other outputs, options beyond the three, a cast, a broadcast batch, another
    kernel, an array scale, an empty call (which runs no kernel), options of other types
    than the direct calls' keys take: the second call of the signature takes the kept plan
    (or is planned anew), never a direct call."""
    arrays, options = call(*_tensors())
    first = sdpa_array.scaled_dot_product_attention(*arrays, **options)
    assert not cache._direct
    second = sdpa_array.scaled_dot_product_attention(*arrays, **options)
    assert not cache._direct
    pairs = zip(*(x if isinstance(x, tuple) else (x,) for x in (first, second)), strict=True)
    for a, b in pairs:
        assert bool((a == b).all())


def test_options_at_other_values_skip_the_direct_lookup(direct_lookups):
    """The public forward looks a direct call up only where every option but
    ``is_causal``, ``scale`` and ``enable_gqa`` has its default, the output alone is asked
    for and the layout is heads-first: each other keyword, at a value other than its
    default, calls the planner (whether the call is then valid or not). A ``"BLHE"``
    layout is computed as the heads-first call of the arrays' transposed views."""
    torch = pytest.importorskip("torch")
    q, k, v = _tensors()
    sdpa_array.scaled_dot_product_attention(q, k, v)
    assert len(direct_lookups) == 1  # the defaults look it up
    parameters = inspect.signature(sdpa_array.scaled_dot_product_attention).parameters
    looked_up = {"query", "key", "value", "is_causal", "scale", "enable_gqa", "implementation"}
    others = {
        "mask": q.new_ones((6, 6), dtype=torch.bool),
        "bias": q.new_zeros((6, 6)),
        "window": (2, 0),
        "alignment": "bottom_right",
        "softcap": 5.0,
        "query_lengths": 3,
        "key_lengths": 3,
        "padding_side": "left",
        "segment_ids": (q.new_zeros((2, 6), dtype=torch.int64),) * 2,
        "sinks": q.new_zeros(4),
        "dropout_p": 0.1,
        "dropout_seed": 3,
        "mask_mod": sdpa_array.mods.causal(),
        "bias_mod": lambda b, h, i, j: (i - j) * 0.0,
        "score_mod": lambda s, b, h, i, j: s,
        "return_weights": True,
        "return_lse": True,
        "return_max_scores": True,
        "block_q": 2,
        "block_k": 2,
    }
    # a "BLHE" call is the heads-first call of its transposed views, which may be direct
    assert set(parameters) - looked_up == {*others, "layout"}
    for name, value in others.items():
        # e.g. a dropout probability without a seed: the planner says so
        with contextlib.suppress(TypeError, ValueError):
            sdpa_array.scaled_dot_product_attention(q, k, v, **{name: value})
        assert len(direct_lookups) == 1, name


def test_a_direct_call_follows_the_grad_mode_and_clear_forgets_it(validations):
    """A call kept under ``torch.no_grad`` runs directly with gradients on (torch's own
    function records its graph, as the planned call's does); :func:`cache.clear` forgets
    the direct calls with the plans."""
    torch = pytest.importorskip("torch")
    q, k, v = (a.requires_grad_() for a in _tensors())
    with torch.no_grad():
        quiet = sdpa_array.scaled_dot_product_attention(q, k, v)
    assert quiet.grad_fn is None
    assert cache._direct
    out = sdpa_array.scaled_dot_product_attention(q, k, v)
    assert len(validations) == 1
    assert out.grad_fn is not None
    assert bool((out.detach() == quiet).all())
    cache.clear()
    assert not cache._direct
    sdpa_array.scaled_dot_product_attention(q, k, v)
    assert len(validations) == 2
