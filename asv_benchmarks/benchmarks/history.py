"""The history selection: the headline figures as ratios, each measured in one run.

``asv run --bench '^history\\.'`` runs only this module (about two minutes on 2 cores), so
it can run over the project's past commits and in the regression gate (``nox -s
bench-compare``). Every figure is a ratio of two times (or two errors) measured in the same
process, interleaved: absolute times move from machine to machine, ratios much less.
Every ratio is oriented so that **lower is better** (ours / the peer's or the limit's), as
``asv compare`` counts an increase as a regression.

The code uses only the public API, NumPy, torch and threadpoolctl, so that it measures
every past commit alike; a figure whose feature a commit lacks raises
``NotImplementedError`` (asv records it as skipped). NumPy and torch run on two threads:
our block pool (``sdpa_array.set_num_threads``), NumPy's BLAS one thread per block inside
it and torch's intra-op pool. Shapes are ``(B, H, L, E)`` with ``S = L``, float32.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import sdpa_array

try:
    import torch
except ImportError:  # the figures against torch are then skipped
    torch = None

#: Threads for every library (the development machine's two cores).
THREADS = int(os.environ.get("SDPA_BENCH_THREADS", "2"))

#: Timed rounds per figure: each candidate once per round, in a new order each round.
ROUNDS = int(os.environ.get("SDPA_BENCH_HISTORY_ROUNDS", "7"))

#: The forward's shape, the VJP's and the packed documents'.
FORWARD = (1, 8, 2048, 64)
BACKWARD = (1, 8, 1024, 64)
DOCUMENTS, DOCUMENT_LENGTH = 8, 256

#: The long call whose peak memory is tracked (score matrix: 4 GiB in float32).
LONG = (1, 1, 32768, 64)


def _inputs(shape: tuple[int, ...], seed: int = 0, count: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(count)]


def _threads() -> None:
    if hasattr(sdpa_array, "set_num_threads"):
        sdpa_array.set_num_threads(THREADS)
    if torch is not None:
        torch.set_num_threads(THREADS)


def _interleaved(candidates: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each candidate: one untimed warm-up round, then ``rounds``
    rounds that call each candidate once, in a new order each round."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates)
    rng = random.Random(0)
    for round_ in range(rounds + 1):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            candidates[name]()
            if round_:
                times[name].append(time.perf_counter() - start)
    return times


def _ratio(times: dict[str, list[float]], ours: str, peer: str) -> float:
    """The median of the per-round ratios ``ours / peer`` (the two ran in the same round)."""
    if ours not in times or peer not in times:
        return float("nan")
    return statistics.median(a / b for a, b in zip(times[ours], times[peer], strict=True))


def _ratio_of_ratios(
    times: dict[str, list[float]], ours: tuple[str, str], limit: tuple[str, str]
) -> float:
    """The median over rounds of ``(ours[0] / ours[1]) / (limit[0] / limit[1])``: how far
    our ratio of two calls stays from the same ratio of a limit (1: it follows it)."""
    if any(name not in times for name in (*ours, *limit)):
        return float("nan")
    rounds = zip(*(times[name] for name in (*ours, *limit)), strict=True)
    return statistics.median((a / b) / (c / d) for a, b, c, d in rounds)


def _plain_numpy_forward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, softmax: bool = True, causal: bool = False
) -> Callable[[], Any]:
    """The limit of a NumPy forward: the softmax of 512-row blocks written as a plain loop
    (scores, row maxima, ``exp`` in place, row sums, ``P V``) on a pool of :data:`THREADS`
    threads with one-thread BLAS, no validation or planning around it. Without
    ``softmax``: the blocks' two products alone, the GEMM bound of such a loop; with
    ``causal`` as well, the products of each block's rows with the keys up to its last
    row's (the causal call's pairs, at the blocks' granularity)."""
    if softmax and causal:
        raise ValueError("the plain loop's softmax is the non-causal call's")
    scale = np.float32(q.shape[-1] ** -0.5)
    items = [
        (b, h, r)
        for b in range(q.shape[0])
        for h in range(q.shape[1])
        for r in range(0, q.shape[2], 512)
    ]

    def block(item: tuple[int, int, int]) -> np.ndarray:
        b, h, r = item
        keys = slice(0, min(r + 512, k.shape[2]) if causal else k.shape[2])
        s = (q[b, h, r : r + 512] * scale) @ k[b, h, keys].T
        if not softmax:
            return s @ v[b, h, keys]
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        return (s @ v[b, h]) / s.sum(axis=-1, keepdims=True)

    return _on_pool(block, items)


