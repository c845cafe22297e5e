r"""
Var(q·k) = E, and 1 after dividing by √E
========================================

:ref:`theory-scaling`: if the components of :math:`q` and :math:`k` are independent with
mean 0 and variance 1, then :math:`q \cdot k = \sum_l q_l k_l` has mean 0 and variance
:math:`E` (the width of queries and keys), so the logits of unscaled attention spread like
:math:`\sqrt{E}`; dividing by :math:`\sqrt{E}` brings the variance back to 1 for every
width.

:func:`sdpa_array.lab.dot_product_variance` draws ``N = 4096`` pairs per width and reports
the sample moments together with the interval in which they should fall. The standard error
of a sample variance depends on the fourth moment: each term :math:`q_l k_l` has kurtosis
9, so :math:`q \cdot k` has kurtosis :math:`3 + 6/E` and

.. math::

   \operatorname{SE}(S^2) = E \sqrt{\frac{2}{N - 1} + \frac{6}{E N}}

(derived in the function's docstring). The intervals drawn are
:math:`\text{theory} \pm 3.29\,\operatorname{SE}` (99.9 % each; with nine widths, one
point outside its interval now and then is expected).
"""

# %%
import matplotlib.pyplot as plt

from sdpa_array import lab

BACKEND = "numpy"  # any id of sdpa_array.testing.backends.BACKENDS

result = lab.dot_product_variance(backend=BACKEND)
print(lab.table_variance(result))

# %%
fig = plt.figure(layout="constrained")
lab.draw_variance(result, fig)
