"""Matrix products with a long contraction, split where the library's BLAS would round more.

A BLAS kernel accumulates each element of ``a @ b`` in one chain along the contraction, and
the rounding error of a chain grows with its length. OpenBLAS, which NumPy's wheels ship,
keeps contractions of a few hundred in one chain: the products of attention that sum over a
tile's keys (``P V``, ``dS K``) or rows (``Pᵀ dO``, ``dSᵀ Q``) then made the float32 error
of the NumPy kernels 1.1-1.4x that of torch's CPU kernels.
:func:`matmul` cuts such a contraction into chunks of at most :data:`CHUNK` and adds their
products: the chains are short and the chunks few (the additions are ``K / CHUNK`` passes
over the small result), at about 9 % more time for the product. A sum that is short as a
whole (``whole``, its length across the tiles that add into each result entry, at most
:data:`CHUNK`) is cut into chunks of :data:`SHORT_CHUNK`: its one chain is then its whole
error, and halving it costs little, the problem being small; in a long sum the chains of the
tiles' partial results add up anyway, and chunks below :data:`CHUNK` cost 8-18 % of a
large backward pass (smaller products). Other libraries (torch,
JAX, CuPy, Dask, whose kernels run on other BLAS or on a device, where each chunk would be a
launch) get one product.

The scores ``q kᵀ`` sum over the features, whose chain (64 or 128 long) is short, but their
error is the whole call's where the scores are large: a score's rounding error grows with its
magnitude and shifts its weight by as much, so at logits of ~1e3 the float32 output's error
is 3-6x what correctly rounded scores would give (1.5x at unit logits; one thread, the shapes
of ``asv_benchmarks/studies/accuracy_gaps.py``). :func:`scores` takes
``chunks`` (:func:`score_chunks`: at least two, of at most :data:`SCORE_CHUNK` features) where
the scores may be large: the blocked kernels where the call's score bound (the soft-cap's
where smaller) exceeds the fixed reference's limit
(:func:`~sdpa_array._kernels.score_bound.chunks_from_bound`); the materialized forward, whose
small calls the bound's reading would slow, where a row's largest scaled product does (it
computes the scores again in chunks, :mod:`sdpa_array._kernels.materialized`), and the
materialized VJP from the bound where its calls are not small
(:data:`~sdpa_array._kernels.vjp_materialized.MIN_BOUND_PAIRS`). The chunks after
the first are computed into a scratch buffer (at most :data:`BATCHED_BYTES`), so that they
take no fresh memory, whose page faults cost more than the product here: a product takes one
from a shared set and gives it back when done, which keeps at most :data:`KEPT_SCRATCH` of
them per dtype (however many threads call), and :func:`release_scratch` empties.
"""

from __future__ import annotations

import math
import threading
from types import ModuleType

import numpy as np

from . import inplace
from .compat import namespace_name
from .typing import Array

__all__ = [
    "BATCHED_BYTES",
    "BATCHED_CHUNKS",
    "CHUNK",
    "KEPT_SCRATCH",
    "SCORE_CHUNK",
    "SHORT_CHUNK",
    "SPLIT_LIBRARIES",
    "TRANSPOSE_LIBRARIES",
    "matmul",
    "release_scratch",
    "score_chunks",
    "scores",
    "transposes",
]

#: Longest contraction computed as one product where :data:`SPLIT_LIBRARIES` apply.
CHUNK = 128

#: The same, for a sum whose whole length is at most :data:`CHUNK`.
SHORT_CHUNK = 64

#: Chunks from which NumPy computes their products as one stacked product
#: (:func:`_batched`): fewer calls, where two chunks' stacked product is slower than the
#: two.
BATCHED_CHUNKS = 4

#: Largest stacked product (bytes) :func:`_batched` makes: a tile's (the backward's ``dQ``
#: at 2048 keys stacks 512 KiB), not a whole call's, whose stack of ``K / CHUNK`` results
#: would add to its peak memory (the materialized paths').
BATCHED_BYTES = 4 * 2**20

