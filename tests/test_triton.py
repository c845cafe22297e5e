"""The Triton kernels against the float64 oracle, on triton's interpreter or a GPU.

* every feature, forward (``out``, ``lse``, the maximum scores) and backward (``dq``,
  ``dk``, ``dv``, ``dbias``, ``dsinks``, ``dscale``), float16 and float32 (and bfloat16 on
  a GPU), within the derived bounds of :mod:`sdpa_array.testing.bounds` with the kernels'
  own terms (``base2``: the softmax in base 2; ``rounded_operands``: probabilities and
  score gradients rounded to the inputs' dtype before their products), with small blocks
  so that every phase of the kernels' loops runs (edge blocks, full blocks, online
  rescaling, padding);
* the dispatch entries (:func:`triton_attention` with weights, :func:`triton_vjp` without
  a saved forward) with their default blocks;
* the dropout keep mask is :func:`sdpa_array.dropout_keep_mask`'s, bit for bit, in the
  forward and the ``dK``/``dV`` kernel;
* empty blocks are skipped: the kernels' tile counts equal the blocks in which the oracle
  finds an admissible pair (causal attention does about half the work);
* :func:`plan_triton` refuses what the kernels cannot compute, naming the reason.

The kernels run on CPU torch tensors under ``TRITON_INTERPRET=1`` (set before triton is
imported), else on CUDA torch tensors and CuPy arrays. Without triton the module is
skipped naming it; without the interpreter and without a CUDA device, naming the device.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install triton): the Triton kernels need it",
        allow_module_level=True,
    )

import sdpa_array
from sdpa_array import reference
from sdpa_array._kernels.result import AttentionResult, finalize, finish_gradients
from sdpa_array._kernels.triton import (
    CannotUseTritonError,
    plan_triton,
    triton_attention,
    triton_vjp,
)
from sdpa_array._kernels.triton import plan as triton_plan
from sdpa_array._kernels.triton.attention import run_backward, run_forward
from sdpa_array._kernels.triton.configs import Blocks, interpreting
from sdpa_array._problem.options import Options
from sdpa_array._problem.outputs import Outputs
from sdpa_array._problem.problem import Inputs, Problem, validate
from sdpa_array.testing import assert_array_like, assert_close, assert_within, get_backend
from sdpa_array.testing.backends import Backend
from sdpa_array.testing.bounds import (
    UNIT_ROUNDOFF,
    compute_dtype,
    lse_bound,
    output_bound,
    score_error,
    weights_from_lse_bound,
)
from sdpa_array.testing.vjp_bounds import vjp_oracle_and_bounds
from tests.conftest import _parametrize, selected_backends


def _triton_backends() -> tuple[list[Backend], str]:
    """The backends the kernels run on here, and what is missing when there are none."""
    if interpreting():
        cpu = get_backend("torch")
        return [cpu] if cpu.is_available() else [], "torch, whose CPU tensors the interpreter runs"
    gpus = [b for b in (get_backend("torch:cuda"), get_backend("cupy")) if b.is_available()]
    return gpus, "a CUDA device (or TRITON_INTERPRET=1 to run them on the CPU)"


TRITON_BACKENDS, MISSING = _triton_backends()
if not TRITON_BACKENDS:
    pytest.skip(f"the Triton kernels need {MISSING}, absent here", allow_module_level=True)

#: Dtypes per backend: bfloat16 only on a GPU (the interpreter multiplies its raw bits).
DTYPES = {
    "torch": ("float16", "float32"),
    "torch:cuda": ("float16", "bfloat16", "float32"),
    "cupy": ("float16", "float32"),
}

#: Small blocks: a few query and key blocks per head, so that the loops' phases all run.
SMALL = Blocks(16, 16)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``triton_backend`` (and ``triton_dtype``: with each dtype) over the selected backends
    the kernels run on (``--backend`` / ``SDPA_BACKENDS``)."""
    ids = {b.id for b in selected_backends(metafunc.config)}
    backends = [b for b in TRITON_BACKENDS if b.id in ids]
    if "triton_dtype" in metafunc.fixturenames:
        pairs = [(b, d) for b in backends for d in DTYPES[b.id]]
        _parametrize(metafunc, "triton_dtype", pairs, [f"{b.id}-{d}" for b, d in pairs])
    elif "triton_backend" in metafunc.fixturenames:
        _parametrize(metafunc, "triton_backend", backends, [b.id for b in backends])


