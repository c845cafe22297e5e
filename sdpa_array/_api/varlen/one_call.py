"""A packed call as one call of the library: the packed tokens with segment ids.

Where every sequence's queries are its keys (the two offsets equal) and nothing depends on
a sequence's own index or positions (no mask, bias or score function, no dropout), the
sequences' calls compute what one call on the whole packed tokens computes with the
sequences as segment ids: a token attends the keys of its own segment, under the same
causal band or window (each sequence's diagonal is the packed one's), the same scale,
softcap and sinks. That one call is planned like any other and visits only the tiles of the
segments (the documents' tiles), instead of one planned call per sequence. It is taken
off a GPU, for ``implementation="auto"`` or ``"blocked"``, when the maximum scores (one per
sequence) are not asked for.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._arrays.compat import array_namespace, device, on_gpu
from ..._arrays.typing import Array
from ..._plan.run import run_forward, run_vjp
from ..._problem.options import Options
from ..._problem.outputs import Outputs
from ..._problem.packed import Packed
from ..._problem.problem import validate
from ..layout import swap_heads_and_length

__all__ = ["one_forward", "one_vjp", "segments_call"]


def segments_call(
    query: Array, packed: Packed, options: Options, implementation: str, max_scores: bool
) -> Options | None:
    """The options of the one call (``options`` with the sequences as segment ids), where
    it computes what the sequences' calls compute (the module docstring); else ``None``."""
    if implementation not in ("auto", "blocked") or max_scores or packed.count < 2:
        return None
    if not np.array_equal(packed.query_offsets, packed.key_offsets):
        return None
    if options.mask_mod is not None or options.bias_mod is not None:
        return None
    if options.score_mod is not None or (options.dropout_p or 0.0) != 0.0:
        return None
    if on_gpu(query):
        return None
    xp = array_namespace({"query": query})
    lengths = np.diff(packed.query_offsets)
    ids = np.repeat(np.arange(packed.count, dtype=np.int32), lengths)
    segments = xp.asarray(ids, device=device(query))
    return options.replace(segment_ids=(segments, segments))


def heads_first(*arrays: Array) -> tuple[Array, ...]:
    """Packed ``(total, heads, features)`` arrays as one sequence ``(1, heads, total,
    features)`` (views)."""
    xp = array_namespace({"query": arrays[0]})
    return tuple(xp.expand_dims(x, axis=0) for x in swap_heads_and_length(*arrays))


def packed_back(x: Array) -> Array:
    """The one call's ``(1, heads, total, features)`` result as ``(total, heads,
    features)``."""
    return swap_heads_and_length(x[0, ...])[0]


def one_forward(
    arrays: tuple[Array, Array, Array],
    options: Options,
    outputs: Outputs,
    implementation: str,
    blocks: tuple[int | None, int | None],
) -> Any:
    """The packed forward's result from the one call of :func:`segments_call`'s
    ``options``: the output ``(total, heads, Ev)`` and the log-sum-exp ``(heads, total)``
    where asked for."""
    q, k, v = heads_first(*arrays)
    result = run_forward(q, k, v, options, outputs, implementation, blocks)
    if not outputs.lse:
        return packed_back(result)
    return packed_back(result[0]), result[1][0, ...]


def one_vjp(
    arrays: tuple[Array, Array, Array, Array],
    options: Options,
    implementation: str,
    blocks: tuple[int | None, int | None],
) -> tuple[Array, ...]:
    """The packed VJP's gradients from the one call of :func:`segments_call`'s
    ``options``: the query's, key's and value's packed, then the sinks' and the scale's
    where they are arrays."""
    q, k, v, g = heads_first(*arrays)
    p = validate(q, k, v, options)
    grads = run_vjp(q, k, v, g, options, implementation, blocks, p)
    return (*(packed_back(x) for x in grads[:3]), *grads[3:])
