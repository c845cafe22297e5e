"""Mask and bias functions (``mask_mod``, ``bias_mod``) in attention and its VJP.

* the mods without data on every path (:mod:`tests.paths`) against the oracle;
* every ready-made mod of :mod:`sdpa_array.mods` against its textbook definition written out
  here as a dense ``mask``/``bias`` given to the oracle, on every backend, dtype and
  implementation (the VJP against the oracle's own evaluation of the mod);
* a document mask and ALiBi combined with causal, window, softcap, lengths, segment ids,
  dense mask and bias, with GQA, against the oracle given the same mods;
* hypothesis: random mask functions built from comparisons of indices, against the oracle;
  :func:`create_block_mask`'s classes against the dense mask (exactly);
* the blocked kernel gives the same results from a :class:`BlockMask`, from its own host
  classification and from evaluating every tile, and skips the empty tiles;
* rows the mask empties: exact zeros; autograd (torch, ``jax.jit(jax.grad)``), lazy Dask;
* errors name ``mask_mod``/``bias_mod``; native kernels refuse mods.
"""

from __future__ import annotations

import importlib
import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

import sdpa_array
from sdpa_array import create_block_mask, mods, reference
from sdpa_array._kernels import mod_terms
from sdpa_array.testing import assert_close_to_oracle, assert_vjp_close_to_oracle
from tests.helpers import ran_fused
from tests.paths import FeatureCase, check_on_path

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

B, H, HKV, L, S, E = 2, 4, 2, 6, 7, 4
Q, KV = (B, H, L, E), (B, HKV, S, E)

IMPLEMENTATIONS = [
    pytest.param("materialized", {}, id="materialized"),
    pytest.param("blocked", {}, id="blocked"),
    pytest.param("blocked", {"block_q": 2, "block_k": 3}, id="blocked-2x3"),
]

#: Segment ids of the document mask; query 5 of sequence 0 is in a document without keys.
Q_SEGMENTS = np.array([[0, 0, 0, 1, 1, 3], [0, 0, 1, 1, 1, 2]])
K_SEGMENTS = np.array([[0, 0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2]])
PREFIX = np.array([2, 4])


def _grid():
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    return i, j


def _t5_bucket(relative: int, num_buckets: int, max_distance: int) -> int:
    """T5's bidirectional bucket of ``relative = key - query``, in scalar float64 maths."""
    half = num_buckets // 2
    bucket = half if relative > 0 else 0
    n = abs(relative)
    exact = half // 2
    if n < exact:
        return bucket + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (half - exact))
    return bucket + min(large, half - 1)


def _textbook(name: str):
    """``(kind, dense)``: the mod's definition as a dense NumPy mask/bias ``(B, H, L, S)``."""
    i, j = _grid()
    if name == "causal":
        return "mask", np.broadcast_to(j <= i, (B, H, L, S))
    if name == "sliding_window":
        return "mask", np.broadcast_to((i - 2 <= j) & (j <= i + 1), (B, H, L, S))
    if name == "prefix_lm":
        m = (j[None] < PREFIX[:, None, None]) | (j <= i)[None]
        return "mask", np.broadcast_to(m[:, None], (B, H, L, S))
    if name == "document":
        m = Q_SEGMENTS[:, :, None] == K_SEGMENTS[:, None, :]
        return "mask", np.broadcast_to(m[:, None], (B, H, L, S))
    if name == "and_or":  # (causal and window(1, -)) or prefix
        window = np.broadcast_to((i - 1 <= j) & (j <= i), (B, H, L, S))
        return "mask", window | _textbook("prefix_lm")[1]
    if name == "alibi":
        slopes = 2.0 ** (-2.0 * np.arange(1, H + 1))  # 1/4, 1/16, 1/64, 1/256 for 4 heads
        bias = -slopes[:, None, None] * np.abs(i - j)
        return "bias", np.broadcast_to(bias, (B, H, L, S))
    assert name == "relative_position"
    table = _table()
    buckets = np.vectorize(lambda r: _t5_bucket(int(r), 8, 20))(j - i)
    return "bias", np.broadcast_to(table[:, buckets], (B, H, L, S))


def _table() -> np.ndarray:
    # rounded to float32, as the mod gets it on every backend
    return np.random.default_rng(11).standard_normal((H, 8)).astype(np.float32).astype(float)