@pytest.fixture
def triton_backend(request: pytest.FixtureRequest) -> Backend:
    """A backend whose arrays the kernels run on."""
    request.param.configure()
    return request.param


@pytest.fixture
def triton_dtype(request: pytest.FixtureRequest) -> tuple[Backend, str]:
    """A (backend, dtype name) pair the kernels run on."""
    backend, dtype = request.param
    backend.configure()
    return backend, dtype


# --------------------------------------------------------------------------------------
# Running the kernels and checking them with the oracle


def _host(x: Any) -> Any:
    return None if x is None else reference.to_numpy(x)


class Call:
    """One attention call on a backend: its arrays, options, Problem and Inputs.

    ``arrays`` holds NumPy values (``q``, ``k``, ``v``, ``g`` the output cotangent, and
    optionally ``mask``, ``bias``, ``sinks``, ``scale``); ``options`` the other keywords of
    the public functions.
    """

    def __init__(self, backend: Backend, dtype: str, arrays: dict[str, Any], options: dict):
        self.backend, self.dtype, self.options = backend, dtype, options

        def put(name: str, as_dtype: str | None) -> Any:
            a = arrays.get(name)
            return None if a is None else backend.asarray(a, as_dtype)

        self.q, self.k, self.v, self.g = (put(n, dtype) for n in ("q", "k", "v", "g"))
        self.mask = put("mask", None)
        self.bias = put("bias", dtype)
        self.sinks = put("sinks", "float32")
        self.scale = put("scale", "float32")
        keywords = {
            "mask": self.mask,
            "bias": self.bias,
            "is_causal": False,
            "window": None,
            "alignment": "top_left",
            "scale": self.scale if self.scale is not None else options.get("scale"),
            "softcap": None,
            "enable_gqa": False,
            **{k: v for k, v in options.items() if k != "scale"},
            "sinks": self.sinks,
        }
        self.p: Problem = validate(self.q, self.k, self.v, Options(**keywords))
        self.x = Inputs(
            self.q,
            self.k,
            self.v,
            self.mask,
            self.bias,
            self.p.scale if self.p.scale_is_array else None,
            self.sinks,
        )

    def oracle_options(self) -> dict[str, Any]:
        """The keywords of the oracle: host values of the arrays, the same options."""
        opts = {k: v for k, v in self.options.items()}
        if self.sinks is not None:
            opts["sinks"] = _host(self.sinks).astype(np.float64)
        if self.scale is not None:
            opts["scale"] = _host(self.scale)
        return opts

    def f64(self, x: Any) -> Any:
        return None if x is None else reference.to_numpy(x).astype(np.float64)


