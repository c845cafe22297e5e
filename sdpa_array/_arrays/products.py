"""Matrix products with a long contraction, split where the library's BLAS would round more.

A BLAS kernel accumulates each element of ``a @ b`` in one chain along the contraction, and
the rounding error of a chain grows with its length. OpenBLAS, which NumPy's wheels ship,
keeps contractions of a few hundred in one chain: the products of attention that sum over a
tile's keys (``P V``, ``dS K``) or rows (``Pᵀ dO``, ``dSᵀ Q``) then made the float32 error
of the NumPy kernels 1.1-1.4x that of torch's CPU kernels (docs/performance.md, issue 28).
:func:`matmul` cuts such a contraction into chunks of at most :data:`CHUNK` and adds their
products: the chains are short and the chunks few (the additions are ``K / CHUNK`` passes
over the small result), at about 9 % more time for the product. Other libraries (torch,
JAX, CuPy, Dask, whose kernels run on other BLAS or on a device, where each chunk would be a
launch) get one product.
"""

from __future__ import annotations

from types import ModuleType

from . import inplace
from .compat import namespace_name
from .typing import Array

__all__ = ["CHUNK", "SPLIT_LIBRARIES", "matmul"]

#: Longest contraction computed as one product where :data:`SPLIT_LIBRARIES` apply.
CHUNK = 128

#: Namespaces (as :func:`namespace_name` spells them) on OpenBLAS through NumPy.
SPLIT_LIBRARIES = frozenset({"numpy", "array_api_strict"})


def matmul(xp: ModuleType, a: Array, b: Array) -> Array:
    """``a @ b``; on :data:`SPLIT_LIBRARIES` a contraction longer than :data:`CHUNK` is
    cut into balanced chunks whose products are added in order."""
    k = int(a.shape[-1])
    if k <= CHUNK or namespace_name(xp) not in SPLIT_LIBRARIES:
        return xp.matmul(a, b)
    count = -(-k // CHUNK)
    size = -(-k // count)
    out = xp.matmul(a[..., :size], b[..., :size, :])
    for start in range(size, k, size):
        stop = min(start + size, k)
        out = inplace.add(out, xp.matmul(a[..., start:stop], b[..., start:stop, :]))
    return out
