"""``attention_with_kv_cache`` against the float64 oracle on the gathered keys, every backend.

For each sequence ``b`` the test gathers, with plain NumPy loops, the ``n_b`` attended tokens
of the caches as they must be after the call (the new tokens written at ``cache_lengths[b]
...``), and runs :func:`sdpa_array.reference.scaled_dot_product_attention` on them with
``alignment="bottom_right"`` and the caller's mask and bias cut to ``[0, n_b)``. Cache slots
that hold no token are NaN, so that reading one would show in the output, and the caches
after the call must hold exactly the new tokens there and be unchanged elsewhere.

Error bound
-----------
The function attends disjoint parts of each sequence's keys with the library's own attention
and merges them with :func:`sdpa_array.merge_attention_states`, whose bound
``tests/test_merge.py`` derives: the merge is attention over the parts with the parts'
log-sum-exps as scores and their outputs as values. The parts are not known to the test, so
the bound holds for any split of sequence ``b``'s keys, with ``u_c`` the unit roundoff of the
compute dtype:

* every part is a call of the main function on at most ``n_b`` admissible keys (excluded keys
  give exact zeros, which add no rounding), so its output and log-sum-exp are off by at most
  ``e_out = output_bound(S=n_b, ds, v_max, out_max=v_max)`` and ``e_lse = lse_bound(S=n_b,
  ds, lse_max=z_max + log n_b)``: ``ds`` is the score error over ``b``'s keys
  (:func:`~sdpa_array.testing.bounds.score_error`), ``z_max`` the largest admissible final
  score in magnitude, and a part's log-sum-exp lies in ``[min z, max z + log n_b]``;
* a part without admissible key has ``lse = -inf`` and weight exactly 0, so at most ``n_b``
  parts count; the merge's score error is ``ds_merge = e_lse + 2 u_c (z_max + log n_b)``
  and its values (the parts' outputs) are at most ``v_max + e_out`` in magnitude;

hence ``|out - out*| <= e_out + output_bound(S=n_b, ds=ds_merge, v_max=v_max + e_out,
out_max=max|out*|)`` and ``|lse - lse*| <= lse_bound(S=n_b, ds=ds_merge,
lse_max=max|lse*|)``; a row with no admissible key must be exactly zero with ``lse = -inf``.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdpa_array import reference
from sdpa_array._api.kv_cache import attention_with_kv_cache
from sdpa_array._api.kv_cache import chunks as kv_chunks
from sdpa_array._arrays.compat import array_namespace
from sdpa_array.testing import Backend
from tests.helpers import (
    UNIT_ROUNDOFF,
    assert_array_like,
    assert_close,
    compute_dtype,
    lse_bound,
    output_bound,
    score_error,
)

#: JAX compiles every new shape and Dask builds a graph per call: on them these cases run in
#: `nox -s tests-slow` (CI runs it).
pytestmark = pytest.mark.slow_on("jax", "dask")

# Shared shapes, so that every configuration reuses JAX's compiled operations.
B, HQ, L, E, EV = 3, 4, 2, 8, 6
PAGE, MAX_PAGES, SPARE = 4, 4, 2
T = PAGE * MAX_PAGES

#: Libraries that write the new tokens into the caller's (writable) caches.
IN_PLACE = frozenset({"numpy", "array_api_strict", "torch", "cupy"})


@dataclass(frozen=True)
class Case:
    """Host float64 data of one call: caches with NaN in every slot that holds no token."""

    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    lengths: list[int]
    new_key: np.ndarray | None
    new_value: np.ndarray | None
    table: np.ndarray | None  # None: contiguous
    page_size: int
    starts: list[int] | None = None  # cache_leftpad: the slots before stay NaN

    @property
    def capacity(self) -> int:
        if self.table is None:
            return int(self.key_cache.shape[2])
        return int(self.table.shape[1]) * self.page_size

    def slot(self, b: int, t: int) -> tuple[int, int]:
        """(page or sequence, row) of sequence b's token t."""
        if self.table is None:
            return b, t
        return int(self.table[b, t // self.page_size]), t % self.page_size


def make_case(
    seed: str,
    *,
    lengths: list[int],
    new: bool,
    paged: bool,
    heads_kv: int = 2,
    page_size: int = PAGE,
    max_pages: int = MAX_PAGES,
    spare: int = SPARE,
    order: list[int] | None = None,
    n_query: int = L,
    starts: list[int] | None = None,
) -> Case:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    b_count = len(lengths)
    if paged:
        pages = b_count * max_pages + spare
        perm = np.asarray(order if order is not None else rng.permutation(pages))
        table = perm[: b_count * max_pages].reshape(b_count, max_pages)
        shape = (pages, heads_kv, page_size)
    else:
        table, shape = None, (b_count, heads_kv, page_size * max_pages)
    k = np.full((*shape, E), np.nan)
    v = np.full((*shape, EV), np.nan)
    case = Case(
        rng.standard_normal((b_count, HQ, n_query, E)) * 1.5,
        k,
        v,
        lengths,
        rng.standard_normal((b_count, heads_kv, n_query, E)) if new else None,
        rng.standard_normal((b_count, heads_kv, n_query, EV)) if new else None,
        table,
        page_size,
        starts,
    )
    for b, n in enumerate(lengths):
        for t in range(0 if starts is None else starts[b], n):
            page, row = case.slot(b, t)
            k[page, :, row] = rng.standard_normal((heads_kv, E))
            v[page, :, row] = rng.standard_normal((heads_kv, EV))
    return case


def host(x: Any) -> np.ndarray:
    return reference.to_numpy(x).astype(np.float64)


def written(case: Case, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The caches (host, rounded values) as they must be after the call."""
    k, v = k.copy(), v.copy()
    if case.new_key is not None:
        nk, nv = case.new_key, case.new_value
        for b, n in enumerate(case.lengths):
            for i in range(nk.shape[2]):
                page, row = case.slot(b, n + i)
                k[page, :, row] = nk[b, :, i]
                v[page, :, row] = nv[b, :, i]  # type: ignore[index]
    return k, v


def gathered(case: Case, cache: np.ndarray, b: int, n: int) -> np.ndarray:
    """Sequence b's tokens [0, n) of ``cache``, (Hkv, n, X), one token at a time."""
    tokens = [cache[case.slot(b, t)[0], :, case.slot(b, t)[1]] for t in range(n)]
    if not tokens:
        return np.zeros((cache.shape[1], 0, cache.shape[3]))
    return np.stack(tokens, axis=1)


def term_of(case: Case, term: np.ndarray | None, b: int, n: int) -> np.ndarray | None:
    """The caller's 4-D mask or bias for sequence b's first n tokens, (Hq, L, n)."""
    if term is None:
        return None
    full = (len(case.lengths), HQ, case.query.shape[2], case.capacity)
    return np.broadcast_to(term, full)[b, ..., :n]


def check_against_oracle(
    case: Case,
    out: Any,
    lse: Any,
    k_after: np.ndarray,
    v_after: np.ndarray,
    q64: np.ndarray,
    dtype: str,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    options: dict[str, Any],
) -> None:
    """Every sequence's output and log-sum-exp within the module docstring's bound."""
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    out64 = host(out)
    lse64 = None if lse is None else host(lse)
    E_q = q64.shape[-1]
    scale = options.get("scale", 1.0 / math.sqrt(E_q))
    n_query = q64.shape[2]
    for b, length in enumerate(case.lengths):
        n = length + (n_query if case.new_key is not None else 0)
        keys, vals = gathered(case, k_after, b, n), gathered(case, v_after, b, n)
        m, bi = term_of(case, mask, b, n), term_of(case, bias, b, n)
        kwargs = dict(options, alignment="bottom_right", mask=m, bias=bi)
        if case.starts is not None:  # the oracle's left padding: the last n - start keys
            first = case.starts[b]
            assert np.isnan(keys[:, :first]).all(), "the padding slots hold NaN"
            keys, vals = np.nan_to_num(keys), np.nan_to_num(vals)
            kwargs.update(key_lengths=n - first, padding_side="left")
        ref_out, ref_lse = reference.scaled_dot_product_attention(
            q64[b], keys, vals, return_lse=True, **kwargs
        )
        z = reference.intermediates(q64[b], keys, vals, **kwargs)["z"]
        finite_z = np.abs(z[np.isfinite(z)])
        z_max = float(finite_z.max()) if finite_z.size else 0.0
        s = max(n, 1)
        ds = score_error(dtype, q64[b], keys, scale, bi, options.get("softcap"))
        v_max = float(np.max(np.abs(vals))) if vals.size else 0.0
        e_out = output_bound(dtype, S=s, ds=ds, v_max=v_max, out_max=v_max)
        e_lse = lse_bound(dtype, S=s, ds=ds, lse_max=z_max + math.log(s))
        ds_merge = e_lse + 2 * u_c * (z_max + math.log(s))
        out_max = float(np.max(np.abs(ref_out))) if ref_out.size else 0.0
        bound = e_out + output_bound(dtype, S=s, ds=ds_merge, v_max=v_max + e_out, out_max=out_max)
        assert_close(out64[b], ref_out, bound, f"out[{b}]")
        dead = ref_lse == -np.inf
        assert np.all(out64[b][dead] == 0), f"out[{b}]: a row with no key is not zero"
        if lse64 is not None:
            finite = np.abs(ref_lse[np.isfinite(ref_lse)])
            lse_max = float(finite.max()) if finite.size else 0.0
            bound = lse_bound(dtype, S=s, ds=ds_merge, lse_max=lse_max)
            assert_close(lse64[b], ref_lse, bound, f"lse[{b}]")


def run(
    backend: Backend,
    dtype: str,
    case: Case,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    lengths_as: str = "list",
    **options: Any,
) -> tuple[Any, ...]:
    """Call the function on ``backend`` and check everything: the result against the
    oracle, the caches' contents, and whether they were written in place. With
    ``layout="BLHE"`` the arrays are given with their length and heads axes swapped (as
    contiguous arrays) and the results are checked swapped back."""
    blhe = options.get("layout") == "BLHE"

    def given(a: np.ndarray) -> Any:
        return backend.asarray(np.ascontiguousarray(np.swapaxes(a, 1, 2)) if blhe else a, dtype)

    def heads_first(x: Any) -> np.ndarray:
        return np.swapaxes(host(x), 1, 2) if blhe else host(x)

    xq, xk, xv = (given(a) for a in (case.query, case.key_cache, case.value_cache))
    new = [None if a is None else given(a) for a in (case.new_key, case.new_value)]
    k_before, v_before = heads_first(xk), heads_first(xv)
    lengths: Any = case.lengths
    table: Any = case.table
    starts: Any = case.starts
    if lengths_as == "array":  # integer arrays of the inputs' library
        lengths = backend.asarray(np.asarray(case.lengths, dtype=np.int64))
        table = None if table is None else backend.asarray(table)
        starts = None if starts is None else backend.asarray(np.asarray(starts, np.int64))
    xmask = None if mask is None else backend.asarray(mask)
    xbias = None if bias is None else backend.asarray(bias, dtype)
    result = attention_with_kv_cache(
        xq,
        xk,
        xv,
        cache_lengths=lengths,
        cache_leftpad=starts,
        new_key=new[0],
        new_value=new[1],
        block_table=table,
        mask=xmask,
        bias=xbias,
        **options,
    )
    return_lse = options.get("return_lse", False)
    assert len(result) == (4 if return_lse else 3)
    out, k_ret, v_ret = result[0], result[-2], result[-1]
    lse = result[1] if return_lse else None
    n_query = case.query.shape[2]
    shape = (len(case.lengths), n_query, HQ, EV) if blhe else (len(case.lengths), HQ, n_query, EV)
    assert_array_like(out, xq, shape=shape, dtype=xq.dtype)
    if lse is not None:
        lse_dtype = getattr(array_namespace({"query": xq}), compute_dtype(dtype))
        assert_array_like(lse, xq, shape=(len(case.lengths), HQ, n_query), dtype=lse_dtype)
    nk = None if new[0] is None else heads_first(new[0])
    nv = None if new[1] is None else heads_first(new[1])
    k_after, v_after = written(replace(case, new_key=nk, new_value=nv), k_before, v_before)
    for name, got, expected, mine in (
        ("key_cache", k_ret, k_after, xk),
        ("value_cache", v_ret, v_after, xv),
    ):
        assert_array_like(got, mine, shape=tuple(mine.shape), dtype=mine.dtype)
        np.testing.assert_array_equal(heads_first(got), expected, err_msg=f"returned {name}")
        if case.new_key is None:
            assert got is mine, f"{name}: without new tokens the caller's array is returned"
        elif backend.library in IN_PLACE and backend.id != "numpy:readonly":
            assert got is mine, f"{name}: {backend.id} writes in place"
        else:
            assert got is not mine, f"{name}: {backend.id} returns a new array"
            before = k_before if name == "key_cache" else v_before
            np.testing.assert_array_equal(heads_first(mine), before)
    q64 = heads_first(xq)
    mask64 = None if mask is None else mask
    bias64 = None if xbias is None else host(xbias)
    call_only = ("num_splits", "return_lse", "implementation", "layout")
    oracle_options = {k: v for k, v in options.items() if k not in call_only}
    check_against_oracle(
        case, heads_first(out), lse, k_after, v_after, q64, dtype, mask64, bias64, oracle_options
    )
    return result


def _mask(seed: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    return rng.random((B, 1, L, T)) < 0.8


def _bias(seed: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    bias = rng.standard_normal((1, HQ, 1, T))
    bias[0, 1, 0, 3] = -np.inf
    return bias


NEW_LENGTHS = [0, 7, T - L]  # empty cache plus new tokens, partly filled, full after writing
CACHED_LENGTHS = [0, 7, T]  # no token at all, partly filled, full

#: (id, paged, new tokens, options): every option, alone or combined.
CONFIGS = [
    ("contiguous-new-causal-gqa", False, True, dict(is_causal=True, enable_gqa=True)),
    ("contiguous-cached-window", False, False, dict(window=(3, 1), heads_kv=4)),
    ("contiguous-new-mask-bias-splits", False, True, dict(is_causal=True, mask=1, bias=1)),
    ("paged-new-causal-gqa", True, True, dict(is_causal=True, enable_gqa=True)),
    ("paged-cached-softcap", True, False, dict(is_causal=True, softcap=1.5, num_splits=2)),
    ("paged-new-window-bias", True, True, dict(window=(5, 0), bias=1, enable_gqa=True)),
    ("paged-new-mask-scale", True, True, dict(mask=1, scale=0.3, num_splits=16, heads_kv=4)),
    ("paged-cached-mqa-no-lse", True, False, dict(heads_kv=1, is_causal=True, return_lse=False)),
]


@pytest.mark.parametrize(
    ("config", "paged", "new", "options"), CONFIGS, ids=[c[0] for c in CONFIGS]
)
def test_matches_oracle(backend_dtype, config, paged, new, options):
    backend, dtype = backend_dtype
    options = dict(options)
    heads_kv = options.pop("heads_kv", 2 if options.get("enable_gqa") else 4)
    mask = _mask(config) if options.pop("mask", None) else None
    bias = _bias(config) if options.pop("bias", None) else None
    options.setdefault("return_lse", True)
    lengths = NEW_LENGTHS if new else CACHED_LENGTHS
    case = make_case(config, lengths=lengths, new=new, paged=paged, heads_kv=heads_kv)
    if "splits" in config:
        options["num_splits"] = 3
    run(backend, dtype, case, mask=mask, bias=bias, **options)


@pytest.mark.parametrize(
    ("config", "paged", "new", "options"),
    [CONFIGS[0], CONFIGS[3], CONFIGS[4]],
    ids=[c[0] for c in (CONFIGS[0], CONFIGS[3], CONFIGS[4])],
)
def test_length_before_heads_layout(backend, config, paged, new, options):
    """``layout="BLHE"``: (B, L, H, E) queries and new tokens, (B, S_max, Hkv, E) or paged
    (num_pages, page_size, Hkv, E) caches, written through views (the caller's arrays
    returned where the library writes in place), the results as the heads-first call's."""
    options = dict(options)
    heads_kv = options.pop("heads_kv", 2 if options.get("enable_gqa") else 4)
    lengths = NEW_LENGTHS if new else CACHED_LENGTHS
    case = make_case(config, lengths=lengths, new=new, paged=paged, heads_kv=heads_kv)
    run(backend, "float32", case, return_lse=True, layout="BLHE", **options)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_lengths_and_table_as_arrays(backend, paged):
    """Integer arrays of the inputs' library; lazy Dask arrays are not read (every chunk is
    computed, the lengths enter the mask, the new tokens are written with ``where``)."""
    case = make_case("arrays", lengths=NEW_LENGTHS, new=True, paged=paged)
    run(
        backend,
        "float32",
        case,
        lengths_as="array",
        is_causal=True,
        enable_gqa=True,
        return_lse=True,
    )


#: cache_leftpad beside NEW_LENGTHS / CACHED_LENGTHS: none, some, and (cached) a sequence
#: that is all padding (no token: a zero output and a log-sum-exp of -inf).
NEW_STARTS = [0, 3, 5]
CACHED_STARTS = [0, 7, 2]

#: (id, paged, new tokens, options) of the left-padded cases.
LEFT_PADDED = [
    ("left-contiguous-new-causal-gqa", False, True, dict(is_causal=True, enable_gqa=True)),
    ("left-contiguous-cached-window", False, False, dict(window=(3, 1))),
    ("left-paged-new-mask-bias", True, True, dict(is_causal=True, mask=1, bias=1)),
    ("left-paged-cached-softcap-splits", True, False, dict(softcap=1.5, num_splits=4)),
]


@pytest.mark.parametrize(
    ("config", "paged", "new", "options"), LEFT_PADDED, ids=[c[0] for c in LEFT_PADDED]
)
def test_left_padded_cache_matches_oracle(backend_dtype, config, paged, new, options):
    """``cache_leftpad``: the slots before each start hold NaN and are never read; the
    oracle attends the last ``n_b - start`` of the gathered tokens (its own left padding,
    ``key_lengths`` with ``padding_side="left"``), the diagonals unmoved."""
    backend, dtype = backend_dtype
    options = dict(options)
    mask = _mask(config) if options.pop("mask", None) else None
    bias = _bias(config) if options.pop("bias", None) else None
    lengths, starts = (NEW_LENGTHS, NEW_STARTS) if new else (CACHED_LENGTHS, CACHED_STARTS)
    heads_kv = 2 if options.get("enable_gqa") else 4
    case = make_case(
        config, lengths=lengths, new=new, paged=paged, starts=starts, heads_kv=heads_kv
    )
    run(backend, dtype, case, mask=mask, bias=bias, return_lse=True, **options)


def test_left_padding_as_arrays(backend):
    """``cache_leftpad`` as an integer array of the inputs' library (lazy Dask arrays are
    not read: the starts then enter the masks, and the values before them are zeroed)."""
    case = make_case(
        "left-arrays", lengths=NEW_LENGTHS, new=True, paged=True, starts=NEW_STARTS, heads_kv=4
    )
    run(backend, "float32", case, lengths_as="array", is_causal=True, return_lse=True)


def _pieces_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record (first token's page-row position, tokens) of every chunk call."""
    calls: list[tuple[int, int]] = []
    original = kv_chunks.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((int(k.shape[0]), int(k.shape[0]) * int(k.shape[2])))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(kv_chunks, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize(
    ("window", "attended"),
    # n_b = 2, 9, 16; a window of 3 tokens left of the diagonals of 2 queries spans 5
    [(None, [2, 9, 16]), ((3, 0), [2, 5, 5])],
    ids=["causal", "window"],
)
def test_only_attended_tokens_are_read(monkeypatch, window, attended):
    """Chunks beyond a sequence's length, or outside every query's window, are never
    computed: the chunk calls hold exactly the attended tokens (NaN elsewhere)."""
    calls = _pieces_spy(monkeypatch)
    case = make_case("reads", lengths=NEW_LENGTHS, new=True, paged=True, page_size=3, max_pages=6)
    for b, n in enumerate(case.lengths):
        solo = replace(
            case,
            query=case.query[b : b + 1],
            lengths=[n],
            new_key=case.new_key[b : b + 1],  # type: ignore[index]
            new_value=case.new_value[b : b + 1],  # type: ignore[index]
            table=case.table[b : b + 1],  # type: ignore[index]
        )
        calls.clear()
        out = attention_with_kv_cache(
            solo.query,
            solo.key_cache.copy(),
            solo.value_cache.copy(),
            cache_lengths=[n],
            new_key=solo.new_key,
            new_value=solo.new_value,
            block_table=solo.table,
            is_causal=True,
            window=window,
            enable_gqa=True,
            num_splits=2,
        )[0]
        assert sum(tokens for _, tokens in calls) == attended[b]
        assert not np.isnan(out).any()


def test_long_sequence_is_split_for_threads(monkeypatch):
    """A single query over 32768 tokens runs as several chunks on the pool, even with tiny
    heads, and still matches the oracle."""
    seen: list[int] = []
    original = kv_chunks.map_blocks

    def spy(xp, fn, items):
        seen.append(len(items))
        return original(xp, fn, items)

    monkeypatch.setattr(kv_chunks, "map_blocks", spy)
    rng = np.random.default_rng(1)
    n = 32768
    k = rng.standard_normal((1, 1, n, 2)).astype(np.float32)
    v = rng.standard_normal((1, 1, n, 3)).astype(np.float32)
    q = rng.standard_normal((1, 1, 1, 2)).astype(np.float32)
    out, lse, _, _ = attention_with_kv_cache(q, k, v, cache_lengths=[n], return_lse=True)
    assert seen == [n // kv_chunks.CHUNK_MAX_TOKENS]
    ref_out, ref_lse = reference.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), return_lse=True
    )
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


@given(data=st.data())
def test_random_layouts(backend, data):
    """Page sizes, page orders, fill levels (0 tokens, full caches), L and num_splits."""
    draw = data.draw
    paged = draw(st.booleans(), label="paged")
    page_size = draw(st.sampled_from([1, 2, 3, 5, 8]), label="page_size")
    max_pages = draw(st.integers(1, 4), label="max_pages")
    n_query = draw(st.sampled_from([1, 3]), label="L")
    capacity = page_size * max_pages
    if capacity < n_query:
        max_pages = -(-n_query // page_size)
        capacity = page_size * max_pages
    new = draw(st.booleans(), label="new tokens")
    top = capacity - (n_query if new else 0)
    lengths = draw(st.lists(st.integers(0, top), min_size=1, max_size=3), label="lengths")
    spare = draw(st.integers(0, 2), label="spare pages")
    pages = len(lengths) * max_pages + spare
    order = draw(st.permutations(range(pages)), label="page order") if paged else None
    options = dict(
        enable_gqa=True,
        is_causal=draw(st.booleans(), label="is_causal"),
        num_splits=draw(st.none() | st.integers(1, 6), label="num_splits"),
        window=draw(st.none() | st.tuples(st.integers(0, 4), st.none()), label="window"),
    )
    case = make_case(
        f"layout-{lengths}-{page_size}",
        lengths=lengths,
        new=new,
        paged=paged,
        page_size=page_size,
        max_pages=max_pages,
        spare=spare,
        order=order,
        n_query=n_query,
    )
    run(backend, "float64", case, return_lse=True, **options)


# --------------------------------------------------------------------------------------
# Writing: in place, new arrays, autograd, jit
# --------------------------------------------------------------------------------------


def test_jax_returns_new_arrays_and_jits(jax_backend):
    """JAX: new caches, the inputs unchanged; under ``jax.jit`` lengths and block table are
    traced (never read), and the result is the eager one."""
    import jax

    case = make_case("jit", lengths=NEW_LENGTHS, new=True, paged=True)
    arrays = [
        jax_backend.asarray(a, "float64")
        for a in (case.query, case.key_cache, case.value_cache, case.new_key, case.new_value)
    ]
    lengths = jax_backend.asarray(np.asarray(case.lengths))
    table = jax_backend.asarray(case.table)

    def step(q, k, v, nk, nv, lengths, table):
        return attention_with_kv_cache(
            q,
            k,
            v,
            cache_lengths=lengths,
            new_key=nk,
            new_value=nv,
            block_table=table,
            is_causal=True,
            enable_gqa=True,
            return_lse=True,
        )

    eager = step(*arrays, case.lengths, case.table)
    traced = jax.jit(step)(*arrays, lengths, table)
    assert eager[2] is not arrays[1]
    np.testing.assert_array_equal(host(arrays[1]), case.key_cache)  # NaN == NaN here
    for a, b in zip(eager, traced, strict=True):
        np.testing.assert_allclose(host(a), host(b), rtol=1e-12, atol=1e-12)


def test_torch_autograd_gets_new_caches(torch_backend):
    """New tokens that require grad: the caller's caches stay as they are, the returned
    ones are new, and the gradient reaches the new tokens."""
    import torch

    case = make_case("autograd", lengths=NEW_LENGTHS, new=True, paged=False)
    q, k, v = (
        torch_backend.asarray(a, "float64") for a in (case.query, case.key_cache, case.value_cache)
    )
    nk, nv = (
        torch_backend.asarray(a, "float64").requires_grad_() for a in (case.new_key, case.new_value)
    )
    out, k_new, v_new = attention_with_kv_cache(
        q,
        k,
        v,
        cache_lengths=case.lengths,
        new_key=nk,
        new_value=nv,
        is_causal=True,
        enable_gqa=True,
    )
    assert k_new is not k
    assert v_new is not v
    assert not k.requires_grad
    np.testing.assert_array_equal(host(k), case.key_cache)
    out.sum().backward()
    assert nv.grad is not None
    assert torch.all(torch.isfinite(nv.grad))
    assert torch.any(nv.grad != 0)


# --------------------------------------------------------------------------------------
# Misuse: every argument, before any work
# --------------------------------------------------------------------------------------

_CASE = make_case("bad", lengths=[2, 5], new=True, paged=True, heads_kv=2)
_CONTIGUOUS = make_case("bad-contiguous", lengths=[2, 5], new=True, paged=False, heads_kv=2)


def _call(case: Case = _CASE, **overrides: Any) -> Any:
    args = dict(
        query=case.query,
        key_cache=case.key_cache,
        value_cache=case.value_cache,
        cache_lengths=case.lengths,
        new_key=case.new_key,
        new_value=case.new_value,
        block_table=case.table,
        enable_gqa=True,
    )
    args.update(overrides)
    q, k, v = args.pop("query"), args.pop("key_cache"), args.pop("value_cache")
    return attention_with_kv_cache(q, k, v, **args)


def _torch_lengths() -> Any:
    torch = pytest.importorskip("torch")
    return torch.tensor([2, 5])


BAD = [
    ("query 3-D", dict(query=_CASE.query[0]), ValueError, r"query must have 4 dimensions"),
    ("query a list", dict(query=[[1.0]]), TypeError, r"query must be an array"),
    (
        "dtypes differ",
        dict(key_cache=_CASE.key_cache.astype(np.float32)),
        TypeError,
        r"share one dtype.*key_cache float32",
    ),
    ("integer query", dict(query=np.ones((2, 4, 2, 8), int)), TypeError, r"query must have a real"),
    (
        "value cache pages differ",
        dict(value_cache=_CASE.value_cache[:-1]),
        ValueError,
        r"key_cache and value_cache must agree",
    ),
    ("E differs", dict(key_cache=_CASE.key_cache[..., :5]), ValueError, r"feature size E=8"),
    (
        "contiguous batch differs",
        dict(
            key_cache=_CONTIGUOUS.key_cache[:1],
            value_cache=_CONTIGUOUS.value_cache[:1],
            block_table=None,
        ),
        ValueError,
        r"contiguous key_cache must have shape \(B, Hkv, S_max, E\) with the query's B=2",
    ),
    (
        "page size 0",
        dict(key_cache=_CASE.key_cache[:, :, :0], value_cache=_CASE.value_cache[:, :, :0]),
        ValueError,
        r"page_size >= 1",
    ),
    (
        "gqa not divisible",
        dict(query=np.ones((2, 3, 2, 8))),
        ValueError,
        r"multiple of the cache's heads \(2\)",
    ),
    ("heads differ", dict(enable_gqa=False), ValueError, r"pass enable_gqa=True"),
    ("leftpad shape", dict(cache_leftpad=[0]), ValueError, r"cache_leftpad must have shape"),
    ("leftpad floats", dict(cache_leftpad=[0.5, 1.0]), TypeError, r"cache_leftpad must hold"),
    (
        "leftpad negative",
        dict(cache_leftpad=[0, -1]),
        ValueError,
        r"cache_leftpad\[1\] = -1: each start must be non-negative",
    ),
    (
        "leftpad past the tokens",
        dict(cache_leftpad=[5, 0]),
        ValueError,
        r"cache_leftpad\[0\] = 5: .* at most the 4 attended tokens",
    ),
    ("new_key alone", dict(new_value=None), ValueError, r"new_key was given without new_value"),
    ("new_value alone", dict(new_key=None), ValueError, r"new_value was given without new_key"),
    (
        "new_key shape",
        dict(new_key=_CASE.new_key[:, :, :1]),
        ValueError,
        r"new_key must have shape \(B, Hkv, L, E\) = \(2, 2, 2, 8\)",
    ),
    (
        "new_value width",
        dict(new_value=_CASE.new_value[..., :2]),
        ValueError,
        r"new_value must have shape .* = \(2, 2, 2, 6\)",
    ),
    (
        "lengths floats",
        dict(cache_lengths=[2.0, 5.0]),
        TypeError,
        r"cache_lengths must hold integers",
    ),
    (
        "lengths bools",
        dict(cache_lengths=[True, False]),
        TypeError,
        r"cache_lengths must hold integers",
    ),
    (
        "lengths float array",
        dict(cache_lengths=np.array([2.0, 5.0])),
        TypeError,
        r"cache_lengths must hold integers",
    ),
    (
        "lengths a string",
        dict(cache_lengths="25"),
        TypeError,
        r"cache_lengths must be a list of ints",
    ),
    ("lengths none", dict(cache_lengths=None), TypeError, r"cache_lengths is required"),
    (
        "lengths shape",
        dict(cache_lengths=[2, 5, 1]),
        ValueError,
        r"cache_lengths must have shape \(B,\) = \(2,\)",
    ),
    ("lengths 2-D", dict(cache_lengths=[[2], [5]]), ValueError, r"cache_lengths must have shape"),
    ("lengths negative", dict(cache_lengths=[2, -1]), ValueError, r"cache_lengths\[1\] = -1"),
    (
        "cache too small",
        dict(cache_lengths=[2, T - 1]),
        ValueError,
        rf"too small: cache_lengths\[1\] = {T - 1} plus 2 new token\(s\) needs {T + 1} token slots"
        rf".*holds {T} per sequence",
    ),
    (
        "contiguous too small",
        dict(
            key_cache=_CONTIGUOUS.key_cache,
            value_cache=_CONTIGUOUS.value_cache,
            block_table=None,
            cache_lengths=[T, 0],
        ),
        ValueError,
        rf"cache_lengths\[0\] = {T} plus 2 new token\(s\).*S_max = {T}",
    ),
    (
        "table floats",
        dict(block_table=_CASE.table * 1.0),
        TypeError,
        r"block_table must hold integers",
    ),
    (
        "table shape",
        dict(block_table=_CASE.table[:1]),
        ValueError,
        r"block_table must have shape \(B, max_pages\)",
    ),
    ("table ragged", dict(block_table=[[0, 1], [2]]), ValueError, r"block_table must have shape"),
    (
        "table out of pages",
        dict(block_table=np.where(_CASE.table == _CASE.table[1, 1], 99, _CASE.table)),
        ValueError,
        r"block_table\[1, 1\] = 99 points outside the cache's 10 pages",
    ),
    (
        "table negative",
        dict(block_table=-1 - _CASE.table * 0),
        ValueError,
        r"block_table\[0, 0\] = -1",
    ),
    ("num_splits 0", dict(num_splits=0), ValueError, r"num_splits must be a positive int"),
    ("num_splits float", dict(num_splits=2.0), TypeError, r"num_splits must be a positive int"),
    ("num_splits bool", dict(num_splits=True), TypeError, r"num_splits must be a positive int"),
    ("mask not bool", dict(mask=np.ones((T,))), TypeError, r"mask must be boolean"),
    (
        "mask shape",
        dict(mask=np.ones((T + 1,), bool)),
        ValueError,
        rf"mask of shape \({T + 1},\) does not broadcast to \(B, Hq, L, T\) = \(2, 4, 2, {T}\)"
        r" \(T = max_pages \* page_size\)",
    ),
    (
        "bias ints",
        dict(bias=np.ones((T,), int)),
        TypeError,
        r"bias must have a real floating dtype",
    ),
    ("bias shape", dict(bias=np.ones((3, 1, 1, T))), ValueError, r"bias of shape \(3, 1, 1, 16\)"),
    ("window", dict(window=(-1, 0)), ValueError, r"window left size must be non-negative"),
    ("window type", dict(window=3), TypeError, r"window must be a pair"),
    ("scale", dict(scale=-1.0), ValueError, r"scale must be a positive finite number"),
    ("softcap", dict(softcap=0.0), ValueError, r"softcap must be a positive finite number"),
    ("is_causal", dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
    ("enable_gqa", dict(enable_gqa=1), TypeError, r"enable_gqa must be a bool"),
    ("return_lse", dict(return_lse=1), TypeError, r"return_lse must be a bool"),
    ("unknown option", dict(block_k=4), TypeError, r"unexpected keyword argument 'block_k'"),
    ("return_weights", dict(return_weights=True), TypeError, r"does not return attention weights"),
    ("alignment", dict(alignment="top_left"), ValueError, r"alignment is always 'bottom_right'"),
]


@pytest.mark.parametrize(
    ("overrides", "error", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_arguments(overrides, error, message):
    k, v = _CASE.key_cache.copy(), _CASE.value_cache.copy()
    with pytest.raises(error, match=message):
        _call(**{"key_cache": k, "value_cache": v, **overrides})
    np.testing.assert_array_equal(k, _CASE.key_cache, err_msg="a failing call wrote the cache")
    np.testing.assert_array_equal(v, _CASE.value_cache, err_msg="a failing call wrote the cache")


def test_lengths_of_another_library():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "cache_lengths must be a list of ints, a NumPy array or an array of the inputs' library"
        ),
    ):
        _call(cache_lengths=_torch_lengths())


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_nan_query_gives_nan_output_and_lse(backend_dtype, num_splits):
    """A NaN in a query row gives that row NaN output and log-sum-exp for every
    ``num_splits`` (the splits' ``-inf`` log-sum-exps merged to zeros and ``-inf``); the
    other rows stay finite."""
    backend, dtype = backend_dtype
    rng = np.random.default_rng(10)
    q = rng.standard_normal((B, HQ, L, E))
    k, v = rng.standard_normal((B, HQ, T, E)), rng.standard_normal((B, HQ, T, EV))
    q[1, 2, 0, 5] = np.nan
    out, lse = attention_with_kv_cache(
        *(backend.asarray(x, dtype) for x in (q, k, v)),
        cache_lengths=[T, T - 3, 5],
        num_splits=num_splits,
        return_lse=True,
    )[:2]  # then the caches
    out, lse = reference.to_numpy(out), reference.to_numpy(lse)
    assert np.isnan(out[1, 2, 0]).all()
    assert np.isnan(lse[1, 2, 0])
    rows = np.ones((B, HQ, L), dtype=bool)
    rows[1, 2, 0] = False
    assert np.isfinite(out[rows]).all()
    assert np.isfinite(lse[rows]).all()
