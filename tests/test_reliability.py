"""Reliability: padding that is never read, thread limits that come back, sizes past int32.

* garbage in padding (rows past ``query_lengths``/``key_lengths``, a KV cache past its
  lengths): NaN, +-inf or the dtype's largest value there gives bit-identical outputs,
  log-sum-exps and gradients to zeros there, and zero gradients for the padding, on every
  eager backend and implementation, forward, VJP and autograd;
* concurrent calls on the NumPy thread pool: results identical to serial calls, and the
  BLAS thread limit the caller had comes back (also when the caller changes it meanwhile);
* a window side past any sequence length is no bound (it never overflows a kernel);
* the malformed calls that used to escape with another exception (see also
  tests/test_robustness.py for the generated ones).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import sdpa_array
from sdpa_array import reference

B, H, L, S, E = 2, 2, 8, 8, 4
Q_LENGTHS = np.array([6, 3])
K_LENGTHS = np.array([5, 8])
FILLS = [
    pytest.param(np.nan, id="nan"),
    pytest.param(np.inf, id="inf"),
    pytest.param(-np.inf, id="-inf"),
    pytest.param("max", id="max"),
]
IMPLEMENTATIONS = ["auto", "materialized", "blocked"]


def _padded(fill) -> tuple[np.ndarray, ...]:
    """``(q, k, v, g)`` in float32 with ``fill`` in every padded row (and the same arrays
    with zeros there)."""
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((B, H, n, E)).astype(np.float32) for n in (L, S, S, L))
    value = np.finfo(np.float32).max if fill == "max" else fill
    garbage = [a.copy() for a in (q, k, v, g)]
    for b in range(B):
        for a in (garbage[0], garbage[3]):
            a[b, :, Q_LENGTHS[b] :] = value
        for a in (garbage[1], garbage[2]):
            a[b, :, K_LENGTHS[b] :] = value
    zeros = [np.where(np.isfinite(a) & (a != np.finfo(np.float32).max), a, 0) for a in garbage]
    return tuple(garbage), tuple(np.asarray(z, dtype=np.float32) for z in zeros)


def _lengths(backend):
    return {
        "query_lengths": backend.asarray(Q_LENGTHS),
        "key_lengths": backend.asarray(K_LENGTHS),
    }


#: Packed documents: ids per position (the padding past the lengths carries ids too, as a
#: packed buffer's tail does: the lengths, not the ids, make it padding).
SEGMENTS_Q = np.array([[0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
SEGMENTS_K = np.array([[0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 2, 2]])
RESTRICTIONS = {
    "causal": lambda backend: {"is_causal": True, "alignment": "bottom_right"},
    "segments": lambda backend: {
        "segment_ids": (backend.asarray(SEGMENTS_Q), backend.asarray(SEGMENTS_K))
    },
}


def _same(a, b) -> None:
    np.testing.assert_array_equal(reference.to_numpy(a), reference.to_numpy(b))


@pytest.mark.parametrize("restriction", list(RESTRICTIONS))
@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_garbage_in_padding_is_never_read(eager_backend, implementation, fill, restriction):
    backend = eager_backend
    garbage, zeros = _padded(fill)
    run = {"implementation": implementation, **_lengths(backend)}
    run.update(RESTRICTIONS[restriction](backend))
    results = []
    for arrays in (garbage, zeros):
        q, k, v, g = (backend.asarray(a, "float32") for a in arrays)
        out, lse = sdpa_array.scaled_dot_product_attention(q, k, v, return_lse=True, **run)
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
        results.append((out, lse, *grads))
    for got, expected in zip(*results, strict=True):
        _same(got, expected)
    dq, dk, dv = (reference.to_numpy(a) for a in results[0][2:])
    for b in range(B):
        assert not dq[b, :, Q_LENGTHS[b] :].any()
        assert not dk[b, :, K_LENGTHS[b] :].any()
        assert not dv[b, :, K_LENGTHS[b] :].any()


@pytest.mark.parametrize("fill", [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf")])
def test_garbage_in_padding_on_dask(dask_backend, fill):
    garbage, zeros = _padded(fill)
    run = {**_lengths(dask_backend), "is_causal": True}
    results = []
    for arrays in (garbage, zeros):
        q, k, v, g = (dask_backend.asarray(a, "float32") for a in arrays)
        out = sdpa_array.scaled_dot_product_attention(q, k, v, **run)
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **run)
        results.append((out, *grads))
    for got, expected in zip(*results, strict=True):
        _same(got, expected)


@pytest.mark.parametrize("fill", [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf")])
def test_garbage_in_padding_under_autograd(autograd_backend, fill):
    backend = autograd_backend
    garbage, zeros = _padded(fill)
    lengths = _lengths(backend)
    grads = []
    for arrays in (garbage, zeros):
        q, k, v, g = (backend.asarray(a, "float32") for a in arrays)
        g = backend.asarray(zeros[3], "float32")  # the loss weighs real rows only

        def loss(q, k, v, g=g):
            out = sdpa_array.scaled_dot_product_attention(q, k, v, **lengths)
            return (out * g).sum()

        if backend.library == "torch":
            import torch

            leaves = [a.detach().requires_grad_(True) for a in (q, k, v)]
            grads.append(torch.autograd.grad(loss(*leaves), leaves))
        else:
            import jax

            grads.append(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    for got, expected in zip(*grads, strict=True):
        _same(got, expected)


@pytest.mark.parametrize("fill", FILLS)
def test_garbage_in_a_kv_cache_past_its_lengths(eager_backend, fill):
    backend = eager_backend
    garbage, zeros = _padded(fill)
    outs = []
    for arrays in (garbage, zeros):
        q, k, v, _ = (backend.asarray(a, "float32") for a in arrays)
        query = q[:, :, :1, :]
        lengths = backend.asarray(K_LENGTHS)
        out = sdpa_array.attention_with_kv_cache(query, k, v, cache_lengths=lengths)
        outs.append(out[0] if isinstance(out, tuple) else out)
    _same(*outs)
    assert np.isfinite(reference.to_numpy(outs[0])).all()


# ---------------------------------------------------------------------------------------
# the BLAS thread limit of concurrent calls
# ---------------------------------------------------------------------------------------


def _blas_threads() -> list[int]:
    from threadpoolctl import threadpool_info

    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.fixture
def two_blas_threads():
    """BLAS at 2 threads and the blocked NumPy path on a pool of 2 for the test; both as
    they were afterwards."""
    from threadpoolctl import threadpool_limits

    if not _blas_threads():
        pytest.skip("NumPy is linked to no BLAS that threadpoolctl controls")
    limiter = threadpool_limits(2, user_api="blas")
    sdpa_array.set_num_threads(2)
    yield
    sdpa_array.set_num_threads(None)
    limiter.restore_original_limits()


def _calls(n_threads: int, work, *, during=None):
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _work(i: int) -> np.ndarray:
    rng = np.random.default_rng(i % 3)
    L = (64, 96, 128)[i % 3]
    q = rng.standard_normal((2, 2, L, 16))
    out = None
    for _ in range(3):
        out = sdpa_array.scaled_dot_product_attention(
            q, q, q, is_causal=True, implementation="blocked", block_q=16
        )
    return out


def test_concurrent_calls_match_serial_ones_and_restore_the_limit(two_blas_threads):
    serial = {i: _work(i) for i in range(12)}
    concurrent = _calls(12, _work)
    for i in range(12):
        np.testing.assert_array_equal(concurrent[i], serial[i])
    assert _blas_threads() == [2] * len(_blas_threads())


def test_threads_of_several_libraries_and_shapes(two_blas_threads):
    """NumPy (on the pool), torch and array-api-strict calls of different shapes and
    implementations, concurrently: each result is the serial one."""
    from sdpa_array.testing.backends import available_backends

    # the libraries installed here (each session has its own): their calls run together
    backends = [b for b in available_backends() if b.id in ("numpy", "torch", "strict")]

    def work(i: int):
        backend = backends[i % len(backends)]
        rng = np.random.default_rng(i)
        L = 24 + 8 * (i % 4)
        q, k, v = (backend.asarray(rng.standard_normal((2, 2, L, 8)), "float32") for _ in "qkv")
        implementation = ("blocked", "materialized")[i % 2]
        out = sdpa_array.scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation, key_lengths=L - 3
        )
        return reference.to_numpy(out)

    serial = {i: work(i) for i in range(12)}
    concurrent = _calls(12, work)
    for i in range(12):
        np.testing.assert_array_equal(concurrent[i], serial[i])
    assert _blas_threads() == [2] * len(_blas_threads())


def test_a_limit_the_caller_sets_meanwhile_stays(two_blas_threads):
    from threadpoolctl import threadpool_limits

    started = threading.Event()

    def work(i: int) -> np.ndarray:
        started.set()
        return _work(i)

    def caller_changes_the_limit() -> None:
        started.wait()
        threadpool_limits(3, user_api="blas")

    _calls(8, work, during=caller_changes_the_limit)
    # never left at the pool's 1: the caller's 3, or the original 2 where the caller's
    # change fell between a first call's reading of the limits and its setting them
    assert set(_blas_threads()) <= {2, 3}
    with threadpool_limits(2, user_api="blas"):
        _calls(4, _work)
        assert _blas_threads() == [2] * len(_blas_threads())


# ---------------------------------------------------------------------------------------
# sizes and malformed calls
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["materialized", "blocked"])
def test_a_window_past_every_length_is_no_bound(eager_backend, implementation):
    rng = np.random.default_rng(4)
    q = eager_backend.asarray(rng.standard_normal((1, 2, 9, 4)), "float32")
    k = eager_backend.asarray(rng.standard_normal((1, 2, 12, 4)), "float32")
    run = {"implementation": implementation, "alignment": "bottom_right"}
    causal = sdpa_array.scaled_dot_product_attention(q, k, k, is_causal=True, **run)
    huge = sdpa_array.scaled_dot_product_attention(
        q, k, k, is_causal=True, window=(2**40, 0), **run
    )
    _same(huge, causal)
    plain = sdpa_array.scaled_dot_product_attention(q, k, k, **run)
    _same(sdpa_array.scaled_dot_product_attention(q, k, k, window=(2**62, 2**62), **run), plain)
    # a side just inside the lengths still bounds
    bounded = sdpa_array.scaled_dot_product_attention(q, k, k, window=(2, 20), **run)
    assert not np.array_equal(reference.to_numpy(bounded), reference.to_numpy(plain))


def test_a_kv_cache_window_past_every_length_is_no_bound(eager_backend):
    rng = np.random.default_rng(5)
    q, k, v = (
        eager_backend.asarray(rng.standard_normal(s), "float32")
        for s in ((2, 2, 1, 4), (2, 2, 8, 4), (2, 2, 8, 4))
    )
    lengths = eager_backend.asarray(K_LENGTHS)
    causal = sdpa_array.attention_with_kv_cache(q, k, v, cache_lengths=lengths, is_causal=True)
    huge = sdpa_array.attention_with_kv_cache(
        q, k, v, cache_lengths=lengths, is_causal=True, window=(2**62, 0)
    )
    _same(
        huge[0] if isinstance(huge, tuple) else huge,
        causal[0] if isinstance(causal, tuple) else causal,
    )
    narrow = sdpa_array.attention_with_kv_cache(
        q, k, v, cache_lengths=lengths, is_causal=True, window=(1, 0)
    )
    first = narrow[0] if isinstance(narrow, tuple) else narrow
    assert not np.array_equal(
        reference.to_numpy(first),
        reference.to_numpy(causal[0] if isinstance(causal, tuple) else causal),
    )


def test_missing_arrays_are_type_errors_naming_them():
    q = np.zeros((3, 4))
    for position, name in enumerate(("query", "key", "value")):
        args = [q, q, q]
        args[position] = None
        with pytest.raises(TypeError, match=f"{name} must be an array"):
            sdpa_array.scaled_dot_product_attention(*args)
    with pytest.raises(TypeError, match="grad_output must be an array"):
        sdpa_array.scaled_dot_product_attention_vjp(q, q, q, None)


@pytest.mark.parametrize("dropout_p", ["0.5", b"0.5", [0.5], None])
def test_dropout_p_must_be_a_number(dropout_p):
    q = np.zeros((3, 4))
    with pytest.raises(TypeError, match="dropout_p must be a real number"):
        sdpa_array.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, dropout_seed=1)
    with pytest.raises(TypeError, match="dropout_p must be a real number"):
        sdpa_array.dropout_keep_mask(1, (3, 4), dropout_p)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"shape": 5}, TypeError, "shape must be a tuple of ints"),
        ({"shape": (2, 3.0, 4, 5)}, TypeError, "shape must be a tuple of ints"),
        ({"shape": "34"}, TypeError, "shape must be a tuple of ints"),
        ({"shape": (4,)}, ValueError, "shape must be"),
        ({"shape": (2, -1)}, ValueError, "shape must be"),
        ({"shape": (2, 3), "xp": "numpy"}, TypeError, "xp must be an Array-API namespace"),
    ],
)
def test_dropout_keep_mask_names_its_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        sdpa_array.dropout_keep_mask(1, dropout_p=0.5, **kwargs)