class _Host:
    """Stands for a backend whose arrays are NumPy's: the mods the oracle is given (it calls
    them on NumPy indices, where lazy Dask data could not be read)."""

    @staticmethod
    def asarray(a, dtype=None):
        return np.asarray(a, dtype=dtype)


HOST = _Host()


def _mod(name: str, backend):
    """The ready-made mod, with its data as arrays of ``backend``."""
    if name == "causal":
        return mods.causal()
    if name == "sliding_window":
        return mods.sliding_window(2, 1)
    if name == "prefix_lm":
        return mods.prefix_lm(backend.asarray(PREFIX))
    if name == "document":
        return mods.document(backend.asarray(Q_SEGMENTS), backend.asarray(K_SEGMENTS))
    if name == "and_or":
        window = mods.and_masks(mods.causal(), mods.sliding_window(1, None))
        return mods.or_masks(window, mods.prefix_lm(backend.asarray(PREFIX)))
    if name == "alibi":
        return mods.alibi(backend.asarray(mods.alibi_slopes(H), "float32"))
    assert name == "relative_position"
    table = backend.asarray(_table(), "float32")
    return mods.relative_position_bias(table, num_buckets=8, max_distance=20)


MOD_NAMES = ["causal", "sliding_window", "prefix_lm", "document", "and_or", "alibi"]
MOD_NAMES += ["relative_position"]


#: The mods without data (the others hold arrays of the inputs' library, which the oracle
#: cannot be given: they have their own tests below) on every path.
PATH_CASES = [
    FeatureCase("causal", Q, KV, KV, {"mask_mod": mods.causal(), "enable_gqa": True}),
    FeatureCase(
        "sliding-window+softcap",
        Q,
        KV,
        KV,
        {"mask_mod": mods.sliding_window(2, 1), "softcap": 2.5, "enable_gqa": True},
    ),
    FeatureCase(
        "and-or+causal",
        Q,
        KV,
        KV,
        {
            "mask_mod": mods.or_masks(mods.sliding_window(0, 0), mods.sliding_window(None, 1)),
            "is_causal": True,
            "alignment": "bottom_right",
            "enable_gqa": True,
        },
    ),
]


def test_on_every_path(path_case):
    """Output, log-sum-exp and gradients on every path (:mod:`tests.paths`) against the
    oracle given the same mods."""
    check_on_path(path_case)


def _inputs(backend, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [backend.asarray(rng.standard_normal(s), dtype) for s in (Q, KV, KV, Q)]


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS)
@pytest.mark.parametrize("name", MOD_NAMES)
def test_ready_made_mods_match_their_textbook_definition(
    backend_dtype, implementation, blocks, name
):
    backend, dtype = backend_dtype
    q, k, v, g = _inputs(backend, dtype)
    kind, dense = _textbook(name)
    mod = _mod(name, backend)
    keyword = "mask_mod" if kind == "mask" else "bias_mod"
    run = {"enable_gqa": True, "implementation": implementation, **blocks, keyword: mod}
    result = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **run)
    expected_as = {"mask": np.ascontiguousarray(dense)} if kind == "mask" else {}
    if kind == "bias":
        expected_as = {"bias": np.ascontiguousarray(dense)}
    fused = ran_fused(q, k, v, run)
    assert_close_to_oracle(
        result, q, k, v, return_lse=True, enable_gqa=True, fused=fused, **expected_as
    )
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    assert len(grads) == 3
    oracle = {keyword: _mod(name, HOST), "fused": ran_fused(q, k, v, run, vjp=True)}
    assert_vjp_close_to_oracle(grads, q, k, v, g, enable_gqa=True, **oracle)


def _random_mask(shape, seed, p=0.7):
    return np.random.default_rng(seed).random(shape) < p


COMBINATIONS = [
    pytest.param({"is_causal": True, "softcap": 2.5}, id="causal-softcap"),
    pytest.param({"window": (2, 1), "alignment": "bottom_right"}, id="window-bottom-right"),
    pytest.param({"query_lengths": [6, 4], "key_lengths": [5, 7]}, id="lengths"),
    pytest.param({"segment_ids": "segments"}, id="segment-ids"),
    pytest.param({"mask": "dense", "bias": "dense"}, id="mask-bias"),
]