def check_forward(c: Call, out: Any, lse: Any) -> None:
    """``out`` and ``lse`` (public shapes) within the derived bounds of the oracle's."""
    dtype = c.dtype
    q64, k64, v64 = c.f64(c.q), c.f64(c.k), c.f64(c.v)
    opts = c.oracle_options()
    ref_out, ref_lse = reference.scaled_dot_product_attention(
        q64, k64, v64, mask=_host(c.mask), bias=c.f64(c.bias), return_lse=True, **opts
    )
    u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
    scale = c.p.scale if not c.p.scale_is_array else float(_host(c.scale))
    S = k64.shape[-2]
    ds = score_error(dtype, q64, k64, scale, c.f64(c.bias), opts.get("softcap"), base2=True)
    if c.sinks is not None:  # one more term of each row's softmax
        S += 1
        ds += u_c * float(np.max(np.abs(opts["sinks"])))
    grow = 1.0 / (1.0 - opts.get("dropout_p", 0.0))
    v_max = grow * float(np.max(np.abs(v64)))
    out_max = float(np.max(np.abs(ref_out)))
    bound = output_bound(
        dtype, S=S, ds=ds, v_max=v_max, out_max=out_max, base2=True, rounded_operands=True
    )
    assert_array_like(out, c.q, shape=ref_out.shape, dtype=c.q.dtype)
    assert_close(out, ref_out, bound)
    finite = ref_lse[np.isfinite(ref_lse)]
    lse_max = float(np.max(np.abs(finite))) if finite.size else 0.0
    compute = c.q.dtype if dtype == "float32" else c.p.xp.float32
    assert_array_like(lse, c.q, shape=ref_lse.shape, dtype=compute)
    assert_close(lse, ref_lse, lse_bound(dtype, S=S, ds=ds, lse_max=lse_max, base2=True), "lse")


def check_gradients(c: Call, grads: tuple[Any, ...], grad_lse: Any = None) -> None:
    """``(dq, dk, dv[, dbias][, dsinks][, dscale])`` within the derived element-wise bounds
    (``grad_lse``: with this cotangent of the log-sum-exp)."""
    expected, bounds = vjp_oracle_and_bounds(
        c.dtype,
        c.f64(c.q),
        c.f64(c.k),
        c.f64(c.v),
        c.f64(c.g),
        mask=_host(c.mask),
        bias=c.f64(c.bias),
        base2=True,
        rounded_operands=True,
        grad_lse=grad_lse,
        **c.oracle_options(),
    )
    named = {"dq": c.q, "dk": c.k, "dv": c.v, "dbias": c.bias, "dsinks": c.sinks}
    named["dscale"] = c.scale
    inputs = {n: x for n, x in named.items() if x is not None}
    assert len(grads) == len(inputs), f"{len(grads)} gradients for {len(inputs)} inputs"
    for (name, x), g, e, b in zip(inputs.items(), grads, expected, bounds, strict=True):
        assert_array_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(g, e, b, name)


def check_max_scores(c: Call, max_scores: Any) -> None:
    """The maximum scores (public shape) within the error of one scaled product of the
    oracle's (:func:`sdpa_array.testing.assert_close_to_oracle` derives that bound)."""
    q64, k64, v64 = c.f64(c.q), c.f64(c.k), c.f64(c.v)
    _, ref = reference.scaled_dot_product_attention(
        q64, k64, v64, mask=_host(c.mask), bias=c.f64(c.bias), return_max_scores=True,
        **c.oracle_options(),
    )  # fmt: skip
    scale = c.p.scale if not c.p.scale_is_array else float(_host(c.scale))
    compute = c.q.dtype if c.dtype == "float32" else c.p.xp.float32
    assert_array_like(max_scores, c.q, shape=ref.shape, dtype=compute)
    assert_close(max_scores, ref, score_error(c.dtype, q64, k64, scale), "max_scores")


def forward_and_backward(c: Call, blocks: Blocks | None = SMALL) -> None:
    """Run the forward kernel (with the maximum scores), check it, then the backward
    kernels on its saved output."""
    r = run_forward(c.p, c.x, blocks=blocks, max_scores=True)
    result = AttentionResult(out=r.out, lse=r.lse, row_maxima=r.row_maxima)
    out, lse, max_scores = finalize(c.p, result, Outputs(lse=True, max_scores=True))
    check_forward(c, out, lse)
    check_max_scores(c, max_scores)
    b = run_backward(c.p, c.x, c.g, out=r.out, lse=r.lse, blocks=blocks)
    check_gradients(c, finish_gradients(c.p, c.x, b.grads))


# --------------------------------------------------------------------------------------
# Feature cases: each a function of a random generator returning (arrays, options)

