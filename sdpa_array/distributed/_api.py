"""``ring_attention``: check the call, then run the torch or the JAX ring."""

from __future__ import annotations

from typing import Any

from .._arrays.typing import Array
from .._problem.options import Options
from .._problem.problem import validate
from .._problem.sequences import check_lengths
from ._ring import Ring
from ._schedule import check_sharding

__all__ = ["ring_attention"]

#: Options of :func:`sdpa_array.scaled_dot_product_attention` the ring does not take.
UNSUPPORTED = (
    "mask", "bias", "padding_side", "segment_ids", "dropout_p", "dropout_seed", "mask_mod",
    "bias_mod", "score_mod", "return_weights", "return_max_scores", "block_q", "block_k",
    "layout",
)  # fmt: skip


def _library(query: Any) -> str:
    module = type(query).__module__.split(".")[0]
    if module in ("torch", "jax", "jaxlib"):
        return "jax" if module == "jaxlib" else module
    raise TypeError(
        "ring_attention takes torch tensors (with torch.distributed) or JAX arrays (inside "
        f"shard_map), got {type(query).__module__}.{type(query).__qualname__}"
    )


def _check_local(
    query: Any, key: Any, value: Any, options: Options, sharding: str, world_size: int,
    lengths: tuple[Any, Any],
) -> tuple[Any, Any]:  # fmt: skip
    """The checks of one participant's slices (raises ``TypeError``/``ValueError``); the
    whole call's ``(query_lengths, key_lengths)`` as validated integer arrays (or
    ``None``), checked against the whole sequence's lengths."""
    p = validate(query, key, value, options)
    if options.scale is not None and not isinstance(p.scale, float):
        raise TypeError("ring_attention takes scale as a Python float, not an array")
    for name, n in (("query", p.L), ("key", p.S)):
        if n == 0:
            raise ValueError(f"ring_attention: the {name} slice is empty")
        if sharding == "zigzag" and n % 2:
            raise ValueError(
                f"zigzag sharding holds two chunks per participant: the {name} slice's "
                f"length {n} (axis -2) must be even"
            )
    if all(x is None for x in lengths):
        return (None, None)
    if options.alignment == "bottom_right" and p.band.restricts:
        raise ValueError(
            "ring_attention does not support query_lengths/key_lengths with "
            "alignment='bottom_right' and a causal or window restriction (each sequence's "
            "diagonal would move with its lengths); use alignment='top_left'"
        )
    common = {"xp": p.xp, "device": p.device, "like": query, "batch": p.batch_shape[:-1]}
    q_len = check_lengths("query_lengths", lengths[0], limit=world_size * p.L, **common)
    k_len = check_lengths("key_lengths", lengths[1], limit=world_size * p.S, **common)
    return (None if q_len is None else q_len.array, None if k_len is None else k_len.array)


def _lengths_summary(lengths: tuple[Any, Any]) -> tuple[str, ...]:
    """What participants compare of the lengths: the values where they can be read."""
    summary = []
    for x in lengths:
        if x is None or hasattr(x, "shape"):
            try:
                summary.append(repr(None if x is None else x.tolist()))
            except (TypeError, RuntimeError):
                summary.append(repr(tuple(x.shape)))
        else:
            summary.append(repr(x))
    return tuple(summary)