#: Each mask mod with a bias mod, so that every ready-made mod meets every restriction.
PAIRS = [
    pytest.param(mask, "alibi" if i % 2 else "relative_position", id=f"{mask}")
    for i, mask in enumerate(MOD_NAMES[:5])
]


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS)
@pytest.mark.parametrize("options", COMBINATIONS)
@pytest.mark.parametrize(("mask_name", "bias_name"), PAIRS)
def test_mods_combine_with_every_restriction(
    backend, implementation, blocks, options, mask_name, bias_name
):
    q, k, v, g = _inputs(backend, "float32", seed=1)
    options = dict(options, enable_gqa=True)
    if options.get("mask") == "dense":
        options["mask"] = backend.asarray(_random_mask((H, L, S), 2))
        options["bias"] = backend.asarray(
            np.random.default_rng(3).standard_normal((1, L, S)), "float32"
        )
    if options.get("segment_ids") == "segments":
        ids = np.array([[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]])
        options["segment_ids"] = (backend.asarray(ids[:, :L]), backend.asarray(ids))
    for name in ("query_lengths", "key_lengths"):
        if name in options:
            options[name] = backend.asarray(np.array(options[name]))
    mods_given = {"mask_mod": _mod(mask_name, backend), "bias_mod": _mod(bias_name, backend)}
    run = {"implementation": implementation, **blocks, **options, **mods_given}
    result = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **run)
    options.update(mask_mod=_mod(mask_name, HOST), bias_mod=_mod(bias_name, HOST))
    fused = ran_fused(q, k, v, run)
    assert_close_to_oracle(result, q, k, v, return_lse=True, fused=fused, **options)
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    fused = ran_fused(q, k, v, run, vjp=True)
    assert_vjp_close_to_oracle(grads, q, k, v, g, fused=fused, **options)


# --- random mask functions (NumPy) --------------------------------------------------------

COMPARISONS = ["<", "<=", ">", ">=", "==", "!="]
TERMS = ["q - kv", "kv", "q", "(q + kv) % 3", "h % 2 + kv", "b + q"]


def _compare(op, a, c):
    return {
        "<": a < c,
        "<=": a <= c,
        ">": a > c,
        ">=": a >= c,
        "==": a == c,
        "!=": a != c,
    }[op]


def _term(term, b, h, q, kv):
    return {
        "q - kv": q - kv,
        "kv": kv,
        "q": q,
        "(q + kv) % 3": (q + kv) % 3,
        "h % 2 + kv": h % 2 + kv,
        "b + q": b + q,
    }[term]


clauses = st.lists(
    st.tuples(st.sampled_from(TERMS), st.sampled_from(COMPARISONS), st.integers(-3, 8)),
    min_size=1,
    max_size=3,
)


def _mod_of(clause_list, combine_or):
    def mask_mod(b, h, q, kv):
        parts = [_compare(op, _term(t, b, h, q, kv), c) for t, op, c in clause_list]
        out = parts[0]
        for part in parts[1:]:
            out = (out | part) if combine_or else (out & part)
        return out

    return mask_mod


def _dense_of(clause_list, combine_or, batch, heads, n_q, n_k):
    """The same mask from explicit loops over every index."""
    out = np.zeros((batch, heads, n_q, n_k), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(n_q):
                for j in range(n_k):
                    values = [_compare(op, _term(t, b, h, i, j), c) for t, op, c in clause_list]
                    out[b, h, i, j] = any(values) if combine_or else all(values)
    return out


@given(
    clause_list=clauses,
    combine_or=st.booleans(),
    n_q=st.integers(1, 9),
    n_k=st.integers(1, 11),
    block_q=st.integers(1, 5),
    block_k=st.integers(1, 5),
)
def test_create_block_mask_classifies_blocks_exactly(
    clause_list, combine_or, n_q, n_k, block_q, block_k
):
    mod = _mod_of(clause_list, combine_or)
    bm = create_block_mask(mod, B, H, n_q, n_k, block_q=block_q, block_k=block_k)
    dense = _dense_of(clause_list, combine_or, B, H, n_q, n_k)
    kinds = np.broadcast_to(bm.kinds, (B, H, *bm.kinds.shape[2:]))
    for bi, hi, r, c in np.ndindex(kinds.shape):
        block = dense[bi, hi, r * block_q : (r + 1) * block_q, c * block_k : (c + 1) * block_k]
        want = bm.FULL if block.all() else bm.PARTIAL if block.any() else bm.EMPTY
        assert kinds[bi, hi, r, c] == want, (bi, hi, r, c)


@given(
    clause_list=clauses,
    combine_or=st.booleans(),
    blocks=st.sampled_from([(None, None), (2, 3), (4, 2)]),
)
def test_random_mask_functions_match_the_oracle(clause_list, combine_or, blocks):
    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal(s) for s in (Q, KV, KV, Q))
    mod = _mod_of(clause_list, combine_or)
    dense = _dense_of(clause_list, combine_or, B, H, L, S)
    for implementation in ("materialized", "blocked"):
        sizes = dict(zip(("block_q", "block_k"), blocks, strict=True))
        run = {"enable_gqa": True, "mask_mod": mod, "implementation": implementation}
        if implementation == "blocked":
            run.update(sizes)
        result = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **run)
        assert_close_to_oracle(result, q, k, v, return_lse=True, enable_gqa=True, mask=dense)
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
        assert_vjp_close_to_oracle(grads, q, k, v, g, enable_gqa=True, mask=dense)