Case = Callable[[np.random.Generator], tuple[dict[str, Any], dict[str, Any]]]


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def _qkv(
    rng: np.random.Generator, q: tuple[int, ...], k: tuple[int, ...], ev: int | None = None
) -> dict[str, Any]:
    """Query, key and value of these shapes (``ev``: the value's head dim), and in ``g`` the
    output's shape (query heads, broadcast batch axes before them)."""
    v = (*k[:-1], k[-1] if ev is None else ev)
    batch = (*np.broadcast_shapes(q[:-3], k[:-3]), q[-3]) if len(q) > 2 else ()
    g = (*batch, q[-2], v[-1])
    return {"q": _normal(rng, *q), "k": _normal(rng, *k), "v": _normal(rng, *v), "g": g}


def _with_grad(arrays: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Draw the output cotangent of the shape the case put in ``g``."""
    return {**arrays, "g": _normal(rng, *arrays["g"])}


def _padding_mask(rng: np.random.Generator, L: int, S: int) -> np.ndarray:
    m = rng.random((L, S)) < 0.7
    m[3] = False  # a query with no admissible key
    return m


CASES: dict[str, Case] = {
    "plain": lambda r: (_qkv(r, (2, 1, 37, 8), (2, 1, 45, 8)), {}),
    "causal": lambda r: (_qkv(r, (1, 2, 37, 16), (1, 2, 45, 16)), {"is_causal": True}),
    "causal-bottom-right": lambda r: (
        _qkv(r, (1, 2, 37, 16), (1, 2, 45, 16)),
        {"is_causal": True, "alignment": "bottom_right"},
    ),
    "causal-longer-queries": lambda r: (  # queries before the keys' start see nothing
        _qkv(r, (1, 2, 45, 16), (1, 2, 29, 16)),
        {"is_causal": True, "alignment": "bottom_right"},
    ),
    "window": lambda r: (_qkv(r, (1, 2, 40, 16), (1, 2, 40, 16)), {"window": (5, 9)}),
    "window-right-only": lambda r: (
        _qkv(r, (1, 2, 33, 16), (1, 2, 50, 16)),
        {"window": (None, 3), "alignment": "bottom_right"},
    ),
    "causal-window": lambda r: (
        _qkv(r, (1, 2, 50, 16), (1, 2, 50, 16)),
        {"is_causal": True, "window": (20, None)},
    ),
    "mask": lambda r: (
        {**_qkv(r, (2, 1, 30, 16), (2, 1, 36, 16)), "mask": _padding_mask(r, 30, 36)},
        {},
    ),
    "bias": lambda r: (
        {
            **_qkv(r, (2, 2, 30, 16), (2, 2, 36, 16)),
            "bias": np.where(r.random((2, 2, 30, 36)) < 0.1, -np.inf, _normal(r, 2, 2, 30, 36)),
        },
        {"is_causal": True},
    ),
    "bias-broadcast": lambda r: (
        {**_qkv(r, (2, 2, 30, 16), (2, 2, 36, 16)), "bias": _normal(r, 1, 2, 1, 36)},
        {},
    ),
    "softcap": lambda r: (
        {**_qkv(r, (1, 2, 30, 16), (1, 2, 36, 16)), "bias": _normal(r, 30, 36)},
        {"softcap": 2.5, "scale": 0.7},
    ),
    "scale-array": lambda r: (
        {**_qkv(r, (1, 2, 30, 16), (1, 2, 36, 16)), "scale": np.array(0.3)},
        {"is_causal": True},
    ),
    "gqa": lambda r: (
        _qkv(r, (1, 4, 30, 16), (1, 2, 36, 16)),
        {"enable_gqa": True, "is_causal": True, "alignment": "bottom_right"},
    ),
    "shared-kv-head": lambda r: (_qkv(r, (2, 3, 20, 16), (2, 1, 36, 16)), {}),
    "broadcast-batch": lambda r: (  # batch axes (2, 3) that do not merge into one stride
        _qkv(r, (2, 1, 2, 20, 16), (1, 3, 2, 24, 16)),
        {"window": (4, 4)},
    ),
    "no-heads-axis": lambda r: (_qkv(r, (33, 16), (40, 16)), {"is_causal": True}),
    "lengths": lambda r: (
        _qkv(r, (3, 2, 40, 16), (3, 2, 36, 16)),
        {
            "query_lengths": np.array([40, 17, 0]),
            "key_lengths": np.array([30, 36, 5]),
            "is_causal": True,
            "alignment": "bottom_right",
        },
    ),
    "segments": lambda r: (
        _qkv(r, (2, 1, 40, 16), (2, 1, 40, 16)),
        {
            "segment_ids": (np.repeat([[0, 1, 2, 3]], 10, axis=1).reshape(1, 40),) * 2,
            "is_causal": True,
        },
    ),
    "sinks": lambda r: (
        {**_qkv(r, (2, 2, 30, 16), (2, 2, 36, 16)), "sinks": _normal(r, 2)},
        {"query_lengths": np.array([30, 12]), "window": (3, 0)},
    ),
    "dropout": lambda r: (
        _qkv(r, (1, 2, 30, 16), (1, 2, 36, 16)),
        {"dropout_p": 0.3, "dropout_seed": 77, "is_causal": True},
    ),
    "head-dims": lambda r: (_qkv(r, (1, 2, 30, 20), (1, 2, 36, 20), ev=12), {"window": (7, 2)}),
    "widest-heads": lambda r: (_qkv(r, (1, 1, 20, 256), (1, 1, 24, 256), ev=200), {}),
    "everything": lambda r: (
        {
            **_qkv(r, (2, 4, 34, 12), (2, 2, 38, 12), ev=20),
            "mask": r.random((38,)) < 0.9,
            "bias": _normal(r, 2, 4, 34, 38),
            "sinks": _normal(r, 4),
        },
        {
            "enable_gqa": True,
            "window": (9, 4),
            "alignment": "bottom_right",
            "softcap": 3.0,
            "query_lengths": np.array([34, 21]),
            "key_lengths": np.array([30, 38]),
            "segment_ids": (np.repeat([[0, 1]], 17, axis=1), np.repeat([[0, 1]], 19, axis=1)),
            "dropout_p": 0.2,
            "dropout_seed": 5,
        },
    ),
}


def _call(backend: Backend, dtype: str, name: str, seed: int = 0) -> Call:
    rng = np.random.default_rng(seed)
    arrays, options = CASES[name](rng)
    return Call(backend, dtype, _with_grad(arrays, rng), options)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle(triton_dtype: tuple[Backend, str], name: str) -> None:
    backend, dtype = triton_dtype
    c = _call(backend, dtype, name)
    plan_triton(c.p, c.x)
    forward_and_backward(c)


def test_dispatch_entries(triton_dtype: tuple[Backend, str]) -> None:
    """The dispatch table's entries with their default blocks: weights from the kernel's
    log-sum-exp (with dropout), the backward without a saved forward pass."""
    backend, dtype = triton_dtype
    c = _call(backend, dtype, "dropout", seed=1)
    r = triton_attention(c.p, c.x, Outputs(weights=True, lse=True))
    out, weights, lse = finalize(c.p, r, Outputs(weights=True, lse=True))
    check_forward(c, out, lse)
    opts = c.oracle_options()
    q64, k64, v64 = c.f64(c.q), c.f64(c.k), c.f64(c.v)
    _, ref_w, ref_lse = reference.scaled_dot_product_attention(
        q64, k64, v64, return_weights=True, return_lse=True, **opts
    )
    ds = score_error(dtype, q64, k64, c.p.scale, base2=True)
    lse_error = lse_bound(dtype, S=k64.shape[-2], ds=ds, lse_max=float(np.abs(ref_lse).max()),
                          base2=True)  # fmt: skip
    bound = weights_from_lse_bound(dtype, ds=ds, lse_error=lse_error, grow=1 / (1 - 0.3))
    assert_array_like(weights, c.q, shape=ref_w.shape, dtype=c.q.dtype)
    assert_close(weights, ref_w, bound, "weights")
    check_gradients(c, finish_gradients(c.p, c.x, triton_vjp(c.p, c.x, c.g)))


def test_log_sum_exp_cotangent(triton_dtype: tuple[Backend, str]) -> None:
    """A cotangent ``h`` of the log-sum-exp folds into ``D``: the gradients of
    ``sum(out * g) + sum(lse * h)`` are the oracle's (whose ``dZ`` gains ``P h``, and the
    sinks' gradient ``p_sink h``), with a soft-cap and an array scale on the way."""
    backend, dtype = triton_dtype
    rng = np.random.default_rng(3)
    arrays = {
        **_with_grad(_qkv(rng, (2, 2, 30, 16), (2, 2, 36, 16)), rng),
        "sinks": rng.standard_normal(2),
        "scale": np.array(0.4),
    }
    c = Call(backend, dtype, arrays, {"softcap": 2.0, "query_lengths": np.array([30, 11])})
    h = rng.standard_normal(c.p.score_shape[:-1])
    r = run_forward(c.p, c.x, blocks=SMALL)
    b = run_backward(
        c.p, c.x, c.g, out=r.out, lse=r.lse, grad_lse=backend.asarray(h, "float32"), blocks=SMALL
    )
    check_gradients(c, finish_gradients(c.p, c.x, b.grads), grad_lse=h)


# --------------------------------------------------------------------------------------
# Dropout bits, block skipping


def test_dropout_keeps_the_same_weights_as_dropout_keep_mask(triton_backend: Backend) -> None:
    """With ``V = I`` the output's row ``i`` is ``P_i * M_i`` (non-zero exactly where kept),
    and with ``dO = I`` ``dV``'s column ``i`` is too: both equal the public keep mask."""
    L = S = 40
    rng = np.random.default_rng(4)
    arrays = {
        "q": rng.standard_normal((2, 3, L, 16)),
        "k": rng.standard_normal((2, 3, S, 16)),
        "v": np.broadcast_to(np.eye(S), (2, 3, S, S)),
        "g": np.broadcast_to(np.eye(L), (2, 3, L, L)),
    }
    c = Call(triton_backend, "float32", arrays, {"dropout_p": 0.4, "dropout_seed": 2024})
    expected = sdpa_array.dropout_keep_mask(2024, (2, 3, L, S), 0.4)
    r = run_forward(c.p, c.x, blocks=SMALL)
    np.testing.assert_array_equal(_host(r.out) != 0, expected)
    b = run_backward(c.p, c.x, c.g, out=r.out, lse=r.lse, blocks=SMALL)
    dv = _host(b.grads.dv)
    np.testing.assert_array_equal(np.swapaxes(dv, -1, -2) != 0, expected)


@pytest.mark.parametrize("segments", [False, True], ids=["lengths", "lengths+segments"])
@pytest.mark.parametrize("fill", [np.nan, np.inf])
def test_padding_is_never_read(triton_backend: Backend, fill: float, segments: bool) -> None:
    """NaN or inf past the lengths (queries, keys, values, the output's cotangent) leaves
    ``implementation="triton"``'s outputs and gradients those of zeros there, and the
    padding's gradients zero (the public functions zero the padding first); also for packed
    documents, whose ids run on into the padding."""
    rng = np.random.default_rng(6)
    q_len, k_len = np.array([40, 9]), np.array([23, 40])
    clean = [rng.standard_normal((2, 2, 40, 16)).astype(np.float32) for _ in range(4)]
    dirty = [a.copy() for a in clean]
    for b in range(2):
        for a, clean_a, n in zip(dirty, clean, (q_len, k_len, k_len, q_len), strict=True):
            a[b, :, n[b] :] = fill
            clean_a[b, :, n[b] :] = 0
    lengths = {"query_lengths": q_len, "key_lengths": k_len, "implementation": "triton"}
    if segments:
        ids = (np.repeat([0, 1], [15, 25]), np.repeat([0, 1], [10, 30]))
        lengths["segment_ids"] = tuple(triton_backend.asarray(a) for a in ids)
    results = []
    for arrays in (dirty, clean):
        q, k, v, g = (triton_backend.asarray(a, "float32") for a in arrays)
        out = sdpa_array.scaled_dot_product_attention(q, k, v, **lengths)
        grads = sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **lengths)
        results.append([_host(a) for a in (out, *grads)])
    for got, want in zip(*results, strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    _, dq, dk, dv = results[0]
    for b in range(2):
        assert not dq[b, :, q_len[b] :].any()
        assert not dk[b, :, k_len[b] :].any()
        assert not dv[b, :, k_len[b] :].any()


def _admissible_blocks(allowed: np.ndarray, bm: int, bn: int) -> np.ndarray:
    """``[..., i, j]``: whether query block ``i`` and key block ``j`` hold an admissible pair."""
    L, S = allowed.shape[-2:]
    nm, nn = -(-L // bm), -(-S // bn)
    padded = np.zeros((*allowed.shape[:-2], nm * bm, nn * bn), dtype=bool)
    padded[..., :L, :S] = allowed
    tiles = padded.reshape(*allowed.shape[:-2], nm, bm, nn, bn)
    return tiles.any(axis=(-3, -1))


SKIPPING = {
    "causal": ((1, 2, 64, 16), (1, 2, 64, 16), {"is_causal": True}),
    "causal-bottom-right": (
        (1, 2, 40, 16),
        (1, 2, 72, 16),
        {"is_causal": True, "alignment": "bottom_right"},
    ),
    "window": ((1, 1, 64, 16), (1, 1, 64, 16), {"window": (10, 5)}),
    "lengths": (
        (3, 1, 64, 16),
        (3, 1, 48, 16),
        {
            "query_lengths": np.array([64, 20, 0]),
            "key_lengths": np.array([48, 30, 7]),
            "is_causal": True,
            "alignment": "bottom_right",
        },
    ),
    "segments": (
        (2, 1, 64, 16),
        (2, 1, 64, 16),
        {"segment_ids": (np.repeat(np.arange(4), 16)[None, :],) * 2},
    ),
    "gqa-window": ((1, 4, 48, 16), (1, 2, 48, 16), {"enable_gqa": True, "window": (0, 12)}),
}


@pytest.mark.parametrize("name", list(SKIPPING))
def test_empty_blocks_are_skipped(triton_backend: Backend, name: str) -> None:
    """Each kernel computes exactly the tiles with an admissible pair (counted by the
    kernels, found by the oracle), and causal attention about half of them."""
    q_shape, k_shape, options = SKIPPING[name]
    rng = np.random.default_rng(5)
    arrays = _with_grad(_qkv(rng, q_shape, k_shape), rng)
    c = Call(triton_backend, "float16", arrays, options)
    blocks = SMALL
    r = run_forward(c.p, c.x, blocks=blocks, count=True)
    b = run_backward(c.p, c.x, c.g, out=r.out, lse=r.lse, blocks=blocks, count=True)
    allowed = reference.intermediates(c.f64(c.q), c.f64(c.k), c.f64(c.v), **options)["allowed"]
    tiles = _admissible_blocks(allowed, blocks.block_m, blocks.block_n)
    per_query_block = tiles.sum(axis=-1).reshape(-1, tiles.shape[-2])
    np.testing.assert_array_equal(_host(r.counts), per_query_block, err_msg="forward")
    np.testing.assert_array_equal(_host(b.query_counts), per_query_block, err_msg="dQ")
    # the dK/dV programs: per key block, the query blocks of every head of its group
    groups = c.p.groups if c.p.grouped else 1
    by_key = tiles.sum(axis=-2).reshape(-1, groups, tiles.shape[-1]).sum(axis=1)
    np.testing.assert_array_equal(_host(b.key_counts).reshape(by_key.shape), by_key, "dK/dV")
    if name == "causal":
        n = tiles.shape[-1]
        assert int(per_query_block.sum()) == per_query_block.shape[0] * n * (n + 1) // 2


# --------------------------------------------------------------------------------------
# What the plan refuses


def _refusal(c: Call) -> str:
    with pytest.raises(CannotUseTritonError) as info:
        plan_triton(c.p, c.x)
    return str(info.value)


def test_plan_refuses_what_the_kernels_cannot_compute(
    triton_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(6)
    base = _with_grad(_qkv(rng, (1, 2, 8, 16), (1, 2, 8, 16)), rng)
    if "float64" in triton_backend.dtypes:
        assert "float64" in _refusal(Call(triton_backend, "float64", base, {}))

    def mod(b: Any, h: Any, i: Any, j: Any) -> Any:
        return i >= j

    assert "mask_mod" in _refusal(Call(triton_backend, "float32", base, {"mask_mod": mod}))

    def score(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s * 2.0

    assert "score_mod" in _refusal(Call(triton_backend, "float32", base, {"score_mod": score}))
    left = {"key_lengths": 4, "padding_side": "left"}
    assert "padding_side='left'" in _refusal(Call(triton_backend, "float32", base, left))
    wide = _with_grad(_qkv(rng, (1, 1, 4, 300), (1, 1, 4, 300)), rng)
    assert "300" in _refusal(Call(triton_backend, "float32", wide, {}))
    numpy_call = Call(get_backend("numpy"), "float32", base, {})
    assert "numpy" in _refusal(numpy_call)
    c = Call(triton_backend, "float32", base, {})
    # the other mode: CPU tensors without the interpreter, CUDA arrays under it
    monkeypatch.setattr(triton_plan, "interpreting", lambda: not interpreting())
    assert ("CUDA device" if interpreting() else "CPU torch tensors only") in _refusal(c)
    monkeypatch.undo()
    monkeypatch.setattr(triton_plan.importlib.util, "find_spec", lambda name: None)
    assert "triton is not installed" in _refusal(c)
    monkeypatch.undo()
    if triton_backend.library == "torch":  # torch.func wraps the tensors
        import torch

        def refusal_inside(q: Any) -> Any:
            inner = Call.__new__(Call)
            inner.p = validate(q, q, q, Options())
            inner.x = Inputs(q, q, q)
            assert "torch.func" in _refusal(inner)
            return q

        torch.func.vmap(refusal_inside)(c.q)


def test_plan_refusal_is_a_value_error() -> None:
    assert issubclass(CannotUseTritonError, ValueError)


# --------------------------------------------------------------------------------------
# Random shapes, masks and lengths


@hypothesis.settings(max_examples=4, deadline=None)
@hypothesis.given(
    L=st.integers(1, 40),
    S=st.integers(1, 40),
    E=st.sampled_from([4, 16, 24]),
    causal=st.booleans(),
    bottom_right=st.booleans(),
    data=st.data(),
)
def test_random_calls(
    triton_backend: Backend,
    L: int,
    S: int,
    E: int,
    causal: bool,
    bottom_right: bool,
    data: st.DataObject,
) -> None:
    """float32 (one dtype keeps the interpreter's run short; the cases above cover the
    others)."""
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    arrays = _with_grad(_qkv(rng, (2, 1, L, E), (2, 1, S, E)), rng)
    options: dict[str, Any] = {"is_causal": causal}
    if bottom_right:
        options["alignment"] = "bottom_right"
    if data.draw(st.booleans()):
        arrays["mask"] = rng.random((S,)) < 0.8
    if data.draw(st.booleans()):
        options["key_lengths"] = rng.integers(0, S + 1, size=2)
        options["query_lengths"] = rng.integers(0, L + 1, size=2)
    forward_and_backward(Call(triton_backend, "float32", arrays, options))
