"""The Triton implementation: fused FlashAttention-2-style forward and backward kernels.

Written in Triton for NVIDIA GPUs (torch tensors or CuPy arrays on a CUDA device); with
``TRITON_INTERPRET=1`` set before triton is imported, triton's interpreter runs the same
kernels on CPU torch tensors (slowly: for tests). Triton is optional: importing this
package imports none of it, and :func:`plan_triton` says, before any work, why a call
cannot run here (:class:`CannotUseTritonError`).

Modules: :mod:`.plan` (what the kernels take), :mod:`.operands` (the arrays as pointers and
strides), :mod:`.device` (shared device functions: dropout hash, block spans, scores),
:mod:`.forward` and :mod:`.backward` (the kernels), :mod:`.configs` (block sizes,
autotuning), :mod:`.launch` (arguments, grids, streams) and :mod:`.attention` (the entries
of the dispatch table).
"""

from .attention import triton_attention, triton_vjp
from .plan import MAX_HEAD_DIM, CannotUseTritonError, plan_triton

__all__ = [
    "MAX_HEAD_DIM",
    "CannotUseTritonError",
    "plan_triton",
    "triton_attention",
    "triton_vjp",
]
