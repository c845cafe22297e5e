"""Variable lengths and packed documents: ``query_lengths``, ``key_lengths``, ``segment_ids``.

* every feature on every path (:mod:`tests.paths`), backend and dtype against the oracle
  (whose own index arithmetic is checked in ``tests/test_reference_features.py``), alone and
  combined with causal (both alignments), window, GQA, softcap, mask and bias, within the
  derived bounds;
* hypothesis over lengths (0 and full included) and segment layouts (one segment, one per
  token, random);
* gradients (VJP, torch autograd and ``jax.grad``), exactly zero for padded queries and
  excluded keys;
* lengths given as Python ints, NumPy arrays or the inputs' own arrays; lazy and traced
  values (clipped, not checked); the tiles a packed batch skips;
* bad input for every new argument.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import sdpa_array
from sdpa_array._kernels.native import Request, plan_native
from sdpa_array._kernels.operands import prepare
from sdpa_array._kernels.restrictions import TileKind
from sdpa_array._kernels.tiling import plan_blocks
from sdpa_array._problem.options import Options
from sdpa_array._problem.problem import Inputs, validate
from sdpa_array.testing import assert_close_to_oracle, assert_vjp_close_to_oracle
from tests.helpers import as_checked
from tests.paths import FeatureCase, check_on_path

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

# One set of shapes for most cases, so that JAX compiles once per implementation.
B, H, L, S, E = 3, 2, 6, 7, 4
Q, KV = (B, H, L, E), (B, H, S, E)
Q_LENGTHS = np.array([6, 0, 3])
K_LENGTHS = np.array([7, 2, 0])
Q_SEGMENTS = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0], [3, 3, 5, 5, 5, 9]])
K_SEGMENTS = np.array([[0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0], [3, 5, 5, 5, 5, 7, 9]])


# (id, sequence options, other options, mask shape, bias shape)
CASES = [
    ("lengths", {"query_lengths": Q_LENGTHS, "key_lengths": K_LENGTHS}, {}, None, None),
    ("query-lengths-int", {"query_lengths": 4}, {}, None, None),
    ("key-lengths-0d", {"key_lengths": np.asarray(5)}, {"is_causal": True}, None, None),
    (
        "lengths-causal-top-left",
        {"query_lengths": Q_LENGTHS, "key_lengths": K_LENGTHS},
        {"is_causal": True},
        None,
        None,
    ),
    (
        "lengths-causal-bottom-right",
        {"query_lengths": np.array([2, 6, 1]), "key_lengths": np.array([7, 6, 3])},
        {"is_causal": True, "alignment": "bottom_right"},
        None,
        None,
    ),
    (
        "lengths-window-bottom-right",
        {"query_lengths": np.array([2, 6, 1]), "key_lengths": np.array([7, 6, 3])},
        {"window": (2, 1), "alignment": "bottom_right"},
        None,
        None,
    ),
    ("segments", {"segment_ids": (Q_SEGMENTS, K_SEGMENTS)}, {}, None, None),
    (
        "segments-causal-lengths",
        {"segment_ids": (Q_SEGMENTS, K_SEGMENTS), "key_lengths": K_LENGTHS},
        {"is_causal": True},
        None,
        None,
    ),
    (
        "segments-softcap-bias-mask",
        {"segment_ids": (Q_SEGMENTS[:1], K_SEGMENTS[:1])},
        {"softcap": 2.5},
        (B, 1, L, S),
        (H, L, S),
    ),
]


def _arrays(backend, dtype, q_shape=Q, kv_shape=KV, seed=0):
    rng = np.random.default_rng(seed)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    return tuple(backend.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _terms(backend, dtype, mask_shape, bias_shape, seed=1):
    rng = np.random.default_rng(seed)
    mask = None if mask_shape is None else backend.asarray(rng.random(mask_shape) < 0.8)
    bias = None if bias_shape is None else backend.asarray(rng.standard_normal(bias_shape), dtype)
    return mask, bias


def _on(backend, sequences):
    """The sequence options with every array put on ``backend`` (ints stay ints)."""

    def put(x):
        return backend.asarray(x, "int64") if isinstance(x, np.ndarray) else x

    return {
        name: tuple(put(a) for a in value) if name == "segment_ids" else put(value)
        for name, value in sequences.items()
    }


def _path_case(case_id, sequences, options, mask_shape, bias_shape):
    rng = np.random.default_rng(1)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.8
    bias = None if bias_shape is None else rng.standard_normal(bias_shape)
    terms = {name: x for name, x in (("mask", mask), ("bias", bias)) if x is not None}
    return FeatureCase(case_id, Q, KV, KV, {**sequences, **options, **terms})


PATH_CASES = [_path_case(*c) for c in CASES]


def test_on_every_path(path_case):
    """Output, log-sum-exp and gradients on every path (:mod:`tests.paths`) against the
    oracle."""
    check_on_path(path_case)


def test_gqa_with_lengths_and_segments(backend):
    q, _, _, g = _arrays(backend, "float32", q_shape=(B, 4, L, E))
    _, k, v, _ = _arrays(backend, "float32")
    kw = _on(
        backend,
        {
            "query_lengths": Q_LENGTHS,
            "key_lengths": K_LENGTHS,
            "segment_ids": (Q_SEGMENTS, K_SEGMENTS),
        },
    )
    kw |= {"enable_gqa": True, "is_causal": True, "alignment": "bottom_right"}
    for implementation in ("materialized", "blocked"):
        run = {"implementation": implementation, **kw}
        out = sdpa_array.scaled_dot_product_attention(q, k, v, **run)
        assert_close_to_oracle(out, q, k, v, **as_checked(q, k, v, run))
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
        assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, run, vjp=True))


def _as_numpy(x):
    return np.asarray(sdpa_array.reference.to_numpy(x))


def test_padding_is_exactly_zero(backend):
    q, k, v, g = _arrays(backend, "float32")
    kw = _on(backend, {"query_lengths": Q_LENGTHS, "key_lengths": K_LENGTHS})
    for implementation in ("materialized", "blocked"):
        out, lse = sdpa_array.scaled_dot_product_attention(
            q, k, v, return_lse=True, implementation=implementation, **kw
        )
        dq, dk, dv = sdpa_array.scaled_dot_product_attention_vjp(
            q, k, v, g, implementation=implementation, **kw
        )
        out, lse, dq, dk, dv = (_as_numpy(a) for a in (out, lse, dq, dk, dv))
        for b in range(B):
            # sequence 2 has no keys at all: every one of its rows is empty
            ql = Q_LENGTHS[b] if K_LENGTHS[b] else 0
            assert np.all(out[b, :, ql:] == 0)
            assert np.all(dq[b, :, ql:] == 0)
            assert np.all(lse[b, :, ql:] == -np.inf)
            assert np.all(dk[b, :, K_LENGTHS[b] :] == 0)
            assert np.all(dv[b, :, K_LENGTHS[b] :] == 0)
            if ql == 0:
                assert np.all(dk[b] == 0)
                assert np.all(dv[b] == 0)


@st.composite
def _sequence_case(draw):
    qn = draw(st.lists(st.integers(0, L), min_size=B, max_size=B))
    kn = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
    layout = draw(st.sampled_from(["none", "one", "per-token", "random"]))
    options = {}
    if draw(st.booleans()):
        options["is_causal"] = True
    if draw(st.booleans()):
        options["alignment"] = "bottom_right"
    if draw(st.booleans()):
        options["window"] = (draw(st.integers(0, 3)), draw(st.none() | st.integers(0, 3)))
    seq = {"query_lengths": np.array(qn), "key_lengths": np.array(kn)}
    if layout == "one":
        seq["segment_ids"] = (np.zeros((B, L), np.int64), np.zeros((B, S), np.int64))
    elif layout == "per-token":
        seq["segment_ids"] = (np.arange(L)[None].repeat(B, 0), np.arange(S)[None].repeat(B, 0))
    elif layout == "random":
        ids = st.integers(0, 2)
        qs = draw(st.lists(ids, min_size=B * L, max_size=B * L))
        ks = draw(st.lists(ids, min_size=B * S, max_size=B * S))
        seq["segment_ids"] = (np.sort(np.reshape(qs, (B, L))), np.sort(np.reshape(ks, (B, S))))
    blocks = draw(st.sampled_from([{}, {"block_q": 2, "block_k": 3}, {"block_q": 4, "block_k": 2}]))
    return seq, options, blocks


@hypothesis.given(case=_sequence_case())
def test_hypothesis_lengths_and_segments(backend, case):
    sequences, options, blocks = case
    q, k, v, g = _arrays(backend, "float32")
    kw = {**_on(backend, sequences), **options}
    run = {"implementation": "blocked", **blocks, **kw}
    out = sdpa_array.scaled_dot_product_attention(q, k, v, **run)
    assert_close_to_oracle(out, q, k, v, **as_checked(q, k, v, run))
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, run, vjp=True))


def _autograd(backend, f, args):
    if backend.library == "torch":
        import torch

        leaves = [a.detach().requires_grad_(True) for a in args]
        return tuple(torch.autograd.grad(f(*leaves), leaves))
    import jax

    return tuple(jax.grad(f, argnums=tuple(range(len(args))))(*args))


@pytest.mark.parametrize("implementation", ["auto", "materialized", "blocked"])
def test_autograd(autograd_backend, implementation):
    q, k, v, g = _arrays(autograd_backend, "float32")
    kw = _on(
        autograd_backend,
        {
            "query_lengths": Q_LENGTHS,
            "key_lengths": K_LENGTHS,
            "segment_ids": (Q_SEGMENTS, K_SEGMENTS),
        },
    )
    kw["is_causal"] = True

    def loss(q, k, v):
        out = sdpa_array.scaled_dot_product_attention(q, k, v, implementation=implementation, **kw)
        return (out * g).sum()

    grads = _autograd(autograd_backend, loss, (q, k, v))
    run = {"implementation": implementation, **kw}
    assert_vjp_close_to_oracle(grads, q, k, v, g, **as_checked(q, k, v, run, vjp=True))


def test_jax_jit_with_traced_lengths(jax_backend):
    """Traced lengths cannot be read: they are clipped to [0, L] / [0, S] instead of checked."""
    import jax

    q, k, v, _g = _arrays(jax_backend, "float32")
    ql, kl = (jax_backend.asarray(a, "int64") for a in (Q_LENGTHS, K_LENGTHS))

    @jax.jit
    def run(q, k, v, ql, kl):
        return sdpa_array.scaled_dot_product_attention(
            q, k, v, query_lengths=ql, key_lengths=kl, implementation="blocked"
        )

    assert_close_to_oracle(run(q, k, v, ql, kl), q, k, v, query_lengths=ql, key_lengths=kl)
    too_long = jax_backend.asarray(np.array([99, 99, 99]), "int64")
    clipped = run(q, k, v, too_long, kl)
    assert_close_to_oracle(clipped, q, k, v, key_lengths=kl)


def test_lazy_dask_lengths_stay_lazy(dask_backend):
    import dask.array as da

    q, k, v, _ = _arrays(dask_backend, "float32")
    kw = _on(dask_backend, {"key_lengths": K_LENGTHS, "segment_ids": (Q_SEGMENTS, K_SEGMENTS)})
    out = sdpa_array.scaled_dot_product_attention(q, k, v, implementation="blocked", **kw)
    assert isinstance(out, da.Array)
    assert_close_to_oracle(out, q, k, v, **kw)


def test_native_refuses_segment_ids_and_auto_falls_back(native_backend):
    q, k, v, _ = _arrays(native_backend, "float32")
    ids = (np.array([0, 0, 1, 1, 1, 2]), np.array([0, 1, 1, 1, 2, 2, 2]))
    with pytest.raises(sdpa_array.CannotDelegateError, match="segment ids"):
        sdpa_array.scaled_dot_product_attention(q, k, v, segment_ids=ids, implementation="native")
    out = sdpa_array.scaled_dot_product_attention(q, k, v, segment_ids=ids)
    assert_close_to_oracle(out, q, k, v, segment_ids=ids)


#: (padding_side, alignment, is_causal, window, L): the calls whose lengths torch's CPU
#: flash kernel takes as a key mask beside its own is_causal, or (windows, a diagonal
#: off the top left) inside a positional mask built for the call.
CPU_FLASH_LENGTHS = [
    ("right", "top_left", False, None, L),
    ("right", "top_left", True, None, L),
    ("right", "top_left", True, (2, 0), L),
    ("right", "bottom_right", False, None, L),
    ("left", "bottom_right", True, None, S),
    ("left", "bottom_right", True, None, L),
    ("left", "bottom_right", False, (1, 1), L),
    ("left", "top_left", False, None, L),
]


@pytest.mark.parametrize(("side", "alignment", "causal", "window", "n_q"), CPU_FLASH_LENGTHS)
def test_torch_cpu_flash_takes_lengths(torch_cpu_backend, side, alignment, causal, window, n_q):
    """Lengths on torch's CPU flash kernel: output, log-sum-exp (-inf for rows with no
    key), autograd through it and the native VJP, against the oracle; auto chooses it,
    and only a window or an off-top-left diagonal builds an (L, S) mask."""
    q, k, v, _ = _arrays(torch_cpu_backend, "float64", q_shape=(B, H, n_q, E))
    kw = dict(
        query_lengths=np.array([n_q, n_q - 1, 1]),
        key_lengths=np.array([S, 3, 0]),
        padding_side=side,
        alignment=alignment,
        is_causal=causal,
        window=window,
    )
    plan = sdpa_array.explain(q, k, v, **kw)
    assert plan.forward == "native"
    assert plan.forward_kernel == "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
    delegation = plan_native(validate(q, k, v, Options(**kw)), Request(Inputs(q, k, v)))
    off_top_left = causal and alignment == "bottom_right" and n_q != S
    assert delegation.builds_mask == (window is not None or off_top_left)
    out, lse = sdpa_array.scaled_dot_product_attention(
        q, k, v, return_lse=True, implementation="native", **kw
    )
    assert_close_to_oracle((out, lse), q, k, v, return_lse=True, **kw)
    g = torch_cpu_backend.asarray(np.random.default_rng(5).standard_normal(out.shape), "float64")
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, implementation="native", **kw)
    assert_vjp_close_to_oracle(grads, q, k, v, g, **kw)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = sdpa_array.scaled_dot_product_attention(*leaves, implementation="native", **kw)
    out.backward(g)
    assert_vjp_close_to_oracle(tuple(x.grad for x in leaves), q, k, v, g, **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(padding_side="right", alignment="bottom_right", is_causal=True), "diagonal"),
        (dict(padding_side="left", alignment="top_left", is_causal=True), "diagonal"),
        (dict(mask=np.tril(np.ones((L, S), bool))), "beside a mask"),
    ],
)
def test_lengths_the_cpu_flash_kernel_cannot_take(torch_cpu_backend, kw, match):
    q, k, v, _ = _arrays(torch_cpu_backend, "float32")
    kw = {**kw, "key_lengths": np.array([S, 3, 1])}
    if "mask" in kw:
        kw["mask"] = torch_cpu_backend.asarray(kw["mask"])
    with pytest.raises(sdpa_array.CannotDelegateError, match=match):
        sdpa_array.scaled_dot_product_attention(q, k, v, implementation="native", **kw)
    out = sdpa_array.scaled_dot_product_attention(q, k, v, **kw)
    assert_close_to_oracle(out, q, k, v, **kw)


def _planned_pairs(query, key, value, **options):
    """Score entries the blocked forward plan visits, summed over sequences and heads."""
    p = validate(query, key, value, Options(**options))
    ops = prepare(p, Inputs(query, key, value))
    total = 0
    for b in range(p.kernel_batch[0]):
        for block in plan_blocks(ops.at((b,)).restrictions, 256, 512):
            rows = block.stop - block.start
            total += sum(rows * (t.stop - t.start) for t in block.tiles) * p.kernel_batch[1]
    return total


def test_packed_documents_skip_the_tiles_between_them():
    """8 documents of 512 tokens in L = S = 4096: about 1/8 of the dense work is planned."""
    q = np.zeros((1, 2, 4096, 8), np.float32)
    ids = np.repeat(np.arange(8), 512)[None]
    dense = 2 * 4096 * 4096
    packed = _planned_pairs(q, q, q, segment_ids=(ids, ids))
    assert packed == dense // 8
    causal = _planned_pairs(q, q, q, segment_ids=(ids, ids), is_causal=True)
    assert causal <= dense // 16 + 2 * 8 * 512 * 256  # diagonal blocks at most half wasted
    lengths = _planned_pairs(q, q, q, query_lengths=1024, key_lengths=2048)
    assert lengths == 2 * 1024 * 2048


BAD = [
    ("query_lengths", 2.5, TypeError, r"query_lengths must be an int or an integer array"),
    ("query_lengths", True, TypeError, r"query_lengths must be integers, got a bool"),
    ("key_lengths", np.array([1.0, 2.0, 3.0]), TypeError, r"key_lengths must have an integer"),
    ("key_lengths", np.array([1, 2]), ValueError, r"key_lengths of shape \(2,\) does not"),
    ("query_lengths", np.array([1, 7, 2]), ValueError, r"query_lengths must lie in \[0, 6\]"),
    ("key_lengths", -1, ValueError, r"key_lengths must lie in \[0, 7\]"),
    ("segment_ids", np.zeros((B, L), np.int64), TypeError, r"segment_ids must be a pair"),
    (
        "segment_ids",
        (np.zeros((B, L)), np.zeros((B, S), np.int64)),
        TypeError,
        r"segment_ids\[0\] \(query segments\) must have an integer dtype",
    ),
    (
        "segment_ids",
        (np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)),
        ValueError,
        r"segment_ids\[1\] \(key segments\) of shape \(3, 6\) does not broadcast to \(3, 7\)",
    ),
]


@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [pytest.param(*c, id=f"{c[0]}-{i}") for i, c in enumerate(BAD)],
)
def test_bad_input(backend, name, value, error, match):
    q, k, v, g = _arrays(backend, "float32")
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention(q, k, v, **{name: value})
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **{name: value})


def test_lengths_of_another_library():
    strict = pytest.importorskip("array_api_strict")
    q, k, v, _ = _arrays(sdpa_array.testing.get_backend("numpy"), "float32")
    with pytest.raises(TypeError, match=r"key_lengths must be an int, a NumPy array or an array"):
        sdpa_array.scaled_dot_product_attention(q, k, v, key_lengths=strict.asarray([1, 2, 3]))


def test_segment_ids_of_a_sequences_heads_are_one_object_with_that_sequences_tiles():
    """The backward classifies its tiles per batch slice: the heads of one sequence share
    one restriction object (found once), and each sequence keeps its own segments."""
    seg = np.array([[0] * 6 + [1] * 10, [0] * 12 + [1] * 4], dtype=np.int32)
    q = np.zeros((2, 3, 16, 4), np.float32)
    options = Options(segment_ids=(seg, seg))
    p = validate(q, q, q, options)
    r = prepare(p, Inputs.of(q, q, q, options, p)).restrictions
    (ids,) = r.members
    assert ids.at((0, 0)) is ids.at((0, 2))
    assert ids.at((0, 0)) is not ids.at((1, 0))
    tile = (slice(0, 6), slice(6, 12))  # the first sequence's segment 0 and segment 1
    assert r.at((0, 1)).classify(*tile) is TileKind.EMPTY
    assert r.at((1, 1)).classify(*tile) is TileKind.FULL  # all of segment 0 there
    assert r.at((1, 2)).classify(slice(8, 16), slice(0, 8)) is TileKind.PARTIAL
