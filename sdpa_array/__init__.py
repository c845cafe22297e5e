"""Scaled dot-product attention written once against the Python Array API standard.

The one public function, :func:`scaled_dot_product_attention`, runs on the arrays the caller
holds (NumPy, CuPy, torch, JAX, Dask, array-api-strict) and returns arrays of the same
library, dtype and device; :func:`scaled_dot_product_attention_vjp` gives its gradients on
the same libraries, autograd or not. :mod:`sdpa_array.reference` is an independent float64
NumPy oracle with the same arguments.
"""

from ._api import scaled_dot_product_attention
from ._native import CannotDelegateError
from ._parallel import get_num_threads, set_num_threads
from ._vjp import scaled_dot_product_attention_vjp

__all__ = [
    "CannotDelegateError",
    "get_num_threads",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "set_num_threads",
]
__version__ = "0.1.0"
