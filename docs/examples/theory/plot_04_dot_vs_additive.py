"""
Dot-product versus additive attention
=====================================

:ref:`theory-cost` compares dot-product attention, ``O(n² d)``, with additive (Bahdanau)
attention, ``score(q_i, k_j) = v_aᵀ tanh(W q_i + U k_j)``, often quoted as ``O(n² d²)``
because each of the ``n²`` pairs would compute ``W q_i`` and ``U k_j``.

That count is avoidable. ``W q_i`` depends on the query only and ``U k_j`` on the key only:
computing them once for all queries and all keys costs ``O(n d²)``
(:func:`sdpa_array.lab.additive_attention` does so). What remains pairwise is, for each of the
``n²`` pairs, a sum of two ``d_a``-vectors, ``d_a`` evaluations of ``tanh`` and a dot product
with ``v_a``: ``O(n² d_a)``. Projected once, additive attention has the same order as
dot-product attention; :func:`sdpa_array.lab.additive_attention_flops` counts about twice the
flops for ``d_a = d``.

What cannot be avoided is the *kind* of work: the ``n × n × d_a`` array of ``tanh`` values is
elementwise and memory-bound, while ``Q Kᵀ`` is a single matrix product that BLAS and GPUs run
near peak. The left panel times both on the chosen backend (``n = 128``, float32, best of
five calls, so timings on a busy machine are noisy), the middle panel shows the counted flops
of both, and of additive attention with per-pair projections, and the right panel compares
the measured time ratio with the flop ratio.
"""

# %%
import matplotlib.pyplot as plt

from sdpa_array import lab

BACKEND = "numpy"  # any id of sdpa_array.testing.backends.BACKENDS

result = lab.attention_cost(backend=BACKEND)
print(lab.table_cost(result))

# %%
# The flop counts, term by term, for one configuration:
for name, count in lab.additive_attention_flops(128, 128, 64, 64, 64, 64).terms:
    print(f"{name:22s} {count:>12,d}")

# %%
fig = plt.figure(layout="constrained")
lab.draw_cost(result, fig)