#: Namespaces (as :func:`namespace_name` spells them) on OpenBLAS through NumPy.
SPLIT_LIBRARIES = frozenset({"numpy", "array_api_strict"})

#: Most features per chunk of the scores' contraction where :func:`score_chunks` cuts it.
SCORE_CHUNK = 64

#: Fewest features per chunk: smaller contractions stay whole.
MIN_SCORE_CHUNK = 16


def score_chunks(xp: ModuleType, features: int) -> int:
    """Into how many chunks :func:`scores` cuts ``q kᵀ`` over ``features`` where the scores
    may be large: on :data:`SPLIT_LIBRARIES`, at least two and at most :data:`SCORE_CHUNK`
    features each (none below :data:`MIN_SCORE_CHUNK`); elsewhere one product."""
    if namespace_name(xp) not in SPLIT_LIBRARIES or features < 2 * MIN_SCORE_CHUNK:
        return 1
    return max(2, -(-features // SCORE_CHUNK))


#: Namespaces (NumPy's OpenBLAS) whose ``a @ bᵀ`` with many more columns than rows runs
#: faster as ``(b @ aᵀ)ᵀ``: 128 x 2048 scores from 64 features take 1.15x the time of the
#: 2048 x 128 product on the development machine.
TRANSPOSE_LIBRARIES = frozenset({"numpy"})


def transposes(xp: ModuleType, a: Array, b: Array) -> bool:
    """Whether :func:`scores` computes ``a @ bᵀ`` as ``(b @ aᵀ)ᵀ``: on
    :data:`TRANSPOSE_LIBRARIES`, where ``b`` has more rows than ``a``."""
    return namespace_name(xp) in TRANSPOSE_LIBRARIES and int(b.shape[-2]) > int(a.shape[-2])


def scores(xp: ModuleType, a: Array, b: Array, *, transposed: bool, chunks: int = 1) -> Array:
    """``a @ bᵀ``; ``transposed`` (where :func:`transposes` says so): as the transposed view
    of ``b @ aᵀ``, whose rows are strided (a reduction along them is best a product, as in
    :func:`~sdpa_array._kernels.softmax.row_sum`). ``chunks`` (:func:`score_chunks`): the
    contraction cut into that many balanced chunks whose products are added in order, where
    both operands have more than one row (a product with one row is a matrix-vector one,
    whose BLAS kernel already sums in several short chains)."""
    if chunks > 1 and min(int(a.shape[-2]), int(b.shape[-2])) > 1:
        if transposed:
            return xp.matrix_transpose(_chunked_scores(xp, b, a, chunks))
        return _chunked_scores(xp, a, b, chunks)
    if transposed:
        return xp.matrix_transpose(xp.matmul(b, xp.matrix_transpose(a)))
    return xp.matmul(a, xp.matrix_transpose(b))


def matmul(xp: ModuleType, a: Array, b: Array, whole: int | None = None) -> Array:
    """``a @ b``; on :data:`SPLIT_LIBRARIES` a contraction longer than :data:`CHUNK` (than
    :data:`SHORT_CHUNK` where the sum's ``whole`` length, default the contraction's own,
    is at most :data:`CHUNK`) is cut into balanced chunks whose products are added in
    order."""
    k = int(a.shape[-1])
    chunk = CHUNK if (k if whole is None else whole) > CHUNK else SHORT_CHUNK
    if k <= chunk or namespace_name(xp) not in SPLIT_LIBRARIES:
        return xp.matmul(a, b)
    count = -(-k // chunk)
    size = -(-k // count)
    if count >= BATCHED_CHUNKS and k == count * size and namespace_name(xp) == "numpy":
        lead = math.prod(inplace._broadcast_shape(tuple(a.shape[:-2]), tuple(b.shape[:-2])) or ())
        stacked = lead * count * int(a.shape[-2]) * int(b.shape[-1]) * a.dtype.itemsize
        if stacked <= BATCHED_BYTES:
            return _batched(a, b, count, size)
    return _sum_of_chunks(xp, a, b, size, scratch=False)


def _chunked_scores(xp: ModuleType, a: Array, b: Array, count: int) -> Array:
    """``a @ bᵀ`` from ``count`` balanced chunks of the contraction (:func:`_sum_of_chunks`)."""
    size = -(-int(a.shape[-1]) // count)
    return _sum_of_chunks(xp, a, xp.matrix_transpose(b), size, scratch=True)


def _sum_of_chunks(xp: ModuleType, a: Array, b: Array, size: int, *, scratch: bool) -> Array:
    """``a @ b`` as the products of the contraction's chunks of ``size``, added in order into
    the first chunk's product. ``scratch``: on NumPy the other chunks' products go to a
    scratch buffer (:func:`_take_scratch`), which is never returned: no fresh memory per
    chunk."""
    k = int(a.shape[-1])
    out = xp.matmul(a[..., :size], b[..., :size, :])
    buffer = _take_scratch(out) if scratch and namespace_name(xp) == "numpy" else None
    try:
        for start in range(size, k, size):
            pair = a[..., start : start + size], b[..., start : start + size, :]
            if buffer is None:
                out = inplace.add(out, xp.matmul(*pair))
            else:
                np.add(out, np.matmul(*pair, out=_shaped(buffer, out)), out=out)
    finally:
        if buffer is not None:
            _give_scratch(buffer)
    return out


#: Most scratch buffers kept per dtype between products (each at most
#: :data:`BATCHED_BYTES`): as many as the NumPy pool's default threads.
KEPT_SCRATCH = 4

#: The scratch buffers no product holds now, by dtype (flat, each at most
#: :data:`BATCHED_BYTES`), and the lock that guards them.
_kept: dict[np.dtype, list[np.ndarray]] = {}
_kept_lock = threading.Lock()


def _take_scratch(like: np.ndarray) -> np.ndarray | None:
    """A flat scratch buffer with room for ``like`` (a score tile's product) of its dtype,
    the product's own until :func:`_give_scratch`: a kept one if one is large enough, else a
    new one; ``None`` beyond :data:`BATCHED_BYTES` (such a product gets fresh memory)."""
    if like.nbytes > BATCHED_BYTES:
        return None
    with _kept_lock:
        free = _kept.get(like.dtype, [])
        for i, kept in enumerate(free):
            if kept.size >= like.size:
                return free.pop(i)
    return np.empty(like.size, dtype=like.dtype)


def _give_scratch(buffer: np.ndarray) -> None:
    """Keep ``buffer`` for later products, unless :data:`KEPT_SCRATCH` of its dtype are
    kept already: the smallest of them and it is dropped."""
    with _kept_lock:
        free = _kept.setdefault(buffer.dtype, [])
        free.append(buffer)
        if len(free) > KEPT_SCRATCH:
            del free[min(range(len(free)), key=lambda i: free[i].size)]


def _shaped(buffer: np.ndarray, like: np.ndarray) -> np.ndarray:
    """The start of the flat ``buffer`` as an array of ``like``'s shape."""
    return np.reshape(buffer[: like.size], like.shape)


def release_scratch() -> None:
    """Drop the kept scratch buffers (one that a product holds now is kept again when the
    product gives it back)."""
    with _kept_lock:
        _kept.clear()


def _batched(a: Array, b: Array, count: int, size: int) -> Array:
    """The chunks' products as one stacked NumPy product, added along its chunk axis: the
    chunks are views (``a``'s last axis split, ``b``'s rows). NumPy adds them in order
    (the per-chunk sums bit for bit), except where the result has one element, whose
    additions it makes pairwise."""
    m, n = int(a.shape[-2]), int(b.shape[-1])
    lead_a, lead_b = tuple(a.shape[:-2]), tuple(b.shape[:-2])
    pieces_a = np.moveaxis(np.reshape(a, (*lead_a, m, count, size)), -2, -3)
    pieces_b = np.reshape(b, (*lead_b, count, size, n))
    return np.sum(np.matmul(pieces_a, pieces_b), axis=-3)
