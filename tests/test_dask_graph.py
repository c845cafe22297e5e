"""The Dask graph implementation (``sdpa_array._kernels.dask_graph``) on a LocalCluster.

Every feature is checked against the float64 oracle with the derived bounds, computed by two
single-threaded worker processes; the call itself must not compute, its graph must follow
the chunks (one task per chunk pair, none for the pairs causal attention excludes), and the
result must not depend on the chunking.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

import sdpa_array  # noqa: E402
from sdpa_array._kernels.dask_graph import dask_attention  # noqa: E402
from sdpa_array._problem.options import Options  # noqa: E402
from sdpa_array._problem.outputs import Outputs  # noqa: E402
from sdpa_array.testing import assert_close_to_oracle  # noqa: E402
from sdpa_array.testing.assertions import assert_vjp_close_to_oracle  # noqa: E402

DTYPES = ["float32", "float64"]
B, H, L, S, E = 2, 3, 37, 45, 8
#: Uneven chunks along every axis: batch, heads, L (query) and S (key).
CHUNKS_Q = (1, (2, 1), (10, 10, 17), E)
CHUNKS_K = (1, (2, 1), (16, 16, 13), E)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with (
        distributed.LocalCluster(
            n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("computed during the call")


def _inputs(dtype: str, *, heads_kv: int = H, seed: int = 0) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, heads_kv, S, E)).astype(dtype)
    v = rng.standard_normal((B, heads_kv, S, E)).astype(dtype)
    kv_heads = CHUNKS_K[1] if heads_kv == H else 1
    return (
        da.from_array(q, chunks=CHUNKS_Q),
        da.from_array(k, chunks=(1, kv_heads, *CHUNKS_K[2:])),
        da.from_array(v, chunks=(1, kv_heads, *CHUNKS_K[2:])),
    )


def _lazy(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """The call under a scheduler that raises: nothing may be computed."""
    with dask.config.set(scheduler=_raise):
        result = sdpa_array.scaled_dot_product_attention(q, k, v, **kwargs)
    parts = result if isinstance(result, tuple) else (result,)
    assert all(isinstance(a, da.Array) for a in parts)
    assert _pair_tasks(parts[0]) > 0  # "auto" chose the chunk-pair graph
    return result


def _computed(result: Any) -> Any:
    """``result`` computed on the cluster in one go, as Dask arrays holding the values (the
    oracle then reads every array on the local synchronous scheduler)."""
    parts = result if isinstance(result, tuple) else (result,)
    values = dask.compute(*parts)
    done = tuple(da.from_array(a, chunks=p.chunks) for a, p in zip(values, parts, strict=True))
    return done if isinstance(result, tuple) else done[0]


def _check(result: Any, *args: Any, vjp: bool = False, **kwargs: Any) -> None:
    """Compute on the cluster, then compare with the oracle."""
    done = _computed(result)
    with dask.config.set(scheduler="sync"):
        (assert_vjp_close_to_oracle if vjp else assert_close_to_oracle)(done, *args, **kwargs)


def _features(rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    seg_q = np.sort(rng.integers(0, 3, (B, L)), axis=-1)
    seg_k = np.sort(rng.integers(0, 3, (B, S)), axis=-1)
    return {
        "plain": {},
        "mask": {"mask": da.from_array(rng.random((B, 1, L, S)) < 0.7, chunks=(1, 1, 20, 20))},
        "bias": {"bias": da.from_array(rng.standard_normal((H, L, S)), chunks=(2, 11, 30))},
        "causal-top_left": {"is_causal": True},
        "causal-bottom_right": {"is_causal": True, "alignment": "bottom_right"},
        "window": {"window": (6, 3)},
        "softcap": {"softcap": 2.5},
        "scale-array": {"scale": da.from_array(np.asarray(0.3))},
        "key_lengths-host": {"key_lengths": np.array([45, 12])},
        "lengths-dask": {
            "query_lengths": da.from_array(np.array([30, 5]), chunks=1),
            "key_lengths": da.from_array(np.array([20, 45]), chunks=1),
        },
        "lengths-causal-bottom_right": {
            "query_lengths": np.array([30, 9]),
            "key_lengths": np.array([20, 40]),
            "is_causal": True,
            "alignment": "bottom_right",
        },
        "segments-host": {"segment_ids": (seg_q, seg_k)},
        "segments-dask": {
            "segment_ids": (
                da.from_array(seg_q, chunks=(1, 20)),
                da.from_array(seg_k, chunks=(2, 15)),
            )
        },
    }


FEATURES = list(_features(np.random.default_rng(0)))


def _with_dtype(kwargs: dict[str, Any], dtype: str) -> dict[str, Any]:
    out = dict(kwargs)
    for name in ("bias", "scale"):
        if name in out:
            out[name] = out[name].astype(dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature", FEATURES)
def test_forward_matches_oracle(client: Any, feature: str, dtype: str) -> None:
    q, k, v = _inputs(dtype)
    kwargs = _with_dtype(_features(np.random.default_rng(1))[feature], dtype)
    result = _lazy(q, k, v, return_lse=True, **kwargs)
    _check(result, q, k, v, return_lse=True, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa(client: Any, dtype: str) -> None:
    q, k, v = (a.rechunk({1: 1}) for a in _inputs(dtype, heads_kv=1))
    q = da.concatenate([q, q[:, :1]], axis=1)  # 4 query heads, 2 groups of 2
    k = da.concatenate([k, k * 0.5], axis=1)
    v = da.concatenate([v, v - 1], axis=1)
    result = _lazy(q, k, v, enable_gqa=True, is_causal=True, return_lse=True)
    _check(result, q, k, v, enable_gqa=True, is_causal=True, return_lse=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature", ["plain", "bias", "causal-bottom_right", "segments-host"])
def test_vjp_matches_oracle(client: Any, feature: str, dtype: str) -> None:
    q, k, v = _inputs(dtype)
    grad = da.from_array(
        np.random.default_rng(2).standard_normal((B, H, L, E)).astype(dtype), chunks=CHUNKS_Q
    )
    kwargs = _with_dtype(_features(np.random.default_rng(1))[feature], dtype)
    with dask.config.set(scheduler=_raise):
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, grad, **kwargs)
    assert any(str(key[0]).startswith("sdpa-vjp") for key in dict(grads[0].__dask_graph__()))
    _check(grads, q, k, v, grad, vjp=True, **kwargs)


def _pair_tasks(out: Any) -> int:
    return sum(str(key[0]).startswith("sdpa-part") for key in dict(out.__dask_graph__()))


def test_causal_has_about_half_the_tasks() -> None:
    rng = np.random.default_rng(3)
    n, chunk = 8, 16
    q = da.from_array(rng.standard_normal((1, 1, n * chunk, E)), chunks=(1, 1, chunk, E))
    with dask.config.set(scheduler=_raise):
        full = sdpa_array.scaled_dot_product_attention(q, q, q)
        causal = sdpa_array.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert _pair_tasks(full) == n * n
    assert _pair_tasks(causal) == n * (n + 1) // 2
    # O(chunks): the whole graph, inputs and merges included, is a small multiple of pairs
    assert len(full.__dask_graph__()) < 4 * n * n


def test_split_every_sets_the_fan_in() -> None:
    rng = np.random.default_rng(4)
    q = da.from_array(rng.standard_normal((1, 1, 8, E)), chunks=(1, 1, 8, E))
    k = da.from_array(rng.standard_normal((1, 1, 64, E)), chunks=(1, 1, 4, E))
    p = sdpa_array._problem.problem.validate(q, k, k, Options())
    x = sdpa_array._problem.problem.Inputs(q, k, k)
    for fan_in, merges in ((2, 15), (4, 5), (16, 1)):
        out = dask_attention(p, x, Outputs(), split_every=fan_in).out
        graph = dict(out.__dask_graph__())
        assert sum(str(key[0]).startswith("sdpa-merge") for key in graph) == merges
        with dask.config.set(scheduler="sync"):
            assert_close_to_oracle(out, q, k, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_independent_of_chunking(client: Any, dtype: str) -> None:
    q, k, v = _inputs(dtype)
    results = []
    for cq, ck in [
        ((1, 1, 37, E), (1, 1, 45, E)),
        (CHUNKS_Q, CHUNKS_K),
        ((2, 3, 5, E), (2, 3, 7, E)),
    ]:
        out = _lazy(q.rechunk(cq), k.rechunk(ck), v.rechunk(ck), is_causal=True)
        done = _computed(out)
        with dask.config.set(scheduler="sync"):
            assert_close_to_oracle(done, q, k, v, is_causal=True)
            results.append(done.compute())
    # the same values whatever the chunks, to within the rounding of the merge
    eps = np.finfo(dtype).eps
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], rtol=0, atol=64 * S * eps)


def test_weights_and_explicit_implementations_keep_working() -> None:
    q, k, v = _inputs("float64")
    with dask.config.set(scheduler="sync"):
        out, weights = sdpa_array.scaled_dot_product_attention(q, k, v, return_weights=True)
        assert_close_to_oracle((out, weights), q, k, v, return_weights=True)
        for implementation in ("materialized", "blocked"):
            out = sdpa_array.scaled_dot_product_attention(q, k, v, implementation=implementation)
            assert _pair_tasks(out) == 0
            assert_close_to_oracle(out, q, k, v)
