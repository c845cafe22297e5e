r"""
The gradient reaching Q, for scales 1, 1/√E and 1/E
===================================================

:ref:`theory-backward`, end to end: the gradient of a loss with respect to the queries
passes through the softmax, :math:`dQ = \text{scale} \cdot dS\, K` with
:math:`dS = P \odot (dP - \operatorname{rowsum}(dP \odot P))`.
:func:`sdpa_array.lab.gradient_flow` draws standard normal ``Q``, ``K`` (64 queries, 64 keys,
width :math:`E`), ``V`` and an upstream gradient ``dO``, and measures the norm of every row of
``dL/dQ`` for three scales:

* :math:`1/\sqrt{E}`: the scores keep variance 1, and the typical row norm stays the same
  for every :math:`E` (about 0.9 here);
* :math:`1/E`: the scores shrink, the weights tend to uniform, and the gradient falls like
  :math:`E^{-1/2}`;
* :math:`1`: the scores have variance :math:`E`, the weights saturate (right panel), and the
  median row norm collapses (to about :math:`10^{-2}` at :math:`E = 1024`, with a tenth of
  the rows below :math:`10^{-9}`).
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
