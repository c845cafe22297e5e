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
shape ``(..., Hkv, S, Ev)`` (the heads axis is optional, leading batch axes broadcast). The
*batch shape* is the broadcast leading shape without the heads axis (``()`` for 2-D inputs);
``b`` below is one batch element, ``i`` a query and ``j`` a key.

1. ``z = (Q Kᵀ) * scale`` with ``scale = 1/sqrt(E)`` by default; ``scale`` may be a number
   or a 0-d array of any library, positive and finite; if ``score_mod`` is given,
   ``z = score_mod(z, b, h, i, j)`` (on float64 NumPy scores and index arrays);
2. if ``softcap`` is given, ``z = softcap * tanh(z / softcap)``;
3. if ``bias`` is given, ``z = z + bias``; if ``bias_mod`` is given,
   ``z = z + bias_mod(b, h, i, j)`` (both are added when both are given);
4. key ``j`` is excluded for query ``i`` (its score becomes ``-inf``) where

   a. ``mask`` is ``False``, or ``z`` is ``-inf``;
   b. ``i >= query_lengths[b]`` (padded query) or ``j >= key_lengths[b]`` (padded key);
   c. ``query_segments[b, i] != key_segments[b, j]`` (``segment_ids``, packed documents);
   d. ``is_causal`` and ``j > diag``, or ``window=(left, right)`` and ``j`` is outside
      ``[diag - left, diag + right]``, where ``diag = i`` for ``alignment="top_left"`` and
      ``diag = i + key_lengths[b] - query_lengths[b]`` for ``"bottom_right"`` (lengths not
      given count as ``L`` and ``S``);
   e. ``mask_mod(b, h, i, j)`` is ``False``;

5. ``P = softmax(z)`` row-wise and ``out = P V``; with ``sinks`` the softmax runs over
   ``[z, sink_h]`` and the sink's column (whose value is zero) is dropped, so rows sum to
   less than one and ``lse`` includes the sink; with ``dropout_p`` the weights are multiplied
   by ``dropout_keep_mask(dropout_seed, shape, dropout_p) / (1 - dropout_p)`` before ``V``
   (``lse`` is unaffected).

``mask_mod`` and ``bias_mod`` are called once, with integer arrays of the query's library
and device that broadcast to the scores' shape ``(*batch, Hq, L, S)``: ``b`` is the batch
element's row-major flattened index (shape ``(*batch, 1, 1, 1)``), ``h`` the query head
(``(Hq, 1, 1)``), ``i`` the query (``(L, 1)``) and ``j`` the key (``(S,)``); without a
heads axis (scores ``(L, S)``) ``b`` and ``h`` are 0-d zeros. They hold no parameters and
get no gradient.

A query row with no admissible key (padded queries among them) yields an output row of
zeros, weights of zeros and a log-sum-exp of ``-inf`` (``sink_h`` with sinks), and passes
no gradient to queries, keys or values.

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
the conversion to NumPy (``_convert``), the index grids of step 4 b-d and the reading of
``scale`` (``_restrictions``), the calling of ``mask_mod`` and ``bias_mod`` (``_mods``), the
forward pass (``_forward``), the public forward functions (``_attention``), the adjoints of
broadcasting (``_adjoints``), the gradients (``_vjp``) and the packed variable-length
layout (``_varlen``: padded to a batch with lengths, computed, unpadded).
The gradient of a ``scale`` given as an array is ``sum(dZ' * (Q Kᵀ))``, ``dZ'`` being the
gradient with respect to the scaled scores of step 1.
"""

from ._adjoints import sum_to_shape, unrepeat_heads
from ._attention import intermediates, scaled_dot_product_attention
from ._convert import to_numpy
from ._varlen import (
    pad_packed,
    scaled_dot_product_attention_varlen,
    scaled_dot_product_attention_varlen_vjp,
    unpad_packed,
)
from ._vjp import scaled_dot_product_attention_vjp

__all__ = [
    "intermediates",
    "pad_packed",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_varlen",
    "scaled_dot_product_attention_varlen_vjp",
    "scaled_dot_product_attention_vjp",
    "sum_to_shape",
    "to_numpy",
    "unpad_packed",
    "unrepeat_heads",
]