# --- block classes: given, built on the host, or none ---------------------------------------


def _document_mod(calls=None):
    """Documents of 16 tokens, written with index arithmetic only (computes on NumPy)."""

    def document(b, h, q, kv):
        if calls is not None:
            calls.append(tuple(q.shape))
        return q // 16 == kv // 16

    return document


def test_blocked_kernel_skips_the_blocks_the_classes_empty(monkeypatch):
    rng = np.random.default_rng(5)
    n = 64
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for _ in range(3))
    dense = (np.arange(n)[:, None] // 16) == (np.arange(n)[None, :] // 16)
    evaluated = []
    original = mod_terms.ModIndices.call

    def spy(self, name, mod, rows, cols):
        evaluated.append((rows.start, rows.stop, cols.start, cols.stop))
        return original(self, name, mod, rows, cols)

    monkeypatch.setattr(mod_terms.ModIndices, "call", spy)
    sizes = {"implementation": "blocked", "block_q": 8, "block_k": 8}
    given = create_block_mask(_document_mod(), None, None, n, n, block_q=8, block_k=8)
    results = {}
    for label, mod in (("given", given), ("host", _document_mod())):
        evaluated.clear()
        results[label] = sdpa_array.scaled_dot_product_attention(q, k, v, mask_mod=mod, **sizes)
        # 16-token documents on 8x8 tiles: every tile is empty or full, none is evaluated
        assert evaluated == [], label
    monkeypatch.setattr(mod_terms, "classify_on_host", lambda *args: None)
    monkeypatch.setattr(mod_terms, "classify_in", lambda *args: None)
    evaluated.clear()
    results["per tile"] = sdpa_array.scaled_dot_product_attention(
        q, k, v, mask_mod=_document_mod(), **sizes
    )
    assert len(evaluated) == (n // 8) ** 2  # no classes: every tile evaluated and masked
    for label, out in results.items():
        assert_close_to_oracle(out, q, k, v, mask=dense)
        np.testing.assert_allclose(out, results["per tile"], rtol=1e-12, atol=1e-15, err_msg=label)


def _library_where(backend):
    """``where`` of the inputs' own library (not array-api-compat's wrapper): torch's,
    ``jax.numpy``'s, array-api-strict's, NumPy's, CuPy's."""
    module = importlib.import_module(
        {"torch": "torch", "jax": "jax.numpy", "strict": "array_api_strict"}.get(
            backend.library, backend.library
        )
    )
    return module.where


def test_user_mods_receive_the_inputs_library_and_still_skip_tiles(eager_backend):
    """A user's mask function is called only with index arrays of the inputs' library and
    device, here one written with that library's own ``where`` (it fails on any other
    library's arrays); off a GPU its blocks are still classified (in that library), so the
    blocked kernel evaluates only the partial tiles: a causal mask on 16 x 16 tiles of a
    32 x 32 grid has two partial tiles, one full and one empty."""
    backend = eager_backend
    where = _library_where(backend)
    rng = np.random.default_rng(7)
    q, k, v = (backend.asarray(rng.standard_normal((1, 2, 32, 4)), "float32") for _ in "qkv")
    seen = []

    def causal(b, h, q_idx, kv_idx):
        seen.append((type(q_idx), sdpa_array._arrays.compat.device(q_idx)))
        return where(kv_idx <= q_idx, kv_idx >= 0, kv_idx < 0)

    evaluated = []
    original = mod_terms.ModIndices.call

    def spy(self, name, mod, rows, cols):
        evaluated.append((rows.start, cols.start))
        return original(self, name, mod, rows, cols)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(mod_terms.ModIndices, "call", spy)
        run = {"implementation": "blocked", "block_q": 16, "block_k": 16}
        out = sdpa_array.scaled_dot_product_attention(q, k, v, mask_mod=causal, **run)
    assert_close_to_oracle(out, q, k, v, is_causal=True)
    assert seen
    assert {t for t, _ in seen} == {type(q)}
    # a list, not a set: CuPy's devices are not hashable
    assert all(d == sdpa_array._arrays.compat.device(q) for _, d in seen)
    on_gpu = backend.device == "cuda"  # there the classes are not read back: all evaluated
    every = [(0, 0), (0, 16), (16, 0), (16, 16)]
    assert sorted(evaluated) == (every if on_gpu else [(0, 0), (16, 16)])


def test_block_mask_with_other_blocks_than_the_kernel(backend):
    q, k, v, g = _inputs(backend, "float32", seed=6)
    bm = create_block_mask(
        mods.document(Q_SEGMENTS, K_SEGMENTS), B, None, L, S, block_q=4, block_k=2
    )
    assert bm.kinds.shape == (B, 1, 2, 4)
    run = {"enable_gqa": True, "implementation": "blocked", "block_q": 3, "block_k": 3}
    out = sdpa_array.scaled_dot_product_attention(q, k, v, mask_mod=bm, **run)
    assert_close_to_oracle(out, q, k, v, enable_gqa=True, mask_mod=_mod("document", HOST))
    grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, mask_mod=bm, **run)
    assert_vjp_close_to_oracle(grads, q, k, v, g, enable_gqa=True, mask_mod=_mod("document", HOST))


@pytest.mark.parametrize(("implementation", "blocks"), IMPLEMENTATIONS)
def test_rows_the_mask_empties_are_exact_zeros(eager_backend, implementation, blocks):
    q, k, v, g = _inputs(eager_backend, "float32", seed=7)
    run = {"enable_gqa": True, "implementation": implementation, **blocks}
    run["mask_mod"] = _mod("document", eager_backend)
    out, lse = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **run)
    dq = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)[0]
    out, lse, dq = (reference.to_numpy(a) for a in (out, lse, dq))
    assert np.all(out[0, :, 5] == 0)
    assert np.all(dq[0, :, 5] == 0)
    assert np.all(lse[0, :, 5] == -np.inf)


