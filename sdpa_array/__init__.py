"""Scaled dot-product attention written once against the Python Array API standard.

:func:`scaled_dot_product_attention` runs on the arrays the caller holds (NumPy, CuPy,
torch, JAX, Dask, array-api-strict) and returns arrays of the same library, dtype and
device; :func:`scaled_dot_product_attention_vjp` gives its gradients on the same libraries,
autograd or not; :func:`scaled_dot_product_attention_varlen` and its VJP take sequences
packed along one axis with cumulative offsets. :func:`merge_attention_states` combines
partial results over disjoint key sets, and :func:`attention_with_kv_cache` decodes against
a contiguous or paged key/value cache. :func:`dropout_keep_mask` is the keep mask of
attention dropout for a seed, the same bits on every library. ``mask_mod``/``bias_mod``
take mask and bias functions of the indices instead of dense arrays, and ``score_mod`` a
function of each score and its indices: ready-made ones are in :mod:`sdpa_array.mods`, and
:func:`create_block_mask` classifies a mask function's blocks once for reuse.
:mod:`sdpa_array.reference` is an independent float64 NumPy oracle with the same arguments,
and :mod:`sdpa_array.testing` checks any result against it.
"""

import importlib as _importlib
import sys as _sys
import types as _types
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from . import mods
from ._api.dropout import dropout_keep_mask
from ._api.explain import Explanation, explain
from ._api.explain_cache import CacheExplanation, explain_kv_cache
from ._api.forward import scaled_dot_product_attention
from ._api.kv_cache import attention_with_kv_cache
from ._api.memory import release_memory
from ._api.multi_head import multi_head_attention
from ._api.varlen import (
    scaled_dot_product_attention_varlen,
    scaled_dot_product_attention_varlen_vjp,
)
from ._api.vjp import scaled_dot_product_attention_vjp
from ._arrays.merge import merge_attention_states
from ._arrays.parallel import get_num_threads, set_num_threads
from ._errors import CannotDelegateError, CannotUseTritonError
from ._plan.optional_kernels import get_optional_kernels, set_optional_kernels
from ._problem.block_mask import BlockMask, create_block_mask

__all__ = [
    "BlockMask",
    "CacheExplanation",
    "CannotDelegateError",
    "CannotUseTritonError",
    "Explanation",
    "attention_with_kv_cache",
    "create_block_mask",
    "dropout_keep_mask",
    "explain",
    "explain_kv_cache",
    "get_num_threads",
    "get_optional_kernels",
    "merge_attention_states",
    "mods",
    "multi_head_attention",
    "nn",
    "release_memory",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_varlen",
    "scaled_dot_product_attention_varlen_vjp",
    "scaled_dot_product_attention_vjp",
    "set_num_threads",
    "set_optional_kernels",
]


def _torch_layer(name: str, where: str) -> object:
    """The torch layer ``name`` (imported on first use: torch is optional, and importing
    sdpa_array imports none of it), or an ``AttributeError`` naming the module ``where``."""
    if name == "MultiheadAttention":
        from ._api.torch_module import MultiheadAttention

        return MultiheadAttention
    raise AttributeError(f"module {where!r} has no attribute {name!r}")


#: Subpackages beside the library, imported on first use: the float64 oracle, the testing
#: helpers, the integrations with other frameworks and the lab's experiments.
_SUBPACKAGES = ("distributed", "integrations", "lab", "reference", "testing")


def __getattr__(name: str) -> object:
    """``MultiheadAttention``, the drop-in for ``torch.nn.MultiheadAttention``, and the
    subpackages of :data:`_SUBPACKAGES` (imported on first use)."""
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    return _torch_layer(name, __name__)


def __dir__() -> list[str]:
    """The public names, for ``dir()`` and tab completion."""
    return sorted({*__all__, *_SUBPACKAGES, "MultiheadAttention", "__version__"})


def _nn_module() -> _types.ModuleType:
    """``sdpa_array.nn``, torch's layer names computed by this library
    (``sdpa_array.nn.MultiheadAttention``): a module object, not a file, whose names import
    torch on first use."""
    module = _types.ModuleType(
        f"{__name__}.nn",
        "torch layers computed by sdpa_array: ``MultiheadAttention``, the drop-in for "
        "``torch.nn.MultiheadAttention`` (imported with torch on first use).",
    )
    module.__getattr__ = lambda name: _torch_layer(name, module.__name__)  # type: ignore[method-assign]
    module.__dict__["__all__"] = ["MultiheadAttention"]
    module.__dict__["__dir__"] = lambda: ["MultiheadAttention"]
    return module


nn = _nn_module()
# registered, so that ``import sdpa_array.nn`` and ``from sdpa_array.nn import ...`` work
_sys.modules[nn.__name__] = nn


try:
    __version__ = _version("sdpa_array")
except _PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
