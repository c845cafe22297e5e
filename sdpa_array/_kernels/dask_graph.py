"""Attention on Dask arrays as a graph that follows the chunks (the one place importing Dask).

The forward graph has one task per (batch chunk, query chunk, key chunk) *pair*: it calls the
blocked kernel (:func:`~.blocked.blocked_attention`) on the materialized blocks, in the
blocks' own library (NumPy, CuPy), with the restrictions moved to the pair's absolute
offsets, and returns the partial ``(out, lse)`` over that key chunk. A tree of
:func:`~sdpa_array.merge_attention_states` tasks (fan-in :data:`SPLIT_EVERY`, or the Dask
config value ``"sdpa_array.split_every"``) merges the partials of each query chunk.

* Chunks along batch and heads are independent; size-1 (broadcast) axes stay one chunk.
* Pairs that causal or window positions, or lengths and segment ids whose values are on the
  host, exclude entirely get no task (about half of them for causal attention).
* Masks, biases, lengths and segment ids given as Dask arrays are rechunked to match; with
  ``alignment="bottom_right"`` and lengths, the per-sequence diagonal becomes a boolean mask
  built in the task by index arithmetic.
* Nothing is computed during the call; the graph has ``O(pairs)`` tasks, each holding one
  query chunk, one key/value chunk and its ``(block_q, block_k)`` tiles.

The backward graph (:func:`dask_vjp`) has the same pairs: each runs the blocked VJP with the
merged forward's rows of ``out`` and ``lse`` and returns its gradients summed to the input
blocks' shapes; tree sums add them per block of each input.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace, device, is_dask_array
from .._arrays.typing import Array
from .._problem.band import Band
from .._problem.options import Options
from .._problem.outputs import Outputs
from .._problem.problem import Inputs, Problem, validate
from .._problem.sequences import lengths_at
from .blocked import blocked_attention
from .layout import broadcast_if_needed, grouped_operand, grouped_score_term, sum_to_shape, ungroup
from .restrictions import Restriction, Restrictions, TileKind
from .result import AttentionResult, RawGrads
from .sequences import sequence_members
from .vjp_blocked import blocked_vjp

__all__ = ["SPLIT_EVERY", "dask_attention", "dask_vjp"]

#: Partials merged (or gradients summed) per reduction task by default.
SPLIT_EVERY = 8

#: Above this many sequences in a batch chunk, pairs are planned with the restrictions of
#: the whole batch (a superset of the keys, so still exact) instead of sequence by sequence.
MAX_PLANNED_SEQUENCES = 256

Key = Any


@dataclass(frozen=True)
class _Static:
    """What every pair task needs besides its blocks (pickled once per task)."""

    band: Band
    shifted: bool  # bottom_right with lengths: per-sequence diagonal, built as a mask
    softcap: float | None
    scale: float | None  # None: the caller's 0-d array, passed as a block
    enable_gqa: bool
    Ev: int
    compute: str
    block_q: int | None
    block_k: int | None


@dataclass(frozen=True)
class _Placed:
    """An operand padded to the grid's rank and rechunked to the grid."""

    array: Any
    broadcast: tuple[bool, ...]

    def key(self, index: tuple[int, ...]) -> Key:
        at = (0 if b else i for b, i in zip(self.broadcast, index, strict=True))
        return (self.array.name, *at)


def _place(a: Any, chunks: list[tuple[int, ...]]) -> _Placed | None:
    if a is None:
        return None
    ndim = len(chunks)
    if a.ndim < ndim:
        a = a.reshape((1,) * (ndim - a.ndim) + tuple(a.shape))
    flat = tuple(n == 1 for n in a.shape)  # broadcast: one block, index 0
    target = tuple((1,) if b else c for b, c in zip(flat, chunks, strict=True))
    return _Placed(a.rechunk(target), flat)