def ring_attention(
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    group: Any = None,
    axis_name: Any = None,
    sharding: str = "contiguous",
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    scale: float | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: Array | None = None,
    query_lengths: int | Array | None = None,
    key_lengths: int | Array | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    stats: Any = None,
    **unsupported: Any,
) -> Array | tuple[Array, Array]:
    """Attention over a sequence split among participants: each holds a slice of the
    queries, keys and values and gets its rows of the result (context parallelism).

    Every participant calls it with its own slices along the sequence axis (-2), all of
    the same shapes and dtype and with the same options. The key/value slices travel
    round a ring: at step ``t`` participant ``r`` holds those of participant
    ``(r - t) mod P``, computes its query rows against them (the pairs that causal or
    window positions exclude entirely are skipped) and merges the partial results by
    their log-sum-exp, while the next slice is in flight. Gradients (torch autograd,
    ``jax.grad``) come from a ring backward in which the key/value gradients travel
    with their slices back to their owners. At most two key/value slices (the one
    computed and the one in flight) and their gradients are held at once.

    Parameters
    ----------
    query, key, value : array
        This participant's slices ``(..., Hq, n_q, E)``, ``(..., Hkv, n_k, E)``,
        ``(..., Hkv, n_k, Ev)``: torch tensors (with ``torch.distributed``) or JAX arrays
        (inside ``shard_map``).
    group : torch.distributed.ProcessGroup, optional
        torch: the process group of the participants (``None``: the default group);
        ranks in the group are the participants' indices.
    axis_name : hashable, optional
        JAX (required): the ``shard_map`` mesh axis the sequence is split over.
    sharding : {"contiguous", "zigzag"}, default "contiguous"
        ``"contiguous"``: participant ``r`` holds positions ``[r * n, (r + 1) * n)``.
        ``"zigzag"``: the sequence is cut into ``2 * P`` chunks of ``n / 2`` and
        participant ``r`` holds chunks ``r`` and ``2 * P - 1 - r``, in that order, which
        gives every participant the same causal work. :func:`shard_sequence` and
        :func:`unshard_sequence` cut and join the slices.
    is_causal, window, alignment, scale, softcap, enable_gqa
        As for :func:`sdpa_array.scaled_dot_product_attention`, over the whole sequence
        (positions are absolute); ``scale`` a Python float.
    sinks : array, optional
        One logit per query head, broadcastable to ``(..., Hq)``, the same on every
        participant: each row gets one more logit ``sinks[..., h]`` whose value row is
        zero, as for :func:`sdpa_array.scaled_dot_product_attention`. Its gradient is
        this participant's part (from its own rows): torch returns it as the gradient of
        the participant's ``sinks`` tensor, a replicated parameter whose gradients the
        caller sums over the participants (as ``DistributedDataParallel`` or an
        ``all_reduce`` does for every replicated parameter); in JAX, ``sinks`` passed
        into ``shard_map`` replicated (``PartitionSpec()``) gets the sum over the
        participants, which ``shard_map``'s transpose adds.
    query_lengths, key_lengths : int or integer array, optional
        Valid queries and keys of each sequence, broadcastable to the batch shape before
        the heads axis, counted over the whole sequence (in ``[0, P * n]``) and the same
        on every participant; padding on the right. Each block gets them at its absolute
        offsets. Rows past ``query_lengths`` get zeros (and ``lse`` ``-inf``, the sink's
        logit with ``sinks``) and zero gradients. Not with ``alignment="bottom_right"``
        and a causal or window restriction.
    return_lse : bool, default False
        Also return the log-sum-exp of this participant's rows ``(..., Hq, n_q)`` (no
        gradient flows through it).
    implementation : str, default "auto"
        The implementation of each block's forward (as for
        :func:`sdpa_array.scaled_dot_product_attention`); the blocks' backward is blocked.
    stats : RingStats, optional
        torch: filled with the pairs computed per step, their admissible entries and the
        bytes sent forward and backward.

    Returns
    -------
    out : array, shape (..., Hq, n_q, Ev)
        This participant's rows of the output, in the inputs' dtype.
    lse : array, shape (..., Hq, n_q)
        Only with ``return_lse``.

    Raises
    ------
    TypeError
        Arrays that are neither torch tensors nor JAX arrays, or the checks of
        :func:`sdpa_array.scaled_dot_product_attention`.
    ValueError
        An option the ring does not take (``mask``, ``bias``, ``padding_side``, segment
        ids, dropout, mask/bias/score functions, ...), lengths with
        ``alignment="bottom_right"`` and a causal or window restriction, an unknown
        ``sharding``, a zigzag slice of odd length, JAX without ``axis_name``; with torch,
        also on every participant when any participant's slices or options differ from
        the others' or fail the checks (the participants exchange them first, so none
        waits forever).
    """
    for name in unsupported:
        if name in UNSUPPORTED:
            raise ValueError(f"ring_attention does not support {name}")
        raise TypeError(f"ring_attention() got an unexpected keyword argument {name!r}")
    library = _library(query)
    options = Options(
        is_causal=is_causal,
        window=window,
        alignment=alignment,  # type: ignore[arg-type]
        scale=scale,
        softcap=softcap,
        enable_gqa=enable_gqa,
        sinks=sinks,
    )
    lengths = (query_lengths, key_lengths)
    if library == "torch":
        out, lse = _torch_call(
            query, key, value, options, lengths, sharding, group, implementation, stats
        )
    else:
        out, lse = _jax_call(
            query, key, value, options, lengths, sharding, axis_name, implementation
        )
    return (out, lse) if return_lse else out


def _torch_call(
    query: Any, key: Any, value: Any, options: Options, lengths: tuple[Any, Any],
    sharding: Any, group: Any, implementation: str, stats: Any,
) -> tuple[Any, Any]:  # fmt: skip
    import torch.distributed as dist

    from ._torch import TorchRing, check_participants, ring_function

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_attention on torch tensors needs torch.distributed initialised")
    comm = TorchRing(group)
    error = None
    sequences = lengths
    try:
        check_sharding(sharding)
        sequences = _check_local(query, key, value, options, sharding, comm.world_size, lengths)
    except (TypeError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    arrays = [
        (tuple(a.shape), str(a.dtype), a.device.type)
        if a is not None and hasattr(a, "shape")
        else repr(a)
        for a in (query, key, value, options.sinks)
    ]
    chosen = (sharding, *(getattr(options, n) for n in ("is_causal", "window", "alignment")))
    summary = (*arrays, *map(repr, chosen), repr(options.scale), repr(options.softcap))
    summary = (*summary, repr(options.enable_gqa), *_lengths_summary(sequences))
    check_participants(comm, summary, error)
    local = (int(query.shape[-2]), int(key.shape[-2]))
    ring = Ring(
        options.replace(sinks=None), comm.world_size, sharding, local, implementation,
        any(x is not None for x in sequences),
    )  # fmt: skip
    return ring_function(ring, comm, query, key, value, options.sinks, sequences, stats)


def _jax_call(
    query: Any, key: Any, value: Any, options: Options, lengths: tuple[Any, Any],
    sharding: Any, axis_name: Any, implementation: str,
) -> tuple[Any, Any]:  # fmt: skip
    if axis_name is None:
        raise ValueError(
            "ring_attention on JAX arrays needs axis_name: the shard_map mesh axis the "
            "sequence is split over"
        )
    from ._jax import axis_size, jax_ring

    check_sharding(sharding)
    world_size = axis_size(axis_name)
    sequences = _check_local(query, key, value, options, sharding, world_size, lengths)
    local = (int(query.shape[-2]), int(key.shape[-2]))
    ring = Ring(
        options.replace(sinks=None), world_size, sharding, local, implementation,
        any(x is not None for x in sequences),
    )  # fmt: skip
    return jax_ring(ring, axis_name, query, key, value, options.sinks, sequences)
