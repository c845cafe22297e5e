"""
A worked example, and its hand-computed figures
===============================================

:ref:`theory-worked-example` works through :math:`E = 2`, ``Q = [[1, 2], [3, 4]]``,
``K = [[5, 6], [7, 8], [9, 10]]``, ``V = [[1, 0, 1], [0, 1, 0], [1, 1, 0]]``. A hand
computation of the same example, from which this project started, published rounded figures
(kept as ``sdpa_array.lab.PUBLISHED``).
:func:`sdpa_array.lab.worked_example` recomputes every intermediate with
:func:`sdpa_array.scaled_dot_product_attention` and checks each published figure against the
exact value: a figure is consistent if it is within half a unit of its last printed digit.

The scores and scaled scores are right. Four of the six published weights and three of the
six outputs are not: the first row's weights are ``[2.04e-4, 0.0142, 0.9856]``, not
``[2.06e-4, 0.016, 0.984]``; the second row's first weight is ``2.52e-9``, not ``1.67e-9``;
and the second output row is ``[0.99995, 0.9999999975, 2.5e-9]``, which rounds to
``[0.9999, 1.0000, 0.0000]``, not ``[0.9999, 0.9999, 0.0001]``.
"""

# %%
import matplotlib.pyplot as plt

from sdpa_array import lab

BACKEND = "numpy"  # any id of sdpa_array.testing.backends.BACKENDS

result = lab.worked_example(backend=BACKEND)
print(lab.table_worked_example(result))

# %%
fig = plt.figure(layout="constrained")
lab.draw_worked_example(result, fig)
