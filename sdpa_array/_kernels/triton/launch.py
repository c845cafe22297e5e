"""Launching the kernels: arguments in order, grids, autotuning and the device's stream.

Each ``launch_*`` function takes the prepared :class:`~.operands.ForwardOperands`, the
output arrays (allocated by the caller with the inputs' library on their device) and,
optionally, fixed :class:`~.configs.Blocks`; it returns the per-program tile counts when
``count`` is asked (tests check that empty blocks are skipped with them).

Triton launches on the current device and stream of torch. For torch tensors the launch
runs under their device; for CuPy arrays also under CuPy's current stream (wrapped as a
torch external stream), so that the kernels are ordered with the caller's other work. Without
torch, the launch is fenced with synchronisations of CuPy's stream and of the device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from ..._arrays.typing import Array
from ..._problem.problem import Problem
from ._lang import triton
from .backward import delta_kernel
from .backward_keys import dkdv_kernel
from .backward_queries import dq_kernel
from .configs import (
    Blocks,
    autotuned,
    bucket,
    default_blocks,
    feature_block,
    interpreting,
    tuning_configs,
)
from .forward import forward_kernel
from .operands import ForwardOperands, Strided, is_torch

__all__ = ["device_context", "launch_backward", "launch_forward"]

#: The compile-time flags every kernel takes, which also key the autotuner's cache.
FLAG_NAMES = (
    "HAS_LEFT",
    "HAS_UPPER",
    "SHIFTED",
    "HAS_QLEN",
    "HAS_KLEN",
    "HAS_SEG",
    "HAS_MASK",
    "DATA_MASK",
    "HAS_BIAS",
    "HAS_DROPOUT",
    "SOFTCAP",
    "SCALE_PTR",
    "IEEE",
)
TUNING_KEY = ("L_BUCKET", "S_BUCKET", "BLOCK_E", "BLOCK_EV", *FLAG_NAMES)


@contextlib.contextmanager
def device_context(like: Array) -> Iterator[None]:
    """Run launches on ``like``'s device and its library's current stream."""
    if interpreting():
        yield
        return
    torch: Any = None
    with contextlib.suppress(ImportError):  # CuPy without torch: torch stays None
        torch = importlib.import_module("torch")
    if is_torch(like):
        with torch.cuda.device(like.device):
            yield
        return
    cupy = importlib.import_module("cupy")
    stream = cupy.cuda.get_current_stream()
    if torch is None:  # no torch: triton uses the device's default stream
        with cupy.cuda.Device(like.device.id):
            stream.synchronize()
            yield
            cupy.cuda.runtime.deviceSynchronize()
        return
    with torch.cuda.device(like.device.id):
        if stream.ptr:
            torch_stream = torch.cuda.ExternalStream(stream.ptr)
        else:
            torch_stream = torch.cuda.default_stream()
        with torch.cuda.stream(torch_stream):
            yield


def _config(b: Blocks) -> Any:
    return triton.Config(
        {"BLOCK_M": b.block_m, "BLOCK_N": b.block_n},
        num_warps=b.num_warps,
        num_stages=b.num_stages,
    )


@functools.cache
def _tuned(kernel: Any, configs: tuple[Blocks, ...]) -> Any:
    """``kernel`` autotuned over ``configs`` (built once per kernel)."""
    return triton.autotune(configs=[_config(b) for b in configs], key=list(TUNING_KEY))(kernel)


def _strides(prefix: str, axes: str, strides: tuple[int, ...]) -> dict[str, int]:
    return {f"{prefix}_{a}": int(s) for a, s in zip(axes, strides, strict=True)}


def _run(
    kernel: Any,
    kind: str,
    p: Problem,
    grid: Callable[[dict[str, Any]], int],
    kwargs: dict[str, Any],
    blocks: Blocks | None,
) -> None:
    """Launch ``kernel`` on the grid ``(grid(block),)``, where ``block`` is its program's
    block (``BLOCK_M`` for query-block kernels, ``BLOCK_N`` for key-block ones)."""
    if blocks is None and autotuned(p):
        tuned = _tuned(kernel, tuning_configs(p, kind))
        tuned[lambda meta: (grid(meta),)](**kwargs)
        return
    b = blocks or default_blocks(p)
    kernel[(grid(b.meta()),)](**kwargs, **b.meta())


def _common(p: Problem, ops: ForwardOperands) -> dict[str, Any]:
    """The arguments every kernel takes: inputs, terms, restrictions, sizes and flags."""
    s = ops.shape
    kw: dict[str, Any] = {
        "Q": ops.q.arg,
        "K": ops.k.arg,
        "V": ops.v.arg,
        "Bias": ops.arg(ops.bias),
        "Mask": ops.arg(ops.mask),
        "QLen": ops.arg(ops.q_len),
        "KLen": ops.arg(ops.k_len),
        "QSeg": ops.arg(ops.q_seg),
        "KSeg": ops.arg(ops.k_seg),
        "DropKeys": ops.arg(ops.drop_keys),
        "Scale": ops.arg(ops.scale),
        **_strides("sq", "zhme", ops.q.strides),
        **_strides("sk", "zhne", ops.k.strides),
        **_strides("sv", "zhne", ops.v.strides),
        **_strides("sb", "zhmn", ops.strides(ops.bias, 4)),
        **_strides("sm", "zhmn", ops.strides(ops.mask, 4)),
        **_strides("sqs", "zm", ops.strides(ops.q_seg, 2)),
        **_strides("sks", "zn", ops.strides(ops.k_seg, 2)),
        "H": s.H,
        "G": s.G,
        "L": p.L,
        "S": p.S,
        "E": p.E,
        "EV": p.Ev,
        **ops.scalars,
        "L_BUCKET": bucket(p.L),
        "S_BUCKET": bucket(p.S),
        "BLOCK_E": feature_block(p.E),
        "BLOCK_EV": feature_block(p.Ev),
        "EVEN_E": feature_block(p.E) == p.E,
        "EVEN_EV": feature_block(p.Ev) == p.Ev,
        **ops.flags,
    }
    return kw


def _counts(p: Problem, n: int, count: bool) -> Array:
    return p.xp.zeros((max(n, 1),), dtype=p.xp.int32, device=p.device) if count else None


def _query_programs(p: Problem, ops: ForwardOperands, meta: dict[str, int]) -> int:
    return -(-p.L // meta["BLOCK_M"]) * ops.shape.Z * ops.shape.H


def _key_programs(p: Problem, ops: ForwardOperands, meta: dict[str, int]) -> int:
    return -(-p.S // meta["BLOCK_N"]) * ops.shape.Z * ops.shape.HK


def launch_forward(
    p: Problem,
    ops: ForwardOperands,
    out: Strided,
    lse: Strided,
    *,
    row_max: Strided | None = None,
    blocks: Blocks | None = None,
    count: bool = False,
) -> Array:
    """Run the forward kernel into ``out`` and ``lse`` (and the rows' maxima into
    ``row_max``, laid out as ``lse``, where given); the tile counts per program when
    ``count`` (with ``blocks``, or the default ones: never autotuned)."""
    if count:
        blocks = blocks or default_blocks(p)
    counts = _counts(p, _query_programs(p, ops, blocks.meta()) if blocks and count else 0, count)
    kwargs = {
        **_common(p, ops),
        "Out": out.arg,
        "Lse": lse.arg,
        "RowMax": ops.arg(row_max),
        "Sinks": ops.arg(ops.sinks),
        "Count": ops.arg(counts),
        **_strides("so", "zhme", out.strides),
        **_strides("sl", "zhm", lse.strides),
        **_strides("ss", "zh", ops.strides(ops.sinks, 2)),
        "COUNT": count,
        "MAX_SCORES": row_max is not None,
        "HAS_SINKS": ops.sinks is not None,
    }
    _run(
        forward_kernel,
        "forward",
        p,
        lambda meta: _query_programs(p, ops, meta),
        kwargs,
        blocks,
    )
    return counts


def launch_backward(
    p: Problem,
    ops: ForwardOperands,
    *,
    out: Strided,
    lse: Strided,
    d_out: Strided,
    grad_lse: Strided | None,
    delta: Strided,
    dq: Strided,
    dk: Strided,
    dv: Strided,
    dbias: Strided | None,
    blocks: Blocks | None = None,
    key_blocks: Blocks | None = None,
    count: bool = False,
) -> tuple[Array, Array]:
    """Run the three backward kernels: ``D = rowsum(dO * O) - grad_lse`` into ``delta``,
    then ``dK``/``dV`` (a program per key block) and ``dQ`` with the score gradient ``dZ``
    into ``dbias`` (a program per query block). ``blocks`` fixes the block sizes (of the
    ``dK``/``dV`` kernel too, unless ``key_blocks`` is given). Returns the tile counts of
    the ``dQ`` and ``dK``/``dV`` programs when ``count``."""
    s = ops.shape
    delta_blocks = Blocks(64, 16) if interpreting() else Blocks(128, 16, 4, 1)
    delta_kernel[(-(-p.L // delta_blocks.block_m) * s.Z * s.H,)](
        out.arg,
        d_out.arg,
        ops.arg(grad_lse),
        delta.arg,
        *out.strides,
        *d_out.strides,
        *ops.strides(grad_lse, 3),
        *delta.strides,
        s.H,
        p.L,
        p.Ev,
        BLOCK_M=delta_blocks.block_m,
        BLOCK_EV=feature_block(p.Ev),
        HAS_GRAD_LSE=grad_lse is not None,
        num_warps=delta_blocks.num_warps,
    )
    if count:
        blocks = blocks or default_blocks(p)
    key_blocks = key_blocks or blocks
    common = {
        **_common(p, ops),
        "DO": d_out.arg,
        "Lse": lse.arg,
        "Delta": delta.arg,
        **_strides("sd", "zhme", d_out.strides),
        **_strides("sl", "zhm", lse.strides),
        **_strides("sD", "zhm", delta.strides),
        "COUNT": count,
    }
    key_counts = _counts(
        p, _key_programs(p, ops, key_blocks.meta()) if key_blocks and count else 0, count
    )
    _run(
        dkdv_kernel,
        "keys",
        p,
        lambda meta: _key_programs(p, ops, meta),
        {
            **common,
            "DK": dk.arg,
            "DV": dv.arg,
            "Count": ops.arg(key_counts),
            "HK": s.HK,
            **_strides("sdk", "zhne", dk.strides),
            **_strides("sdv", "zhne", dv.strides),
        },
        key_blocks,
    )
    query_counts = _counts(
        p, _query_programs(p, ops, blocks.meta()) if blocks and count else 0, count
    )
    _run(
        dq_kernel,
        "queries",
        p,
        lambda meta: _query_programs(p, ops, meta),
        {
            **common,
            "DQ": dq.arg,
            "DBias": ops.arg(dbias),
            "Count": ops.arg(query_counts),
            **_strides("sdq", "zhme", dq.strides),
            **_strides("sdb", "zhmn", ops.strides(dbias, 4)),
        },
        blocks,
    )
    return query_counts, key_counts
