"""The caller's arrays as the kernels address them: a pointer and strides, nothing copied.

The kernels see every operand over a flat batch ``(Z, H, rows, columns)``: ``Z`` merges the
batch axes before the heads axis and ``H`` is the query heads (the last batch axis; 1 for
inputs without a batch). Broadcasting is a stride of zero, so a ``(S,)`` padding mask or a
key shared by every head costs no memory. Only when broadcast batch axes cannot merge into
one stride (a broadcast axis before a real one) is that operand copied.

Keys and values are addressed per *key/value head* ``h // G``: with grouped-query attention
``G`` is the number of query heads per key/value head; without it, a key and value shared
by every head (one head, broadcast) also count as one group of all ``H`` query heads, so
their gradients are summed inside the kernel instead of written once per query head.

Torch tensors go to triton as they are; CuPy arrays through :class:`DevicePointer` (triton
refuses a CuPy array itself: it reads ``data_ptr()`` and ``dtype``).
"""

from __future__ import annotations

import importlib
import itertools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..._arrays.typing import Array
from ..._problem.problem import Inputs, Problem
from ..dropout import key_grid, threshold
from ..layout import leading_axes
from ..operands import kernel_scale

__all__ = [
    "DevicePointer",
    "ForwardOperands",
    "KernelShape",
    "Strided",
    "forward_operands",
    "is_torch",
    "kernel_shape",
    "strided",
]


@dataclass(frozen=True)
class DevicePointer:
    """A CuPy array as triton reads a tensor argument: its address and its dtype.

    ``dtype`` is the torch dtype of the same name where torch is installed (triton's
    argument specialisation reads its name), else the name itself. ``owner`` is the array:
    held here so that a temporary (a cast or a contiguous copy) lives until the launch.
    """

    ptr: int
    dtype: Any
    owner: Any = None

    def data_ptr(self) -> int:
        return self.ptr


def _triton_dtype(name: str) -> Any:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return name
    return getattr(torch, name)


def is_torch(a: Array) -> bool:
    return type(a).__module__.split(".")[0] == "torch"


