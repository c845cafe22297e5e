"""Validation of the public arguments into one immutable :class:`Problem`.

Every check runs here, before any array work, and every error names the argument(s) and the
shapes or dtypes involved. The implementations receive a :class:`Problem` and can trust it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.compat import array_namespace, device, on_gpu
from .._arrays.typing import Array
from .band import Band, window_bounds
from .mod_args import check_mods
from .options import Options, check_dropout
from .scalar_options import (
    ALIGNMENTS,
    check_flag,
    check_padding_side,
    positive_finite,
    scale_option,
    window_option,
)
from .sequences import Lengths, Segments, check_lengths, check_segments, zero_past


@dataclass(frozen=True)
class Problem:
    """A validated attention call: shapes, dtypes and options, nothing computed yet.

    Attributes
    ----------
    xp : module
        Array-API namespace of the inputs.
    device : object
        Device of the inputs; every array the implementations create is placed there.
    dtype : dtype
        The shared dtype of query, key and value (and of the output).
    compute_dtype : dtype
        Dtype for scores, softmax and accumulation: ``dtype`` if it has at least 32 bits,
        else float32.
    batch_shape : tuple of int
        Broadcast leading shape of the output, heads axis included (``(..., Hq)``).
    L, S, E, Ev : int
        Query length, key length, query/key width, value width.
    heads_q, heads_kv : int
        Head counts on axis -3 (1 when the inputs have no heads axis).
    groups : int
        Query heads per key/value head when ``enable_gqa`` (else 1).
    scale : float or array
        Multiplier of ``Q Kᵀ``: a float, or the caller's 0-d array (whose gradient the
        backward returns; the kernels use it through :func:`~._kernels.score_terms.kernel_scale`).
    softcap : float or None
        Tanh soft-capping of the scaled scores.
    band : Band
        Causal/window restrictions with the diagonal offset from ``alignment``.
    enable_gqa : bool
        Whether grouped-query attention was asked for.
    alignment : {"top_left", "bottom_right"}
        The diagonal rule; with lengths, ``bottom_right`` uses each sequence's own lengths.
    query_lengths, key_lengths : Lengths or None
        Valid queries and keys per sequence (``None``: all of them).
    segments : Segments or None
        Segment ids of queries and keys (packed documents).
    has_sinks : bool
        Whether ``sinks`` (one extra softmax logit per query head) were given.
    dropout_p : float
        Probability of dropping an attention weight (0: no dropout).
    dropout_seed : int, array or None
        Seed of the keep mask (given when ``dropout_p > 0``): an int, or a 0-d integer
        array of the inputs' library (traced under ``jax.jit``).
    dropout_batch_start : int
        The flat batch index of the call's first batch element in the keep mask's hash (0;
        sequence ``n`` of a packed variable-length call runs with ``n``, so that it draws
        the bits of batch element ``n`` of the padded call).
    mask_mod, bias_mod, score_mod : callable or None
        The caller's mask, bias and score functions (``mask_mod`` possibly a ``BlockMask``).
    on_gpu : bool
        Whether the arrays live on a GPU (CuPy, torch CUDA): tiles are then planned for it
        (:func:`~sdpa_array._kernels.tiling.plans_for_gpu`).
    mod_gradients : bool
        Whether the backward kernels also give the gradients of the parameters of
        ``score_mod`` and ``bias_mod`` (:mod:`~sdpa_array._problem.mod_parameters`).
    """

    xp: ModuleType
    device: Any
    dtype: Any
    compute_dtype: Any
    batch_shape: tuple[int, ...]
    L: int
    S: int
    E: int
    Ev: int
    heads_q: int
    heads_kv: int
    groups: int
    scale: float | Array
    softcap: float | None
    band: Band
    enable_gqa: bool
    alignment: str = "top_left"
    query_lengths: Lengths | None = None
    key_lengths: Lengths | None = None
    segments: Segments | None = None
    has_sinks: bool = False
    dropout_p: float = 0.0
    dropout_seed: int | Array | None = None
    dropout_batch_start: int = 0
    mask_mod: Any = None
    bias_mod: Any = None
    score_mod: Any = None
    on_gpu: bool = False
    mod_gradients: bool = False

    @property
    def keep_seed(self) -> int | Array:
        """The seed of the dropout keep mask (an int or a 0-d integer array; 0 without
        dropout)."""
        return 0 if self.dropout_seed is None else self.dropout_seed

    def without_padding(self, rows: Array, *, keys: bool = False, features: bool = True) -> Array:
        """``rows`` (query-shaped, or key-shaped with ``keys``; without the feature axis
        when not ``features``) with the rows past the sequences' lengths set to zero
        (:func:`~sdpa_array._problem.sequences.zero_past`; unchanged without lengths)."""
        lengths, n = (self.key_lengths, self.S) if keys else (self.query_lengths, self.L)
        heads = len(self.batch_shape) - len(self.sequence_batch)
        return zero_past(self.xp, rows, lengths, n, heads=heads, features=features)

    @property
    def sequence_batch(self) -> tuple[int, ...]:
        """The batch shape without the heads axis (what lengths and segment ids index)."""
        return self.batch_shape[:-1]

    @property
    def has_sequences(self) -> bool:
        """Whether lengths or segment ids restrict the call."""
        return any(a is not None for a in (self.query_lengths, self.key_lengths, self.segments))

    @property
    def left_padded(self) -> bool:
        """Whether lengths pad the rows on the left (``padding_side="left"``)."""
        return any(n is not None and n.left for n in (self.query_lengths, self.key_lengths))

    @property
    def diagonal_per_sequence(self) -> bool:
        """Whether lengths move each sequence's causal/window diagonal: right padding moves
        the bottom-right one, left padding the top-left one (and a band must restrict)."""
        lengths = self.query_lengths is not None or self.key_lengths is not None
        shifted = self.alignment == ("top_left" if self.left_padded else "bottom_right")
        return lengths and shifted and self.band.restricts

    @property
    def has_mods(self) -> bool:
        """Whether a mask, bias or score function was given."""
        return any(f is not None for f in (self.mask_mod, self.bias_mod, self.score_mod))

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.batch_shape, self.L, self.Ev)

    @property
    def score_shape(self) -> tuple[int, ...]:
        return (*self.batch_shape, self.L, self.S)

    @property
    def grouped(self) -> bool:
        """Whether query heads share key/value heads (GQA with more than one group)."""
        return self.enable_gqa and self.groups > 1

    @property
    def kernel_batch(self) -> tuple[int, ...]:
        """Batch shape of the kernel layout: ``batch_shape`` with GQA heads as ``(Hkv, G)``."""
        if self.grouped:
            return (*self.batch_shape[:-1], self.heads_kv, self.groups)
        return self.batch_shape

    @property
    def scale_is_array(self) -> bool:
        """Whether ``scale`` is the caller's 0-d array (so it has a gradient)."""
        return not isinstance(self.scale, float)

    @property
    def itemsize(self) -> int:
        """Bytes per element of the compute dtype."""
        return int(self.xp.finfo(self.compute_dtype).bits // 8)


@dataclass(frozen=True)
class Inputs:
    """The caller's arrays, unchanged: what every implementation receives beside a Problem.

    ``scale`` is the caller's ``scale`` when it is an array (``None`` when it is a number);
    ``sinks`` the caller's sink logits (``None`` without).
    """

    query: Array
    key: Array
    value: Array
    mask: Array = None
    bias: Array = None
    scale: Array = None
    sinks: Array = None

    @property
    def differentiable(self) -> tuple[Array, ...]:
        """``(query, key, value)``, then ``bias``, ``sinks`` and ``scale`` when given as arrays.

        The inputs with a gradient, in the order the gradients are returned.
        """
        extra = tuple(a for a in (self.bias, self.sinks, self.scale) if a is not None)
        return (self.query, self.key, self.value, *extra)

    def without_padding(self, p: Problem) -> Inputs:
        """The inputs with the query rows past ``query_lengths`` and the key and value rows
        past ``key_lengths`` set to zero (:func:`~sdpa_array._problem.sequences.zero_past`)."""
        if p.query_lengths is None and p.key_lengths is None:
            return self
        q = p.without_padding(self.query)
        k, v = (p.without_padding(t, keys=True) for t in (self.key, self.value))
        return dataclasses.replace(self, query=q, key=k, value=v)

    @classmethod
    def of(cls, query: Array, key: Array, value: Array, options: Options, p: Problem) -> Inputs:
        """The arrays of a call with ``options``, validated into ``p``."""
        scale = options.scale if p.scale_is_array else None
        return cls(query, key, value, options.mask, options.bias, scale, options.sinks)


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(int(n) for n in np.broadcast_shapes(*shapes))
    except ValueError:
        return None


def _check_sinks(xp: ModuleType, sinks: Any, batch: tuple[int, ...]) -> None:
    """``sinks`` must be a floating array broadcastable to the batch shape ``(..., Hq)``."""
    if sinks is None:
        return
    if not xp.isdtype(sinks.dtype, "real floating"):
        raise TypeError(f"sinks must have a real floating dtype, got {sinks.dtype}")
    if _broadcast(tuple(sinks.shape), batch) != batch:
        raise ValueError(
            f"sinks of shape {tuple(sinks.shape)} does not broadcast to the batch and heads "
            f"shape (..., Hq) = {batch} (one logit per query head)"
        )


def _check_dtypes(xp: ModuleType, query: Any, key: Any, value: Any, mask: Any, bias: Any) -> None:
    named = {"query": query, "key": key, "value": value}
    for name, arr in named.items():
        if not xp.isdtype(arr.dtype, "real floating"):
            raise TypeError(
                f"{name} must have a real floating dtype (float16, bfloat16, float32, float64), "
                f"got {arr.dtype}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "query, key and value must share one dtype, got "
            f"query {query.dtype}, key {key.dtype}, value {value.dtype}"
        )
    if mask is not None and not xp.isdtype(mask.dtype, "bool"):
        raise TypeError(
            f"mask must be boolean (True = may attend), got dtype {mask.dtype}; "
            "use bias for additive floating masks"
        )
    if bias is not None and not xp.isdtype(bias.dtype, "real floating"):
        raise TypeError(f"bias must have a real floating dtype, got {bias.dtype}")


def _batch_shape(
    query: Any, key: Any, value: Any, enable_gqa: bool
) -> tuple[tuple[int, ...], int, int, int]:
    """Return (batch_shape, heads_q, heads_kv, groups) or raise ValueError."""
    qs, ks, vs = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    shapes = f"query {qs}, key {ks}, value {vs}"
    if enable_gqa:
        if min(len(qs), len(ks), len(vs)) < 3:
            raise ValueError(
                "enable_gqa=True needs a heads axis (-3) on query, key and value, got " + shapes
            )
        hq, hk, hv = qs[-3], ks[-3], vs[-3]
        if hk != hv:
            raise ValueError(f"key and value must have the same number of heads, got {shapes}")
        if hk == 0 or hq % hk:
            raise ValueError(
                f"enable_gqa=True needs query heads ({hq}) to be a multiple of key/value heads "
                f"({hk}); got {shapes}"
            )
        outer = _broadcast(qs[:-3], ks[:-3], vs[:-3])
        if outer is None:
            raise ValueError(f"batch axes of query, key and value do not broadcast: {shapes}")
        return (*outer, hq), hq, hk, hq // hk
    batch = _broadcast(qs[:-2], ks[:-2], vs[:-2])
    if batch is None:
        heads = {n: s[-3] for n, s in (("query", qs), ("key", ks), ("value", vs)) if len(s) >= 3}
        distinct = {h for h in heads.values() if h != 1}
        if len(distinct) > 1 and _broadcast(qs[:-3], ks[:-3], vs[:-3]) is not None:
            raise ValueError(
                f"heads differ ({shapes}); pass enable_gqa=True for grouped-query attention, "
                "where query heads must be a multiple of key/value heads"
            )
        raise ValueError(f"batch axes of query, key and value do not broadcast: {shapes}")
    hq = qs[-3] if len(qs) >= 3 else 1
    hk = ks[-3] if len(ks) >= 3 else 1
    return batch, hq, hk, 1


def _library_array(x: Any) -> bool:
    """Whether ``x`` is an array of a library (not a NumPy integer, which counts as an int)."""
    return hasattr(x, "shape") and not isinstance(x, np.ndarray | np.generic)


def _namespace(query: Any, key: Any, value: Any, o: Options) -> ModuleType:
    """The arrays' library, once every array is there, of one library, at least 2-D and of
    dtypes that fit together."""
    for name, arr in (("query", query), ("key", key), ("value", value)):
        if arr is None:
            raise TypeError(
                f"{name} must be an array (NumPy, CuPy, torch, JAX, Dask or array-api-strict), "
                "got None"
            )
    named = {"query": query, "key": key, "value": value, "mask": o.mask, "bias": o.bias}
    seed = o.dropout_seed if _library_array(o.dropout_seed) else None
    xp = array_namespace({**named, "sinks": o.sinks, "dropout_seed": seed})
    for name, arr in (("query", query), ("key", key), ("value", value)):
        if arr.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., length, features), "
                f"got shape {tuple(arr.shape)}"
            )
    _check_dtypes(xp, query, key, value, o.mask, o.bias)
    return xp


