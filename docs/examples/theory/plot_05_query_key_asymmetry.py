"""
Q and K are not interchangeable
===============================

:ref:`theory-asymmetry`: ``Q`` and ``K`` enter ``S = Q Kᵀ`` symmetrically, yet exchanging them
changes attention, because the softmax normalizes **rows**: ``softmax(S)`` says how each query
distributes its attention over the keys (rows sum to 1), while ``softmax(Sᵀ)`` says how the
attention arriving at each key splits over the queries. The totals a key receives (column
sums of ``softmax(S)``) are not normalized at all.

The backward pass inherits the asymmetry. Every row of ``dS = P ∘ (dP - rowsum(dP ∘ P))``
sums to 0, because the softmax Jacobian annihilates constants. Hence
``dL/dQ_i = scale · Σ_j dS_ij k_j`` is a zero-sum contrast of keys, and summing
``dL/dK_j = scale · Σ_i dS_ij q_i`` over the keys gives exactly 0 (adding one vector to
every key changes nothing after the row softmax), while the query gradients have no such
constraint. :func:`sdpa_array.lab.query_key_asymmetry` computes all of it for one random
self-attention problem of 8 positions.
"""

# %%
import matplotlib.pyplot as plt

from sdpa_array import lab

BACKEND = "numpy"  # any id of sdpa_array.testing.backends.BACKENDS

result = lab.query_key_asymmetry(backend=BACKEND)
print(lab.table_asymmetry(result))

# %%
fig = plt.figure(layout="constrained")
lab.draw_asymmetry(result, fig)