@dataclass(frozen=True)
class _Grid:
    """The chunks of the call and its operands placed on them."""

    batch: list[tuple[int, ...]]  # per batch axis (query heads last)
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    ops: dict[str, _Placed | None]

    def pairs(self) -> Iterator[tuple[tuple[int, ...], int, int, int, int, int, int]]:
        """``(batch index, R, C, r0, r1, c0, c1)`` of every chunk pair."""
        for b in itertools.product(*(range(len(c)) for c in self.batch)):
            for (R, r0, r1), (C, c0, c1) in itertools.product(_spans(self.rows), _spans(self.cols)):
                yield b, R, C, r0, r1, c0, c1

    def batch_shape(self, b: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(c[i] for c, i in zip(self.batch, b, strict=True))

    def sequences(self, b: tuple[int, ...]) -> list[range]:
        """The sequence-batch indices (no heads axis) of batch chunk ``b``."""
        return [range(s, s + n) for s, n in _starts(self.batch[:-1], b[:-1])]

    def keys(self, b: tuple[int, ...], R: int, C: int) -> list[Key | None]:
        """Block keys of one pair, in the order of :func:`_chunk_call`'s arguments."""
        seq = b[:-1]
        index = {
            "q": (*b, R, 0), "k": (*b, C, 0), "v": (*b, C, 0), "mask": (*b, R, C),
            "bias": (*b, R, C), "scale": (), "ql": seq, "kl": seq, "qs": (*seq, R),
            "ks": (*seq, C),
        }  # fmt: skip
        return [None if op is None else op.key(index[n]) for n, op in self.ops.items()]


def _spans(chunks: tuple[int, ...]) -> list[tuple[int, int, int]]:
    starts = np.cumsum((0, *chunks))
    return [(i, int(starts[i]), int(starts[i + 1])) for i in range(len(chunks))]


def _starts(chunks: list[tuple[int, ...]], index: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(int(sum(c[:i])), c[i]) for c, i in zip(chunks, index, strict=True)]


def _grid(p: Problem, x: Inputs) -> _Grid:
    nb = len(p.batch_shape)
    arrays = (x.query, x.key, x.value, x.mask, x.bias)
    pad = dict(zip(("q", "k", "v", "mask", "bias"), arrays, strict=True))
    for name, a in pad.items():
        if a is not None and a.ndim < nb + 2:
            pad[name] = a.reshape((1,) * (nb + 2 - a.ndim) + tuple(a.shape))
    batch: list[tuple[int, ...]] = []
    for i, n in enumerate(p.batch_shape):
        if p.grouped and i == nb - 1:
            batch.append(tuple(c * p.groups for c in pad["k"].chunks[i]))
            continue
        source = next((a for a in pad.values() if a is not None and a.shape[i] == n), None)
        batch.append(source.chunks[i] if source is not None and n != 1 else (n,))
    kv_batch = list(batch)
    if p.grouped:
        kv_batch[-1] = tuple(c // p.groups for c in batch[-1])
    rows, cols = pad["q"].chunks[-2], pad["k"].chunks[-2]
    seq = batch[:-1]
    ql, kl, sg = p.query_lengths, p.key_lengths, p.segments
    ops = {
        "q": _place(pad["q"], [*batch, rows, (p.E,)]),
        "k": _place(pad["k"], [*kv_batch, cols, (p.E,)]),
        "v": _place(pad["v"], [*kv_batch, cols, (p.Ev,)]),
        "mask": _place(pad["mask"], [*batch, rows, cols]),
        "bias": _place(pad["bias"], [*batch, rows, cols]),
        "scale": None if x.scale is None else _place(x.scale, []),
        "ql": None if ql is None else _place(ql.array, list(seq)),
        "kl": None if kl is None else _place(kl.array, list(seq)),
        "qs": None if sg is None else _place(sg.query, [*seq, rows]),
        "ks": None if sg is None else _place(sg.key, [*seq, cols]),
    }
    return _Grid(batch, rows, cols, ops)


def _planner(p: Problem) -> Callable[[list[range], slice, slice], bool]:
    """Whether a pair is excluded for every sequence of its batch chunk (host values only)."""
    members, replaces_band = sequence_members(p)
    everything: list[Restriction] = list(members)
    if p.band.restricts and not replaces_band:
        everything.append(p.band)
    whole = Restrictions(tuple(everything), p.L, p.S)

    def excluded(sequences: list[range], rows: slice, cols: slice) -> bool:
        if not whole.per_sequence or math.prod(len(r) for r in sequences) > MAX_PLANNED_SEQUENCES:
            return whole.classify(rows, cols) is TileKind.EMPTY
        return all(
            whole.at(index).classify(rows, cols) is TileKind.EMPTY
            for index in itertools.product(*sequences)
        )

    return excluded


def _chunk_call(
    st: _Static, r0: int, c0: int, q: Array, k: Array, v: Array, mask: Array, bias: Array,
    scale: Array, ql: Array, kl: Array, qs: Array, ks: Array,
) -> tuple[Problem, Inputs]:  # fmt: skip
    """The validated chunk problem of one pair: its restrictions at the pair's offsets."""
    xp = array_namespace({"query": q})
    Lc, Sc = int(q.shape[-2]), int(k.shape[-2])
    q_len = None if ql is None else lengths_at(xp, ql, r0, Lc)
    k_len = None if kl is None else lengths_at(xp, kl, c0, Sc)
    band = replace(st.band, L=Lc, S=Sc, offset=st.band.offset + r0 - c0)
    if st.shifted:  # the diagonal of sequence b sits at i + kl[b] - ql[b]
        shift: Any = (st.band.S if kl is None else kl) - (st.band.L if ql is None else ql)
        offset = xp.reshape(shift + (r0 - c0), (*tuple(shift.shape), 1, 1, 1))
        rows, cols = slice(0, Lc), slice(0, Sc)
        positions = replace(band, offset=0).mask_with_offset(xp, None, rows, cols, offset)
        mask = positions if mask is None else xp.logical_and(mask, positions)
    chunk = validate(q, k, v, Options(
        mask=mask, bias=bias, scale=st.scale if scale is None else scale, softcap=st.softcap,
        enable_gqa=st.enable_gqa, query_lengths=q_len, key_lengths=k_len,
        segment_ids=None if qs is None else (qs, ks),
    ))  # fmt: skip
    if not st.shifted:
        chunk = replace(chunk, band=band)
    return chunk, Inputs(q, k, v, mask, bias, scale)


def _forward_part(
    st: _Static, r0: int, c0: int, shape: tuple[int, ...], *blocks: Array
) -> tuple[Array, Array]:
    """Partial ``(out, lse)`` of one pair, broadcast to the output block's ``shape``."""
    pc, xc = _chunk_call(st, r0, c0, *blocks)
    r = blocked_attention(pc, xc, Outputs(lse=True), block_q=st.block_q, block_k=st.block_k)
    return broadcast_if_needed(pc.xp, r.out, shape), broadcast_if_needed(pc.xp, r.lse, shape[:-1])


def _empty_part(compute: str, shape: tuple[int, ...], q: Array) -> tuple[Array, Array]:
    """A query chunk no key reaches: zeros and ``-inf``."""
    xp = array_namespace({"query": q})
    dtype = getattr(xp, compute)
    dev = device(q)
    out = xp.zeros(shape, dtype=dtype, device=dev)
    return out, xp.full(shape[:-1], -math.inf, dtype=dtype, device=dev)


def _merge_parts(parts: list[tuple[Array, Array]]) -> tuple[Array, Array]:
    from .._arrays.merge import merge_attention_states

    return merge_attention_states([o for o, _ in parts], [s for _, s in parts])


def _add_parts(parts: list[Any]) -> Any:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _tree(
    dsk: dict[Key, Any],
    name: str,
    index: Key,
    keys: list[Key],
    fan_in: int,
    combine: Callable[..., Any],
    root: Key | None = None,
) -> Key:
    """Reduce ``keys`` with ``combine`` in a tree of fan-in ``fan_in``; the root's key
    (``root`` when given: the last reduction is stored there)."""
    level = 0
    while len(keys) > 1:
        if root is not None and len(keys) <= fan_in:
            dsk[root] = (combine, keys)
            return root
        level += 1
        reduced = []
        for g in range(0, len(keys), fan_in):
            group = keys[g : g + fan_in]
            if len(group) == 1:
                reduced.append(group[0])
                continue
            key = (name, *index, level, g // fan_in)
            dsk[key] = (combine, group)
            reduced.append(key)
        keys = reduced
    return keys[0]


def _fan_in(split_every: int | None) -> int:
    import dask

    fan_in = split_every or dask.config.get("sdpa_array.split_every", None) or SPLIT_EVERY
    if isinstance(fan_in, bool) or not isinstance(fan_in, int) or fan_in < 2:
        raise ValueError(f"split_every must be an int >= 2, got {fan_in!r}")
    return fan_in


def _static(p: Problem, block_q: int | None, block_k: int | None) -> _Static:
    _, replaces_band = sequence_members(p)
    return _Static(
        band=p.band,
        shifted=replaces_band,
        softcap=p.softcap,
        scale=p.scale if isinstance(p.scale, float) else None,
        enable_gqa=p.enable_gqa,
        Ev=p.Ev,
        compute=np.dtype(p.compute_dtype).name,
        block_q=block_q,
        block_k=block_k,
    )


def _token(g: _Grid, st: _Static, kind: str, extra: Any = ()) -> str:
    from dask.base import tokenize

    names = [None if a is None else a.array.name for a in g.ops.values()]
    return str(tokenize(kind, names, st, extra, g.batch, g.rows, g.cols))


def _graph_applies(p: Problem, x: Inputs) -> bool:
    """Whether the chunk-pair graph computes the call: Dask inputs, and none of the features
    whose chunk pairs it does not split (attention sinks, dropout, mask, bias and score
    functions, left padding), which the blocked kernel computes instead."""
    unsplit = p.has_sinks or p.dropout_p > 0 or p.has_mods or p.left_padded
    return is_dask_array(x.query) and not unsplit


def dask_attention(
    p: Problem,
    x: Inputs,
    outputs: Outputs,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    split_every: int | None = None,
) -> AttentionResult:
    """Attention as a Dask graph of chunk pairs and merge trees (see the module docstring).

    The weights, the maximum scores, inputs that are not Dask arrays, attention sinks,
    dropout and mask or bias functions fall back to the blocked kernel (which computes
    them lazily on the Dask arrays).
    The result is lazy: nothing is computed here.
    """
    if outputs.weights or outputs.max_scores or not _graph_applies(p, x):
        return blocked_attention(p, x, outputs, block_q=block_q, block_k=block_k)
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.highlevelgraph import HighLevelGraph

    fan_in = _fan_in(split_every)
    g, st = _grid(p, x), _static(p, block_q, block_k)
    excluded = _planner(p)
    token = _token(g, st, "forward", fan_in)
    part, merge, out_name, lse_name = (f"sdpa-{s}-{token}" for s in ("part", "merge", "out", "lse"))
    dsk: dict[Key, Any] = {}
    partials: dict[Key, list[Key]] = {}
    for b, R, C, r0, r1, c0, c1 in g.pairs():
        row, key = (*b, R), (part, *b, R, C)
        partials.setdefault(row, [])
        if excluded(g.sequences(b), slice(r0, r1), slice(c0, c1)):
            continue
        shape = (*g.batch_shape(b), r1 - r0, p.Ev)
        dsk[key] = (partial(_forward_part, st, r0, c0, shape), *g.keys(b, R, C))
        partials[row].append(key)
    q = g.ops["q"]
    assert q is not None
    for index, keys in partials.items():
        if not keys:
            shape = (*g.batch_shape(index[:-1]), g.rows[index[-1]], p.Ev)
            keys = [(part, *index, "empty")]
            dsk[keys[0]] = (_empty_part, st.compute, shape, q.key((*index, 0)))
        root = _tree(dsk, merge, index, keys, fan_in, _merge_parts)
        out_key, lse_key = (out_name, *index, 0), (lse_name, *index)
        dsk[out_key] = (operator.getitem, root, 0)
        dsk[lse_key] = (operator.getitem, root, 1)
    deps = [a.array for a in g.ops.values() if a is not None]
    meta = meta_from_array(x.query, ndim=len(p.batch_shape) + 2, dtype=p.compute_dtype)
    out = da.Array(
        HighLevelGraph.from_collections(out_name, dsk, dependencies=deps),
        out_name, chunks=(*g.batch, g.rows, (p.Ev,)), meta=meta,
    )  # fmt: skip
    lse = da.Array(
        HighLevelGraph.from_collections(lse_name, dsk, dependencies=deps),
        lse_name, chunks=(*g.batch, g.rows), meta=meta_from_array(meta, ndim=meta.ndim - 1),
    )  # fmt: skip
    return AttentionResult(out=out, lse=lse if outputs.lse else None)


def _backward_part(st: _Static, r0: int, c0: int, *blocks: Array) -> tuple[Array, ...]:
    """Gradients of one pair, each summed to its input block's shape."""
    go, out, lse, glse, *inputs = blocks
    pc, xc = _chunk_call(st, r0, c0, *inputs)
    raw = blocked_vjp(
        pc, xc, go, out=out, lse=lse, grad_lse=glse, block_q=st.block_q, block_k=st.block_k
    )
    xp, (q, k, v, bias) = pc.xp, (xc.query, xc.key, xc.value, xc.bias)
    grads = [
        sum_to_shape(xp, ungroup(pc, raw.dq), tuple(q.shape)),
        sum_to_shape(xp, raw.dk, tuple(k.shape)),
        sum_to_shape(xp, raw.dv, tuple(v.shape)),
    ]
    if bias is not None:
        grads.append(sum_to_shape(xp, ungroup(pc, raw.dbias), tuple(bias.shape)))
    return tuple(grads)


def _zeros(compute: str, shape: tuple[int, ...], like: Array) -> Array:
    xp = array_namespace({"query": like})
    return xp.zeros(shape, dtype=getattr(xp, compute), device=device(like))


def dask_vjp(
    p: Problem,
    x: Inputs,
    grad_output: Array,
    *,
    out: Array = None,
    lse: Array = None,
    grad_lse: Array = None,
    block_q: int | None = None,
    block_k: int | None = None,
    split_every: int | None = None,
) -> RawGrads:
    """Gradients as a Dask graph over the forward's chunk pairs (see the module docstring).

    Without ``out`` and ``lse``, the forward graph provides them. Inputs that are not Dask
    arrays (and sinks, dropout) go to the blocked VJP. The result is lazy.
    """
    if not _graph_applies(p, x):
        return blocked_vjp(
            p, x, grad_output, out=out, lse=lse, grad_lse=grad_lse,
            block_q=block_q, block_k=block_k,
        )  # fmt: skip
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.highlevelgraph import HighLevelGraph

    fan_in = _fan_in(split_every)
    if out is None or lse is None:
        forward = dask_attention(
            p, x, Outputs(lse=True), block_q=block_q, block_k=block_k, split_every=fan_in
        )
        out, lse = forward.out, forward.lse
    g, st = _grid(p, x), _static(p, block_q, block_k)
    rows = [*g.batch, g.rows]
    saved = {
        "go": _place(grad_output, [*rows, (p.Ev,)]),
        "out": _place(out, [*rows, (p.Ev,)]),
        "lse": _place(lse, rows),
        "glse": _place(grad_lse, rows),
    }
    excluded = _planner(p)
    names = [a.array.name for a in saved.values() if a is not None]
    token = _token(g, st, "vjp", (fan_in, names))
    part, item, total = (f"sdpa-vjp-{s}-{token}" for s in ("part", "item", "sum"))
    targets = [n for n in ("q", "k", "v", "bias") if g.ops[n] is not None]
    dsk: dict[Key, Any] = {}
    pieces: dict[Key, list[Key]] = {}
    for b, R, C, r0, r1, c0, c1 in g.pairs():
        if excluded(g.sequences(b), slice(r0, r1), slice(c0, c1)):
            continue
        keys = [None if a is None else a.key((*b, R, 0)[: a.array.ndim]) for a in saved.values()]
        task = (part, *b, R, C)
        dsk[task] = (partial(_backward_part, st, r0, c0), *keys, *g.keys(b, R, C))
        for i, name in enumerate(targets):
            block = g.keys(b, R, C)[list(g.ops).index(name)]
            assert block is not None
            piece = (item, i, *task[1:])
            dsk[piece] = (operator.getitem, task, i)
            pieces.setdefault(block, []).append(piece)
    deps = [a.array for a in (*g.ops.values(), *saved.values()) if a is not None]
    q_block = g.ops["q"].key((0,) * g.ops["q"].array.ndim)  # type: ignore[union-attr]
    grads = []
    for i, name in enumerate(targets):
        placed = g.ops[name]
        assert placed is not None
        arr, gname = placed.array, f"{total}-{i}"
        for index in itertools.product(*(range(n) for n in arr.numblocks)):
            block, final = (arr.name, *index), (gname, *index)
            keys = pieces.get(block, [])
            shape = tuple(c[j] for c, j in zip(arr.chunks, index, strict=True))
            if not keys:
                dsk[final] = (_zeros, st.compute, shape, q_block)
            elif len(keys) == 1:
                dsk[final] = dsk.pop(keys[0])
            else:
                _tree(dsk, f"{gname}-t", index, keys, fan_in, _add_parts, final)
        meta = meta_from_array(x.query, ndim=arr.ndim, dtype=p.compute_dtype)
        graph = HighLevelGraph.from_collections(gname, dsk, dependencies=deps)
        grads.append(da.Array(graph, gname, chunks=arr.chunks, meta=meta))
    dq, dk, dv, *dbias = grads
    if p.grouped:  # the kernels' grouped layout, which finish_gradients undoes
        dq, dbias = grouped_operand(p, dq, query=True), [grouped_score_term(p, d) for d in dbias]
    return RawGrads(dq=dq, dk=dk, dv=dv, dbias=dbias[0] if dbias else None)