def _sizes(query: Any, key: Any, value: Any) -> tuple[int, int, int, int]:
    """``(L, S, E, Ev)``, once the queries' and keys' feature sizes and the keys' and
    values' lengths agree."""
    L, E = int(query.shape[-2]), int(query.shape[-1])
    S, E_key = int(key.shape[-2]), int(key.shape[-1])
    S_value, Ev = int(value.shape[-2]), int(value.shape[-1])
    if E_key != E:
        raise ValueError(
            f"query and key must have the same feature size E, got query {tuple(query.shape)} "
            f"(E={E}) and key {tuple(key.shape)} (E={E_key})"
        )
    if S_value != S:
        raise ValueError(
            f"key and value must have the same length S, got key {tuple(key.shape)} (S={S}) "
            f"and value {tuple(value.shape)} (S={S_value})"
        )
    return L, S, E, Ev


def _check_terms(o: Options, score_shape: tuple[int, ...]) -> None:
    """``mask`` and ``bias`` broadcast to the scores' shape."""
    for name, arr in (("mask", o.mask), ("bias", o.bias)):
        if arr is None:
            continue
        if _broadcast(tuple(arr.shape), score_shape) != score_shape:
            raise ValueError(
                f"{name} of shape {tuple(arr.shape)} does not broadcast to the attention scores' "
                f"shape (..., Hq, L, S) = {score_shape}"
            )


