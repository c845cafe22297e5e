"""
The gradient reaching Q, for scales 1, 1/sqrt(d_k) and 1/d_k
=============================================================

:ref:`theory-backward`, end to end: the gradient of a loss with respect to the queries
passes through the softmax, ``dQ = scale · dS K`` with ``dS = P ∘ (dP - rowsum(dP ∘ P))``.
:func:`sdpa_array.lab.gradient_flow` draws standard normal ``Q``, ``K`` (64 queries, 64 keys,
width ``d_k``), ``V`` and an upstream gradient ``dO``, and measures the norm of every row of
``dL/dQ`` for three scales:

* ``1/sqrt(d_k)``: the scores keep variance 1, and the typical row norm stays the same for
  every ``d_k`` (about 0.9 here);
* ``1/d_k``: the scores shrink, the weights tend to uniform, and the gradient falls like
  ``d_k^(-1/2)``;
* ``1``: the scores have variance ``d_k``, the weights saturate (right panel), and the median
  row norm collapses (to about 1e-2 at ``d_k = 1024``, with a tenth of the rows below 1e-9).
  The root-mean-square norm (dotted) *grows* meanwhile: the few rows whose two largest scores
  nearly tie receive very large gradients. Unscaled attention does not shrink the gradient
  uniformly; it concentrates it on a handful of queries and starves the rest.

The gradient is computed by the library's backward pass,
:func:`sdpa_array.scaled_dot_product_attention_vjp`;
:func:`sdpa_array.lab.attention_vjp_from_derivation` writes the same derivation out step by
step.
"""

# %%
import matplotlib.pyplot as plt

from sdpa_array import lab

BACKEND = "numpy"  # any id of sdpa_array.testing.backends.BACKENDS

result = lab.gradient_flow(backend=BACKEND)
print(lab.table_gradient_flow(result))

# %%
fig = plt.figure(layout="constrained")
lab.draw_gradient_flow(result, fig)