def _plain_numpy_products_backward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray
) -> Callable[[], Any]:
    """The GEMM bound of a NumPy backward: the five products of 128-row blocks against all
    keys (``S = Q Kᵀ``, ``dP = dO Vᵀ``, ``Sᵀ dO``, ``dP K``, ``dPᵀ Q``), the rows a VJP
    that recomputes its scores needs, on the pool of :func:`_plain_numpy_forward`."""
    items = [
        (b, h, r)
        for b in range(q.shape[0])
        for h in range(q.shape[1])
        for r in range(0, q.shape[2], 128)
    ]

    def block(item: tuple[int, int, int]) -> tuple[np.ndarray, ...]:
        b, h, r = item
        rows, grads = q[b, h, r : r + 128], g[b, h, r : r + 128]
        s = rows @ k[b, h].T
        dp = grads @ v[b, h].T
        return s.T @ grads, dp @ k[b, h], dp.T @ rows

    return _on_pool(block, items)


def _on_pool(block: Callable[[Any], Any], items: list[Any]) -> Callable[[], Any]:
    """``block`` of every item on a pool of :data:`THREADS` threads, BLAS on one thread."""
    from threadpoolctl import threadpool_limits

    pool = ThreadPoolExecutor(THREADS)

    def run() -> list[Any]:
        with threadpool_limits(1):
            return list(pool.map(block, items))

    return run


def _torch_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, causal: bool):
    """torch's backward of its own CPU kernel on the same data, its graph built once."""
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    tg = torch.from_numpy(g)

    def run() -> Any:
        return torch.autograd.grad(out, (tq, tk, tv), tg, retain_graph=True)

    return run


def _document_calls() -> dict[str, Callable[[], Any]]:
    """The packed documents (:data:`DOCUMENTS` of :data:`DOCUMENT_LENGTH` in one sequence)
    through each restriction that expresses them, and the same documents as a batch."""
    n, length = DOCUMENTS, DOCUMENT_LENGTH
    q, k, v = _inputs((1, FORWARD[1], n * length, FORWARD[3]), seed=2)
    f = sdpa_array.scaled_dot_product_attention
    doc = np.repeat(np.arange(n), length)
    batched = [
        np.ascontiguousarray(x.reshape(FORWARD[1], n, length, -1).swapaxes(0, 1)) for x in (q, k, v)
    ]
    calls: dict[str, Callable[[], Any]] = {"batched": lambda: f(*batched)}
    if hasattr(sdpa_array, "mods") and hasattr(sdpa_array.mods, "document"):
        mask_mod = sdpa_array.mods.document(doc, doc)
        calls["mask_mod"] = lambda: f(q, k, v, mask_mod=mask_mod)
    calls["segment_ids"] = lambda: f(q, k, v, segment_ids=(doc, doc))
    if hasattr(sdpa_array, "scaled_dot_product_attention_varlen"):
        packed = [np.ascontiguousarray(x[0].swapaxes(0, 1)) for x in (q, k, v)]
        offsets = np.arange(0, n * length + 1, length)
        varlen = sdpa_array.scaled_dot_product_attention_varlen
        calls["varlen"] = lambda: varlen(*packed, offsets, offsets)
    return {name: call for name, call in calls.items() if _runs(call)}


def _runs(call: Callable[[], Any]) -> bool:
    """Whether this commit computes ``call`` (an option it lacks raises)."""
    try:
        call()
    except (TypeError, ValueError, NotImplementedError):
        return False
    return True


def _accuracy() -> float:
    """Our float32 error / torch's, both against the float64 oracle: relative RMS error of
    the output, pooled over a few draws at unit logits and at logits near 30."""
    from sdpa_array import reference

    ours, theirs = [], []
    for seed, spread in [(0, 1.0), (1, 1.0), (2, 6.0), (3, 6.0)]:
        q, k, v = _inputs((1, 4, 256, 64), seed=10 + seed)
        q *= spread
        exact = np.asarray(reference.scaled_dot_product_attention(q, k, v), dtype=np.float64)
        got = np.asarray(sdpa_array.scaled_dot_product_attention(q, k, v), dtype=np.float64)
        peer = (
            torch.nn.functional.scaled_dot_product_attention(
                *(torch.from_numpy(x) for x in (q, k, v))
            )
            .double()
            .numpy()
        )
        ours.append(np.sum((got - exact) ** 2))
        theirs.append(np.sum((peer - exact) ** 2))
    return float(np.sqrt(sum(ours) / sum(theirs)))