def _element_strides(a: Array) -> tuple[int, ...]:
    if is_torch(a):
        return tuple(int(s) for s in a.stride())
    return tuple(int(s) // int(a.itemsize) for s in a.strides)


def _contiguous(a: Array) -> Array:
    if is_torch(a):
        return a.contiguous()
    cupy = importlib.import_module("cupy")
    return cupy.ascontiguousarray(a)


def _argument(a: Array) -> Any:
    """What triton receives for ``a``: the tensor itself, or a CuPy array's pointer."""
    if is_torch(a):
        return a
    return DevicePointer(int(a.data.ptr), _triton_dtype(str(a.dtype)), a)


@dataclass(frozen=True)
class Strided:
    """An operand as a kernel sees it.

    Attributes
    ----------
    arg : object
        What triton receives for its pointer argument.
    strides : tuple of int
        Element strides of the axes the kernel indexes: the merged batch axis ``Z`` first,
        then the remaining axes (zero along broadcast axes).
    """

    arg: Any
    strides: tuple[int, ...]


def _merged_stride(sizes: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The one stride of axes ``sizes`` read as a single flat axis, or ``None`` if they do
    not merge (axes of size 1 never matter; no axis above 1 gives 0)."""
    kept = [(n, s) for n, s in zip(sizes, strides, strict=True) if n != 1]
    for (_, outer), (n, inner) in itertools.pairwise(kept):
        if outer != inner * n:
            return None
    return kept[-1][1] if kept else 0


def strided(xp: ModuleType, a: Array, shape: tuple[int, ...], lead: int) -> Strided:
    """``a`` broadcast to ``shape``, its first ``lead`` axes merged into one.

    A view wherever the broadcast axes merge; a contiguous copy of the broadcast array
    where they do not.
    """
    view = xp.broadcast_to(leading_axes(xp, a, len(shape)), shape)
    strides = _element_strides(view)
    merged = _merged_stride(shape[:lead], strides[:lead])
    if merged is None:
        view = _contiguous(view)
        strides = _element_strides(view)
        merged = _merged_stride(shape[:lead], strides[:lead])
    assert merged is not None
    return Strided(_argument(view), (merged, *strides[lead:]))


@dataclass(frozen=True)
class KernelShape:
    """The flat batch of the kernels.

    Attributes
    ----------
    outer : tuple of int
        The batch axes before the heads axis (merged into ``Z``).
    Z, H : int
        Flat batch size and query heads.
    HK, G : int
        Key/value heads the kernels address and query heads per key/value head
        (``H == HK * G``).
    """

    outer: tuple[int, ...]
    Z: int
    H: int
    HK: int
    G: int

    @property
    def heads(self) -> tuple[int, ...]:
        """``(*outer, H)``: the batch shape with a heads axis (1 without a batch)."""
        return (*self.outer, self.H)

    @property
    def kv_heads(self) -> tuple[int, ...]:
        """``(*outer, HK)``: the batch shape of keys, values and their gradients."""
        return (*self.outer, self.HK)


def _head_extent(a: Array) -> int:
    return int(a.shape[-3]) if a.ndim >= 3 else 1


def kernel_shape(p: Problem, x: Inputs) -> KernelShape:
    """The flat batch of ``p`` (see the module docstring for the key/value heads)."""
    heads = p.batch_shape or (1,)
    outer, H = heads[:-1], heads[-1]
    if p.grouped:
        HK, G = p.heads_kv, p.groups
    elif len(p.batch_shape) and _head_extent(x.key) == _head_extent(x.value) == 1:
        HK, G = 1, H
    else:
        HK, G = H, 1
    return KernelShape(outer, math.prod(outer), H, HK, G)


def _band(p: Problem) -> tuple[bool, bool, int, int]:
    """``(has_left, has_upper, left, upper)``: the window's left size and the largest
    admissible ``j - i - offset`` (0 under causal, else the window's right size)."""
    band = p.band
    uppers = [b for b in (0 if band.is_causal else None, band.right) if b is not None]
    upper = min(uppers) if uppers else 0
    left = band.left if band.left is not None else 0
    return band.left is not None, bool(uppers), left, upper


@dataclass(frozen=True)
class ForwardOperands:
    """Everything the forward and backward kernels read, prepared once.

    ``pointers`` and ``strides`` follow the kernels' argument order; ``scalars`` are the
    runtime numbers and ``flags`` the compile-time switches (the ``HAS_*`` of the kernels).
    """

    shape: KernelShape
    q: Strided
    k: Strided
    v: Strided
    bias: Strided | None
    mask: Strided | None
    sinks: Strided | None
    q_len: Array
    k_len: Array
    q_seg: Strided | None
    k_seg: Strided | None
    drop_keys: Array
    scale: Array
    scalars: dict[str, Any]
    flags: dict[str, bool]

    @property
    def dummy(self) -> Any:
        """A pointer for the absent operands (their flags are off: never read)."""
        return self.q.arg

    def arg(self, s: Strided | Array | None) -> Any:
        if s is None:
            return self.dummy
        return s.arg if isinstance(s, Strided) else _argument(s)

    def strides(self, s: Strided | None, n: int) -> tuple[int, ...]:
        return s.strides if s is not None else (0,) * n


def _int32_rows(xp: ModuleType, a: Array, shape: tuple[int, ...], n: int) -> Array:
    """``a`` broadcast to ``shape`` as a contiguous int32 vector of ``n`` entries."""
    a = xp.broadcast_to(leading_axes(xp, a, len(shape)), shape)
    return xp.reshape(xp.astype(a, xp.int32, copy=True), (n,))


def forward_operands(p: Problem, x: Inputs) -> ForwardOperands:
    """The kernels' view of the call's arrays (nothing computed, little copied)."""
    xp = p.xp
    shape = kernel_shape(p, x)
    lead = len(shape.outer)
    q = strided(xp, x.query, (*shape.heads, p.L, p.E), lead)
    k = strided(xp, x.key, (*shape.kv_heads, p.S, p.E), lead)
    v = strided(xp, x.value, (*shape.kv_heads, p.S, p.Ev), lead)
    bias = mask = sinks = q_seg = k_seg = None
    if x.bias is not None:
        b = x.bias if p.xp.finfo(x.bias.dtype).bits <= 32 else xp.astype(x.bias, xp.float32)
        bias = strided(xp, b, (*shape.heads, p.L, p.S), lead)
    if x.mask is not None:
        mask = strided(xp, _as_bytes(x.mask), (*shape.heads, p.L, p.S), lead)
    if x.sinks is not None:
        s = x.sinks if p.xp.finfo(x.sinks.dtype).bits <= 32 else xp.astype(x.sinks, xp.float32)
        sinks = strided(xp, s, shape.heads, lead)
    q_len = k_len = drop_keys = None
    if p.query_lengths is not None:
        q_len = _int32_rows(xp, p.query_lengths.array, shape.outer, shape.Z)
    if p.key_lengths is not None:
        k_len = _int32_rows(xp, p.key_lengths.array, shape.outer, shape.Z)
    if p.segments is not None:
        q_seg = strided(xp, p.segments.query, (*shape.outer, p.L), lead)
        k_seg = strided(xp, p.segments.key, (*shape.outer, p.S), lead)
    if p.dropout_p > 0:
        keys = key_grid(xp, p.keep_seed, p.batch_shape, p.device, p.dropout_batch_start)
        drop_keys = _int32_rows(xp, keys, p.batch_shape, shape.Z * shape.H)
    has_left, has_upper, left, upper = _band(p)
    shifted = p.band.restricts and p.alignment == "bottom_right"
    shifted = shifted and (p.query_lengths is not None or p.key_lengths is not None)
    return ForwardOperands(
        shape=shape,
        q=q,
        k=k,
        v=v,
        bias=bias,
        mask=mask,
        sinks=sinks,
        q_len=q_len,
        k_len=k_len,
        q_seg=q_seg,
        k_seg=k_seg,
        drop_keys=drop_keys,
        scale=kernel_scale(p) if p.scale_is_array else None,
        scalars={
            "scale": 1.0 if p.scale_is_array else float(p.scale),
            "softcap": 1.0 if p.softcap is None else float(p.softcap),
            "offset": p.band.offset,
            "left": left,
            "upper": upper,
            "drop_limit": threshold(p.dropout_p) if p.dropout_p > 0 else 0,
            "drop_scale": 1.0 / (1.0 - p.dropout_p),
        },
        flags={
            "HAS_LEFT": has_left,
            "HAS_UPPER": has_upper,
            "SHIFTED": shifted,
            "HAS_QLEN": q_len is not None,
            "HAS_KLEN": k_len is not None,
            "HAS_SEG": p.segments is not None,
            "HAS_MASK": mask is not None,
            "DATA_MASK": mask is not None or p.segments is not None,
            "HAS_BIAS": bias is not None,
            "HAS_DROPOUT": p.dropout_p > 0,
            "SOFTCAP": p.softcap is not None,
            "SCALE_PTR": p.scale_is_array,
            "IEEE": p.xp.finfo(p.dtype).bits == 32,
        },
    )


def _as_bytes(mask: Array) -> Array:
    """A boolean mask viewed as uint8 (the kernels load bytes), without a copy."""
    if is_torch(mask):
        torch = importlib.import_module("torch")
        return mask.view(torch.uint8)
    cupy = importlib.import_module("cupy")
    return mask.view(cupy.uint8)