# --- compositions ---------------------------------------------------------------------------


def test_torch_autograd_reaches_query_key_value(torch_backend):
    import torch

    q, k, v, g = _inputs(torch_backend, "float64", seed=8)
    run = {"enable_gqa": True, "mask_mod": _mod("document", torch_backend)}
    run["bias_mod"] = _mod("alibi", torch_backend)
    leaves = [a.clone().requires_grad_(True) for a in (q, k, v)]
    out = sdpa_array.scaled_dot_product_attention(*leaves, **run)
    got = torch.autograd.grad((out * g).sum(), leaves)
    expected = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *a: sdpa_array.scaled_dot_product_attention(*a, **run), leaves
    )


def test_jax_grad_under_jit(jax_backend):
    import jax

    q, k, v, g = _inputs(jax_backend, "float32", seed=9)
    segments = (jax_backend.asarray(Q_SEGMENTS), jax_backend.asarray(K_SEGMENTS))

    def loss(q, k, v, q_seg, k_seg):  # the segment ids are traced inside the mod
        run = {"enable_gqa": True, "mask_mod": mods.document(q_seg, k_seg)}
        run["bias_mod"] = _mod("alibi", jax_backend)
        return (sdpa_array.scaled_dot_product_attention(q, k, v, **run) * g).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, *segments)
    options = {"enable_gqa": True, "mask_mod": _mod("document", HOST)}
    options["bias_mod"] = _mod("alibi", HOST)
    assert_vjp_close_to_oracle(grads, q, k, v, g, **options)


def test_dask_stays_lazy(dask_backend):
    q, k, v, _ = _inputs(dask_backend, "float32", seed=10)
    run = {"enable_gqa": True, "mask_mod": _mod("document", dask_backend)}
    run["bias_mod"] = _mod("alibi", dask_backend)
    out = sdpa_array.scaled_dot_product_attention(q, k, v, **run)
    assert type(out).__module__.startswith("dask")
    oracle = {"enable_gqa": True, "mask_mod": _mod("document", HOST)}
    assert_close_to_oracle(out, q, k, v, bias_mod=_mod("alibi", HOST), **oracle)