class Ratios:
    """The headline ratios, lower is better, from one interleaved run per figure group.

    Each ``track_`` method returns a figure of :meth:`setup_cache`, which measures them
    all once (asv runs it once per benchmark run)."""

    timeout = 900

    def setup_cache(self) -> dict[str, float]:
        if torch is None:
            raise NotImplementedError("the history's peers need torch")
        _threads()
        f = sdpa_array.scaled_dot_product_attention
        q, k, v = _inputs(FORWARD)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        forward = {
            "ours": lambda: f(q, k, v),
            "ours causal": lambda: f(q, k, v, is_causal=True),
            "torch": lambda: sdpa(tq, tk, tv),
            "products": _plain_numpy_forward(q, k, v, softmax=False),
            "products causal": _plain_numpy_forward(q, k, v, softmax=False, causal=True),
            "plain numpy": _plain_numpy_forward(q, k, v),
        }
        if _runs(lambda: f(q, k, v, return_max_scores=True)):
            forward["ours max scores"] = lambda: f(q, k, v, return_max_scores=True)
        times = _interleaved(forward, ROUNDS)
        figures = {
            "gemm_bound": _ratio(times, "ours", "products"),
            "plain_numpy_limit": _ratio(times, "ours", "plain numpy"),
            "torch_forward": _ratio(times, "ours", "torch"),
            "causal": _ratio(times, "ours causal", "ours"),
            "causal_over_products": _ratio_of_ratios(
                times, ("ours causal", "ours"), ("products causal", "products")
            ),
            "max_scores": _ratio(times, "ours max scores", "ours"),
        }

        bq, bk, bv, bg = _inputs(BACKWARD, seed=1, count=4)
        vjp = sdpa_array.scaled_dot_product_attention_vjp
        backward = {
            "ours": lambda: vjp(bq, bk, bv, bg),
            "ours causal": lambda: vjp(bq, bk, bv, bg, is_causal=True),
            "torch": _torch_backward(bq, bk, bv, bg, causal=False),
            "torch causal": _torch_backward(bq, bk, bv, bg, causal=True),
            "products": _plain_numpy_products_backward(bq, bk, bv, bg),
        }
        times = _interleaved(backward, ROUNDS)
        figures["vjp_torch"] = _ratio(times, "ours", "torch")
        figures["vjp_torch_causal"] = _ratio(times, "ours causal", "torch causal")
        figures["vjp_products"] = _ratio(times, "ours", "products")

        times = _interleaved(_document_calls(), ROUNDS)
        for name in ("mask_mod", "segment_ids", "varlen"):
            figures[f"documents_{name}"] = _ratio(times, name, "batched")

        sq, sk, sv = (torch.from_numpy(x) for x in _inputs((1, 8, 128, 64), seed=3))

        def repeated(call: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: [call() for _ in range(50)]

        small = {
            "auto": repeated(lambda: f(sq, sk, sv)),
            "direct": repeated(lambda: sdpa(sq, sk, sv)),
        }
        times = _interleaved(small, ROUNDS)
        figures["torch_small_overhead"] = _ratio(times, "auto", "direct")
        figures["accuracy"] = _accuracy()
        return figures

    def _figure(self, figures: dict[str, float], name: str) -> float:
        """The figure ``name``; NaN (asv's "n/a") where this commit lacks its feature."""
        return figures.get(name, float("nan"))

    def track_gemm_bound(self, figures: dict[str, float]) -> float:
        """Our NumPy forward (1x8x2048x64) / its two matrix products ``(q kᵀ) v`` alone, in
        512-row blocks on the same threads: 1 would be GEMM-bound; good is at or below
        1.2."""
        return self._figure(figures, "gemm_bound")

    track_gemm_bound.unit = "ratio"  # type: ignore[attr-defined]

    def track_plain_numpy_limit(self, figures: dict[str, float]) -> float:
        """Our NumPy forward / the same softmax as a plain NumPy loop of 512-row blocks on
        the same threads: what the library's layers cost over the arithmetic; good is at or
        below 1.05."""
        return self._figure(figures, "plain_numpy_limit")

    track_plain_numpy_limit.unit = "ratio"  # type: ignore[attr-defined]

    def track_torch_forward(self, figures: dict[str, float]) -> float:
        """NumPy ``auto`` (1x8x2048x64) / torch's fused CPU kernel on the same memory; good
        is at or below 1.15."""
        return self._figure(figures, "torch_forward")

    track_torch_forward.unit = "ratio"  # type: ignore[attr-defined]

    def track_causal(self, figures: dict[str, float]) -> float:
        """Our causal forward / the same call without causal: half the pairs, so good is
        near 0.55 (0.5 is the pairs' share)."""
        return self._figure(figures, "causal")

    track_causal.unit = "ratio"  # type: ignore[attr-defined]

    def track_causal_over_products(self, figures: dict[str, float]) -> float:
        """Our causal / non-causal forward, over the same ratio of the tile products alone
        (the plain loop's products over each 512-row block's keys up to its diagonal, and
        over all keys): how much of the products' causal saving our call keeps; good is at
        or below 1.05 (a causal speed-up at least 0.95 of the products' own)."""
        return self._figure(figures, "causal_over_products")

    track_causal_over_products.unit = "ratio"  # type: ignore[attr-defined]

    def track_max_scores(self, figures: dict[str, float]) -> float:
        """Our forward with ``return_max_scores=True`` / without: good is at or below 1.05."""
        return self._figure(figures, "max_scores")

    track_max_scores.unit = "ratio"  # type: ignore[attr-defined]

    def track_vjp_torch(self, figures: dict[str, float]) -> float:
        """Our NumPy VJP (1x8x1024x64, which recomputes the scores) / torch's backward of
        its own kernel: good is at or below 1.2."""
        return self._figure(figures, "vjp_torch")

    track_vjp_torch.unit = "ratio"  # type: ignore[attr-defined]

    def track_vjp_products(self, figures: dict[str, float]) -> float:
        """Our NumPy VJP (1x8x1024x64) / its GEMM bound, the five products of 128-row blocks
        against all keys in a plain loop on the same pool: good is at or below 1.1."""
        return self._figure(figures, "vjp_products")

    track_vjp_products.unit = "ratio"  # type: ignore[attr-defined]

    def track_vjp_torch_causal(self, figures: dict[str, float]) -> float:
        """The same, causal: good is at or below 1.2."""
        return self._figure(figures, "vjp_torch_causal")

    track_vjp_torch_causal.unit = "ratio"  # type: ignore[attr-defined]

    def track_documents_mask_mod(self, figures: dict[str, float]) -> float:
        """8 documents of 256 packed in 2048 with ``mask_mod=mods.document(...)`` / the same
        documents as a batch of 8: good is at or below 1.3."""
        return self._figure(figures, "documents_mask_mod")

    track_documents_mask_mod.unit = "ratio"  # type: ignore[attr-defined]

    def track_documents_segment_ids(self, figures: dict[str, float]) -> float:
        """The same documents with ``segment_ids`` / as a batch: good is at or below 1.3."""
        return self._figure(figures, "documents_segment_ids")

    track_documents_segment_ids.unit = "ratio"  # type: ignore[attr-defined]

    def track_documents_varlen(self, figures: dict[str, float]) -> float:
        """The same documents through ``scaled_dot_product_attention_varlen`` / as a batch:
        good is at or below 1.15."""
        return self._figure(figures, "documents_varlen")

    track_documents_varlen.unit = "ratio"  # type: ignore[attr-defined]

    def track_torch_small_overhead(self, figures: dict[str, float]) -> float:
        """torch tensors (1x8x128x64) through ``auto`` / torch's function called directly:
        the per-call cost of validation and planning; good is at or below 1.05."""
        return self._figure(figures, "torch_small_overhead")

    track_torch_small_overhead.unit = "ratio"  # type: ignore[attr-defined]

    def track_accuracy(self, figures: dict[str, float]) -> float:
        """Our float32 forward's relative RMS error / torch's CPU kernel's, both against the
        float64 oracle: good is at or below 1.05."""
        return self._figure(figures, "accuracy")

    track_accuracy.unit = "ratio"  # type: ignore[attr-defined]


class LongCall:
    """Peak memory of a blocked NumPy forward at L = S = 32768 (1 head, E = 64): its score
    matrix would take 4 GiB; the blocked path's extra memory is ``O(block)``."""

    timeout = 600

    def setup(self) -> None:
        _threads()
        self.q, self.k, self.v = _inputs(LONG, seed=4)

    def peakmem_blocked_forward(self) -> None:
        """The process's peak memory (inputs and libraries included: about 0.3 GiB is the
        baseline); good is far below the 4 GiB of the scores."""
        sdpa_array.scaled_dot_product_attention(self.q, self.k, self.v, implementation="blocked")
