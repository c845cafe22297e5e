r"""
Softmax saturation and its vanishing Jacobian
=============================================

:ref:`theory-softmax`: large logits push softmax towards a one-hot vector, where its
Jacobian :math:`\partial p_j / \partial z_k = p_j (\delta_{jk} - p_k)`, i.e.
:math:`J = \operatorname{diag}(p) - p p^\top`, is nearly zero,
so almost no gradient passes back through it.

:func:`sdpa_array.lab.softmax_saturation` takes 256 rows of 64 standard normal logits and
rescales each to variance 1, 10, 20, 30, 50 and 100 (the variances of unscaled logits for
:math:`E` from 1 to 100, see :ref:`theory-scaling`). Because only the scale changes, the largest
probability grows and the entropy falls monotonically, row by row. The Frobenius norm of the
Jacobian, computed from the formed ``64 × 64`` matrix, tells a more careful story than
"saturation makes the gradient vanish":

* it is bounded by :math:`2 (1 - \sum_j p_j^2) \le 4 (1 - \max_j p_j)`, so it does go to 0 as the
  distribution becomes one-hot: the right-hand panel shows it falling in proportion to
  ``1 - max p``;
* but it is **not** monotone in the variance: at variance 1 the 64 probabilities are all
  small, so every :math:`p_j (\delta_{jk} - p_k)` is small too (a uniform :math:`p` has
  :math:`\lVert J \rVert_F = \sqrt{63}/64 \approx 0.12`); the norm peaks when a few
  positions share the mass and only then decays.
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
