"""
Softmax saturation and its vanishing Jacobian
=============================================

:ref:`theory-softmax`: large logits push softmax towards a one-hot vector, where its
Jacobian ``∂p_j/∂z_k = p_j (δ_jk - p_k)``, i.e. ``diag(p) - p pᵀ``, is nearly zero,
so almost no gradient passes back through it.

:func:`sdpa_array.lab.softmax_saturation` takes 256 rows of 64 standard normal logits and
rescales each to variance 1, 10, 20, 30, 50 and 100 (the variances of unscaled logits for
``d_k`` from 1 to 100, see :ref:`theory-scaling`). Because only the scale changes, the largest
probability grows and the entropy falls monotonically, row by row. The Frobenius norm of the
Jacobian, computed from the formed ``64 × 64`` matrix, tells a more careful story than
"saturation makes the gradient vanish":

* it is bounded by ``2 (1 - Σ p_j²) <= 4 (1 - max p)``, so it does go to 0 as the
  distribution becomes one-hot: the right-hand panel shows it falling in proportion to
  ``1 - max p``;
* but it is **not** monotone in the variance: at variance 1 the 64 probabilities are all
  small, so every ``p_j (δ_jk - p_k)`` is small too (a uniform ``p`` has
  ``||J||_F = sqrt(63)/64 ≈ 0.12``); the norm peaks when a few positions share the mass and
  only then decays.
"""

# %%
import matplotlib.pyplot as plt

from sdpa_array import lab

BACKEND = "numpy"  # any id of sdpa_array.testing.backends.BACKENDS

result = lab.softmax_saturation(backend=BACKEND)
print(lab.table_saturation(result))

# %%
fig = plt.figure(layout="constrained")
lab.draw_saturation(result, fig)