def validate(query: Any, key: Any, value: Any, options: Options) -> Problem:
    """Check every argument and return the :class:`Problem` they describe.

    Raises
    ------
    TypeError
        Wrong kinds of argument: non-arrays, mixed libraries, non-floating or mixed dtypes,
        a non-boolean ``mask``, a non-floating ``bias`` or ``sinks``, a ``scale`` that is
        neither a real number nor a floating 0-d array of the inputs' library, a
        ``dropout_seed`` that is not an int.
    ValueError
        Inconsistent shapes or out-of-range options (a ``scale`` array's value only where it
        can be read: not on lazy Dask arrays, JAX tracers or GPU arrays); the message names
        both. Also ``dropout_p`` outside ``[0, 1)``, or above 0 without ``dropout_seed``. A
        ``mask_mod``/``bias_mod``/``score_mod`` that is not callable, or that raises or
        returns a wrong result on a probe index (see :mod:`sdpa_array._problem.mod_args`).
    """
    o = options
    xp = _namespace(query, key, value, o)
    L, S, E, Ev = _sizes(query, key, value)
    check_flag("is_causal", o.is_causal)
    check_flag("enable_gqa", o.enable_gqa)
    if not isinstance(o.alignment, str) or o.alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {o.alignment!r}")
    sides = window_option(o.window)
    batch, hq, hk, groups = _batch_shape(query, key, value, bool(o.enable_gqa))
    _check_terms(o, (*batch, L, S))
    _check_sinks(xp, o.sinks, batch)
    drop_p, drop_seed = check_dropout(o.dropout_p, o.dropout_seed)
    scale_value = scale_option(xp, query, o.scale, E)
    softcap_value = None if o.softcap is None else positive_finite("softcap", o.softcap)

    dev = device(query)
    seq_batch = batch[:-1]
    left = check_padding_side(o.padding_side)
    common = {"xp": xp, "device": dev, "like": query, "batch": seq_batch}
    q_lengths = check_lengths("query_lengths", o.query_lengths, limit=L, left=left, **common)
    k_lengths = check_lengths("key_lengths", o.key_lengths, limit=S, left=left, **common)
    segments = check_segments(o.segment_ids, L=L, S=S, **common)
    dtype = query.dtype
    compute_dtype = dtype if xp.finfo(dtype).bits >= 32 else xp.float32
    mods = check_mods(xp, dev, o.mask_mod, o.bias_mod, o.score_mod, compute_dtype, batch, L, S)
    offset = 0 if o.alignment == "top_left" else S - L
    lower, upper = window_bounds(sides, L + S)
    return Problem(
        xp=xp,
        device=dev,
        dtype=dtype,
        compute_dtype=compute_dtype,
        batch_shape=batch,
        L=L,
        S=S,
        E=E,
        Ev=Ev,
        heads_q=hq,
        heads_kv=hk,
        groups=groups,
        scale=scale_value,
        softcap=softcap_value,
        band=Band(L=L, S=S, is_causal=bool(o.is_causal), left=lower, right=upper, offset=offset),
        enable_gqa=bool(o.enable_gqa),
        alignment=o.alignment,
        query_lengths=q_lengths,
        key_lengths=k_lengths,
        segments=segments,
        has_sinks=o.sinks is not None,
        dropout_p=drop_p,
        dropout_seed=drop_seed,
        mask_mod=mods[0],
        bias_mod=mods[1],
        score_mod=mods[2],
        on_gpu=on_gpu(query),
    )
