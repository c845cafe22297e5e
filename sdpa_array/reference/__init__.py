"""Plain float64 NumPy reference ("oracle") for scaled dot-product attention.

This package is the test suite's yardstick for the fast Array API implementation. It is
written to be *read*, not to be fast: every step of the definition appears as one NumPy
expression, in float64, with the causal/window restrictions built from explicit index
grids and a hand-written, max-subtracted softmax. It deliberately shares no code with the
rest of :mod:`sdpa_array`, so that a mistake in one cannot hide in the other.

The gradients in :func:`scaled_dot_product_attention_vjp` are written directly from the
chain rule, forming the softmax Jacobian ``J = diag(p) - p pᵀ`` explicitly for every
query row (an ``(..., L, S, S)`` array), rather than using the FlashAttention shortcut.

Semantics
---------
With ``Q`` of shape ``(..., Hq, L, E)``, ``K`` of shape ``(..., Hkv, S, E)`` and ``V`` of
shape ``(..., Hkv, S, Ev)`` (the heads axis is optional, leading batch axes broadcast):

1. ``z = (Q Kᵀ) * scale`` with ``scale = 1/sqrt(E)`` by default;
2. if ``softcap`` is given, ``z = softcap * tanh(z / softcap)``;
3. if ``bias`` is given, ``z = z + bias``;
4. keys excluded by ``mask`` (``False``), ``is_causal``, ``window`` or a ``-inf`` score get
   ``-inf``;
5. ``P = softmax(z)`` row-wise and ``out = P V``.

A query row with no admissible key yields an output row of zeros, weights of zeros and a
log-sum-exp of ``-inf``.

Examples
--------
>>> import numpy as np
>>> from sdpa_array.reference import scaled_dot_product_attention
>>> q = np.array([[1.0, 0.0]])
>>> k = np.array([[1.0, 0.0], [0.0, 1.0]])
>>> v = np.array([[1.0], [0.0]])
>>> out, w = scaled_dot_product_attention(q, k, v, scale=np.log(3.0), return_weights=True)
>>> w
array([[0.75, 0.25]])
>>> out
array([[0.75]])

Every feature gets its own code here first, independent of the fast paths: the package holds
the conversion to NumPy (``_convert``), the forward pass with its index grids
(``_forward``), the public forward functions (``_attention``), the adjoints of broadcasting
(``_adjoints``) and the gradients (``_vjp``).
"""

from ._adjoints import sum_to_shape, unrepeat_heads
from ._attention import intermediates, scaled_dot_product_attention
from ._convert import to_numpy
from ._vjp import scaled_dot_product_attention_vjp

__all__ = [
    "intermediates",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "sum_to_shape",
    "to_numpy",
    "unrepeat_heads",
]
