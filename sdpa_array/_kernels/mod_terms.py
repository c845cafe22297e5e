"""Mask, bias and score functions in the kernels: a restriction member and score terms.

``mask_mod`` becomes a :class:`ModMask`, a member of
:class:`~sdpa_array._kernels.restrictions.Restrictions`, ``bias_mod`` a :class:`ModBias` and
``score_mod`` a :class:`ModScore`, fields of
:class:`~sdpa_array._kernels.score_terms.ScoreTerms`; each calls its function on the index
arrays of one tile (:class:`ModIndices`), never on the whole ``(L, S)`` grid unless the tile
is the grid (the materialized kernel).

A :class:`ModMask` classifies tiles from block classes (:class:`BlockClasses`): those of a
:class:`~sdpa_array._problem.block_mask.BlockMask` the caller made, or, for a plain function, those
it gives on index arrays of the inputs' library (on NumPy ones for the ready-made functions
of :mod:`sdpa_array.mods`, which give the same values there), computed the first time a
planner asks. Where the classes cannot be read (traced or lazy data, or on a GPU for a
user's function) every tile is partial and is masked by evaluating the function: the
results are the same, only fewer tiles are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import (
    elementwise_derivative,
    has_autodiff,
    namespace_name,
    stop_gradient,
)
from .._arrays.slicing import at_batch
from .._arrays.typing import Array
from .._problem.block_mask import (
    EMPTY,
    FULL,
    HOST_BLOCK,
    BlockMask,
    classify_in,
    classify_on_host,
    segment_classes,
)
from .._problem.mod_calls import call_mod, index_grid
from .._problem.mod_parameters import diagonal_sums, has_parameters, sum_where_constant
from .._problem.mods_data import DocumentMod, NamedMod
from .._problem.problem import Problem
from .restrictions import TileKind

__all__ = [
    "BlockClasses",
    "ModBias",
    "ModIndices",
    "ModMask",
    "ModScore",
    "mod_bias",
    "mod_mask",
    "mod_score",
    "score_mod_derivable",
]


@dataclass(frozen=True)
class ModIndices:
    """The ``batch`` and ``head`` index arrays of a (slice of the) kernel layout.

    Attributes
    ----------
    batch, head : array
        Flat batch index and query head index, shaped to broadcast against the kernel
        layout's batch axes (see :func:`~sdpa_array._problem.mod_calls.index_grid`).
    shape : tuple of int
        The kernel batch shape they cover.
    xp : module
        The inputs' namespace.
    device : object
        The inputs' device.
    """

    batch: Array
    head: Array
    shape: tuple[int, ...]
    xp: ModuleType
    device: Any

    def at(self, index: tuple[int, ...]) -> ModIndices:
        """The indices of the outer batch slice ``index``."""
        if not index:
            return self
        return replace(
            self,
            batch=at_batch(self.batch, index),
            head=at_batch(self.head, index),
            shape=self.shape[len(index) :],
        )

    def grid(self, rows: slice, cols: slice) -> tuple[tuple[Array, ...], tuple[int, ...]]:
        """The index arrays ``(batch, head, q_idx, kv_idx)`` of the tile (``rows``,
        ``cols``) and the shape of its scores."""
        xp, before = self.xp, (1,) * len(self.shape)
        q = xp.reshape(xp.arange(rows.start, rows.stop, device=self.device), (*before, -1, 1))
        kv = xp.reshape(xp.arange(cols.start, cols.stop, device=self.device), (*before, 1, -1))
        shape = (*self.shape, rows.stop - rows.start, cols.stop - cols.start)
        return (self.batch, self.head, q, kv), shape

    def call(self, name: str, mod: Callable[..., Any], rows: slice, cols: slice) -> Array:
        """``mod`` on the tile (``rows``, ``cols``), checked (:func:`~._mod_calls.call_mod`).

        torch's and JAX's autodiff follow the values back to the data the function
        captured (a trainable table: the library's own autodiff then gives it its gradient
        where it differentiates the call whole, :mod:`sdpa_array._plan.autograd`).
        """
        indices, shape = self.grid(rows, cols)
        return call_mod(name, mod, indices, shape)


def _indices(p: Problem) -> ModIndices:
    seq = p.sequence_batch
    heads = p.kernel_batch[len(seq) :]
    batch, head, _, _ = index_grid(p.xp, p.device, seq, heads, slice(0, 1), slice(0, 1))
    return ModIndices(batch, head, p.kernel_batch, p.xp, p.device)


class BlockClasses:
    """Block classes of a mask function in the kernel layout, computed on first use.

    ``compute`` returns them as ``(B', H', nq, nk)``
    (:class:`~sdpa_array._problem.block_mask.BlockMask`'s ``kinds``) or ``None``; they are
    placed in the kernel layout (the batch and heads axes whole where the function depends
    on them, of size 1 otherwise) and, for a batch slice, cut to it. :meth:`reduced` gives
    what the planners need: whether each block is nonempty for some, and full for every,
    batch element and head of the slice.
    """

    def __init__(
        self,
        compute: Callable[[], np.ndarray | None],
        p: Problem,
        block_q: int,
        block_k: int,
        parent: BlockClasses | None = None,
        index: tuple[int, ...] = (),
    ) -> None:
        self._compute, self._p = compute, p
        self.block_q, self.block_k = block_q, block_k
        self._parent, self._index = parent, index
        self._layout: np.ndarray | None = None
        self._reduced: tuple[np.ndarray, np.ndarray] | None = None
        self._done = False

    def layout(self) -> np.ndarray | None:
        """The classes with the kernel layout's batch axes (``None``: not classified)."""
        if not self._done:
            if self._parent is not None:
                whole = self._parent.layout()
                self._layout = None if whole is None else at_batch(whole, self._index)
            else:
                self._layout = self._place(self._compute())
            self._done = True
        return self._layout

    def _place(self, kinds: np.ndarray | None) -> np.ndarray | None:
        if kinds is None:
            return None
        p = self._p
        seq, heads = p.sequence_batch, p.kernel_batch[len(p.sequence_batch) :]
        b, h = kinds.shape[:2]
        shape = (
            *(seq if b != 1 else (1,) * len(seq)),
            *(heads if h != 1 else (1,) * len(heads)),
            *kinds.shape[2:],
        )
        return np.reshape(kinds, shape)

    def reduced(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(nonempty, full)`` boolean ``(nq, nk)``, over the slice's batch and heads."""
        if self._reduced is None:
            kinds = self.layout()
            if kinds is None:
                return None
            flat = np.reshape(kinds, (-1, *kinds.shape[-2:]))
            self._reduced = (np.any(flat != EMPTY, axis=0), np.all(flat == FULL, axis=0))
        return self._reduced

    @property
    def per_sequence(self) -> bool:
        """Whether the classes differ between batch elements (along the sequence axes)."""
        kinds = self.layout()
        n = len(self._p.sequence_batch)
        return kinds is not None and any(m != 1 for m in kinds.shape[:n])

    def at(self, index: tuple[int, ...]) -> BlockClasses:
        return BlockClasses(self._compute, self._p, self.block_q, self.block_k, self, index)


def _span(blocks: np.ndarray, size: int, limit: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` covered by the first to the last ``True`` block."""
    hit = np.flatnonzero(blocks)
    if not hit.size:
        return 0, 0
    return int(hit[0]) * size, min(limit, (int(hit[-1]) + 1) * size)


def _longest_run(blocks: np.ndarray, size: int, limit: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of the (first) longest run of consecutive ``True`` blocks."""
    edges = np.diff(np.concatenate([[0], blocks.astype(np.int8), [0]]))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not starts.size:
        return 0, 0
    longest = int(np.argmax(stops - starts))
    return int(starts[longest]) * size, min(limit, int(stops[longest]) * size)


@dataclass(frozen=True)
class ModMask:
    """``mask_mod`` as a restriction member (see the module docstring)."""

    mod: Callable[..., Any]
    indices: ModIndices
    classes: BlockClasses
    L: int
    S: int

    @property
    def per_sequence(self) -> bool:
        return self.classes.per_sequence

    def _blocks(self, q_start: int, q_stop: int) -> tuple[np.ndarray, np.ndarray] | None:
        reduced = self.classes.reduced()
        if reduced is None:
            return None
        bq = self.classes.block_q
        rows = slice(q_start // bq, -(-q_stop // bq))
        return reduced[0][rows], reduced[1][rows]

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        blocks = self._blocks(q_start, q_stop)
        if blocks is None:
            return 0, self.S
        return _span(np.any(blocks[0], axis=0), self.classes.block_k, self.S)

    def full_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        blocks = self._blocks(q_start, q_stop)
        if blocks is None or q_start >= q_stop:
            return 0, 0
        return _longest_run(np.all(blocks[1], axis=0), self.classes.block_k, self.S)

    def query_range(self, k_start: int, k_stop: int) -> tuple[int, int]:
        """Queries outside which none may attend a key of ``[k_start, k_stop)``: the span
        of the query blocks whose classes admit a pair there (every query where the
        blocks are not classified)."""
        reduced = self.classes.reduced()
        if reduced is None:
            return 0, self.L
        bk = self.classes.block_k
        span = slice(k_start // bk, -(-k_stop // bk))
        return _span(np.any(reduced[0][:, span], axis=1), self.classes.block_q, self.L)

    def classify(self, rows: slice, cols: slice) -> TileKind:
        """The tile's class from the blocks it overlaps (partial when not classified).

        The whole grid (the materialized kernel's one tile) is never classified: it is
        computed whatever its class.
        """
        if rows.start == 0 and rows.stop >= self.L and cols.start == 0 and cols.stop >= self.S:
            return TileKind.PARTIAL
        blocks = self._blocks(rows.start, rows.stop)
        if blocks is None:
            return TileKind.PARTIAL
        bk = self.classes.block_k
        span = slice(cols.start // bk, -(-cols.stop // bk))
        if not np.any(blocks[0][:, span]):
            return TileKind.EMPTY
        return TileKind.FULL if np.all(blocks[1][:, span]) else TileKind.PARTIAL

    def tile_mask(self, xp: ModuleType, device: Any, rows: slice, cols: slice) -> Array:
        return stop_gradient(self.indices.xp, self.indices.call("mask_mod", self.mod, rows, cols))

    def at(self, index: tuple[int, ...]) -> ModMask:
        if not index:
            return self
        return replace(self, indices=self.indices.at(index), classes=self.classes.at(index))


@dataclass(frozen=True)
class ModBias:
    """``bias_mod`` as a score term: its values on a tile, in the compute dtype; with
    ``trainable``, the backward kernels also take its parameters' cotangents
    (:meth:`cotangents`)."""

    mod: Callable[..., Any]
    indices: ModIndices
    trainable: bool = False

    def tile(self, rows: slice, cols: slice, dtype: Any) -> Array:
        values = self.indices.call("bias_mod", self.mod, rows, cols)
        return values if values.dtype == dtype else self.indices.xp.astype(values, dtype)

    def cotangents(self, dz: Array, rows: slice, cols: slice) -> tuple[Array, ...]:
        """The tile's part of each parameter's gradient, from the tile's score gradient
        ``dz`` (the bias is added to the scores, so ``dz`` is its cotangent).

        A function of the head and the relative position only (``offset_cotangents``:
        T5's buckets) gets ``dz`` summed along the tile's diagonals first
        (:func:`~sdpa_array._problem.mod_parameters.diagonal_sums`: the tile's indices are
        ranges, so each diagonal is one relative position), ``r + c - 1`` sums instead of
        ``r * c`` entries.
        """
        indices, _ = self.indices.grid(rows, cols)
        by_offset = getattr(self.mod, "offset_cotangents", None)
        if by_offset is None:
            return tuple(self.mod.parameter_cotangents(dz, *indices))  # type: ignore[attr-defined]
        xp = self.indices.xp
        reduced, head = sum_where_constant(xp, dz, indices[1], tail=2)
        sums = diagonal_sums(xp, reduced)
        first = cols.start - rows.start - (rows.stop - rows.start - 1)
        offsets = xp.arange(first, first + int(sums.shape[-1]), device=self.indices.device)
        return tuple(by_offset(sums, head[..., 0], offsets))

    def at(self, index: tuple[int, ...]) -> ModBias:
        return replace(self, indices=self.indices.at(index))


def mod_mask(p: Problem) -> ModMask | None:
    """The :class:`ModMask` of ``p.mask_mod`` (``None`` without one)."""
    mod = p.mask_mod
    if mod is None:
        return None
    seq = p.sequence_batch
    heads = p.kernel_batch[len(seq) :]
    if isinstance(mod, BlockMask):
        given = mod
        classes = BlockClasses(lambda: given.kinds, p, given.block_q, given.block_k)
        function = given.mask_mod
    else:
        batch, n_heads = (math.prod(seq),), (math.prod(heads),)
        classes = BlockClasses(lambda: _classify(p, mod, batch, n_heads), p, HOST_BLOCK, HOST_BLOCK)
        function = mod
    return ModMask(function, _indices(p), classes, p.L, p.S)


def _classify(
    p: Problem, mod: Callable[..., Any], batch: tuple[int, ...], heads: tuple[int, ...]
) -> np.ndarray | None:
    """Block classes of a plain mask function: on the host for the ready-made functions,
    which give the same values on NumPy indices; else with index arrays of the inputs'
    library, as every call of a user's function is made (not on a GPU, where reading the
    classes back would wait for the device: there its tiles are all evaluated)."""
    if isinstance(mod, NamedMod) and mod.host_equivalent:
        kinds = _document_classes(mod, p) if isinstance(mod, DocumentMod) else None
        if kinds is not None and kinds.shape[0] in (1, batch[0]):
            return kinds
        return classify_on_host(mod, batch, heads, p.L, p.S)
    if p.on_gpu:
        return None
    return classify_in(p.xp, p.device, mod, batch, heads, p.L, p.S)


def _document_classes(mod: DocumentMod, p: Problem) -> np.ndarray | None:
    """A document mask's classes from its segment ids alone (:func:`segment_classes`), or
    ``None`` where they cannot be read on the host."""
    try:
        query, key = mod.query.host(), mod.key.host()
    except TypeError:
        return None
    return segment_classes(query, key, p.L, p.S, HOST_BLOCK, HOST_BLOCK)


def mod_bias(p: Problem) -> ModBias | None:
    """The :class:`ModBias` of ``p.bias_mod`` (``None`` without one).

    A bias function with an ``in_dtype(dtype)`` method (the ready-made ones of
    :mod:`sdpa_array.mods` that compute in floating point) is replaced by what that method
    returns for the compute dtype: the same bias computed in that dtype, so that no tile is
    computed in float64 and cast down.
    """
    mod = p.bias_mod
    if mod is None:
        return None
    in_dtype = getattr(mod, "in_dtype", None)
    computed = mod if in_dtype is None else in_dtype(p.compute_dtype)
    trainable = p.mod_gradients and has_parameters(mod)
    return ModBias(computed, _indices(p), trainable=trainable)


@dataclass(frozen=True)
class ModScore:
    """``score_mod`` as a score term: applied to a tile's scaled scores, with its
    derivative for the backward pass; with ``trainable``, the backward kernels also take
    its parameters' cotangents (:meth:`cotangents`).

    ``derivative`` is the function's own ``derivative`` method where it has one; without
    it the derivative comes from the library's autodiff
    (:func:`~sdpa_array._arrays.compat.elementwise_derivative`).
    """

    mod: Callable[..., Any]
    derivative: Callable[..., Any] | None
    indices: ModIndices
    trainable: bool = False

    def _checked(
        self,
        name: str,
        f: Callable[..., Any],
        s: Array,
        grid: tuple[tuple[Array, ...], tuple[int, ...]],
    ) -> Array:
        """``f(s, *indices)`` on the tile whose :meth:`ModIndices.grid` is ``grid``,
        checked, in ``s``'s dtype and shape."""
        out = call_mod(name, f, *grid, score=s)
        xp = self.indices.xp
        if out.dtype != s.dtype:
            out = xp.astype(out, s.dtype)
        return out if tuple(out.shape) == tuple(s.shape) else xp.broadcast_to(out, s.shape)

    def tile(self, s: Array, rows: slice, cols: slice) -> Array:
        """``score_mod`` of the scores ``s`` of the tile (``rows``, ``cols``)."""
        return self._checked("score_mod", self.mod, s, self.indices.grid(rows, cols))

    def tile_and_slope(self, s: Array, rows: slice, cols: slice) -> tuple[Array, Array]:
        """``score_mod(s)`` and its derivative with respect to ``s`` on the tile."""
        grid = self.indices.grid(rows, cols)
        if self.derivative is not None:
            slope = self._checked("score_mod.derivative", self.derivative, s, grid)
            return self._checked("score_mod", self.mod, s, grid), slope
        found = elementwise_derivative(
            self.indices.xp, lambda x: self._checked("score_mod", self.mod, x, grid), s
        )
        if found is None:  # checked before any work (score_mod_derivable)
            raise TypeError("score_mod has no derivative")
        return found

    def cotangents(self, d_mod: Array, s: Array, rows: slice, cols: slice) -> tuple[Array, ...]:
        """The tile's part of each parameter's gradient, from the gradient ``d_mod`` of the
        function's values on the tile and the scaled scores ``s`` it was applied to."""
        indices, _ = self.indices.grid(rows, cols)
        return tuple(self.mod.parameter_cotangents(d_mod, s, *indices))  # type: ignore[attr-defined]

    def at(self, index: tuple[int, ...]) -> ModScore:
        return replace(self, indices=self.indices.at(index))


def mod_score(p: Problem) -> ModScore | None:
    """The :class:`ModScore` of ``p.score_mod`` (``None`` without one)."""
    mod = p.score_mod
    if mod is None:
        return None
    trainable = p.mod_gradients and has_parameters(mod)
    return ModScore(mod, getattr(mod, "derivative", None), _indices(p), trainable=trainable)


def score_mod_derivable(p: Problem) -> None:
    """Raise ``TypeError`` when a gradient through ``p.score_mod`` cannot be computed: the
    function has no ``derivative`` method and the inputs' library no autodiff."""
    mod = p.score_mod
    if mod is None or getattr(mod, "derivative", None) is not None:
        return
    if not has_autodiff(p.xp):
        library = namespace_name(p.xp)
        raise TypeError(
            f"score_mod {getattr(mod, '__qualname__', mod)!r} has no derivative method, and "
            f"{library} arrays have no autodiff to find one: give the gradient's score "
            "function with its derivative, sdpa_array.mods.score_function(score_mod, "
            "derivative)"
        )