def test_native_refuses_mods(native_backend):
    q, k, v, _ = _inputs(native_backend, "float32")
    for keyword, name in (("mask_mod", "document"), ("bias_mod", "alibi")):
        with pytest.raises(sdpa_array.CannotDelegateError, match="mask_mod/bias_mod"):
            sdpa_array.scaled_dot_product_attention(
                q,
                k,
                v,
                enable_gqa=True,
                implementation="native",
                **{keyword: _mod(name, native_backend)},
            )


# --- errors ---------------------------------------------------------------------------------


def _raises(b, h, q, kv):
    raise RuntimeError("boom")


BAD_MODS = [
    pytest.param("mask_mod", 3, TypeError, "mask_mod must be a callable", id="not-callable"),
    pytest.param(
        "mask_mod", _raises, ValueError, "mask_mod _raises raised RuntimeError: boom", id="raises"
    ),
    pytest.param(
        "mask_mod", lambda b, h, q, kv: q - kv, TypeError, "mask_mod .* boolean", id="int-mask"
    ),
    pytest.param(
        "bias_mod",
        lambda b, h, q, kv: q > kv,
        TypeError,
        "bias_mod .* real floating",
        id="bool-bias",
    ),
    pytest.param(
        "mask_mod",
        lambda b, h, q, kv: True,
        TypeError,
        "mask_mod .* must return an array",
        id="python-bool",
    ),
    pytest.param(
        "bias_mod",
        lambda b, h, q, kv: np.zeros((3,)),
        (TypeError, ValueError),
        "bias_mod",
        id="wrong-shape",
    ),
    pytest.param(
        "bias_mod",
        create_block_mask(lambda b, h, q, kv: q >= kv, None, None, L, S),
        TypeError,
        "bias_mod must be a bias function",
        id="block-mask-as-bias",
    ),
    pytest.param(
        "mask_mod",
        create_block_mask(lambda b, h, q, kv: q >= kv, None, None, L, S + 1),
        ValueError,
        r"S=8 \(the call has 7\)",
        id="block-mask-sizes",
    ),
]


@pytest.mark.parametrize(("keyword", "mod", "error", "match"), BAD_MODS)
def test_bad_mods_raise_naming_the_argument(keyword, mod, error, match):
    q, k, v, g = (np.ones(s) for s in (Q, KV, KV, Q))
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention(q, k, v, enable_gqa=True, **{keyword: mod})
    with pytest.raises(error, match=match):
        sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, enable_gqa=True, **{keyword: mod})


def test_mod_of_another_library_raises(non_numpy_backend):
    q, k, v, _ = _inputs(non_numpy_backend, "float32")

    def numpy_mask(b, h, q_idx, kv_idx):
        return np.ones((1, 1), dtype=bool)

    with pytest.raises(TypeError, match=r"mask_mod .*it must compute with the index arrays"):
        sdpa_array.scaled_dot_product_attention(q, k, v, enable_gqa=True, mask_mod=numpy_mask)


def test_create_block_mask_rejects_bad_arguments():
    causal = mods.causal()
    with pytest.raises(ValueError, match="block_q must be at least 1"):
        create_block_mask(causal, 1, 1, 4, 4, block_q=0)
    with pytest.raises(TypeError, match="heads must be an integer"):
        create_block_mask(causal, 1, 2.0, 4, 4)
    with pytest.raises(ValueError, match=r"mask_mod .* raised"):
        create_block_mask(_raises, 1, 1, 4, 4)


def test_alibi_in_the_compute_dtype_is_the_mod_rounded(backend):
    slopes = mods.alibi_slopes(12)  # not powers of two: each slope is rounded to float32
    mod = mods.alibi(slopes)
    fast = mod.in_dtype(backend.namespace().float32)
    b = backend.asarray(np.zeros((1, 1, 1, 1), dtype=np.int64))
    h = backend.asarray(np.arange(12).reshape(1, 12, 1, 1))
    q = backend.asarray(np.arange(0, 600, 7).reshape(1, 1, -1, 1))
    kv = backend.asarray(np.arange(0, 900, 5).reshape(1, 1, 1, -1))
    got = reference.to_numpy(fast(b, h, q, kv))
    assert got.dtype == np.float32
    want = -slopes[:, None, None] * np.abs(np.arange(0, 600, 7)[:, None] - np.arange(0, 900, 5))
    # two roundings (the slope, the product) of an exact position difference
    np.testing.assert_allclose(got[0], want, rtol=2 * 2.0**-24, atol=0)
