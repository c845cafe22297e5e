"""
Var(q·k) = d_k, and 1 after dividing by sqrt(d_k)
=================================================

:ref:`theory-scaling`: if the components of ``q`` and ``k`` are independent with mean 0 and
variance 1, then ``q·k = Σ_l q_l k_l`` has mean 0 and variance ``d_k``, so the logits of
unscaled attention spread like ``sqrt(d_k)``; dividing by ``sqrt(d_k)`` brings the variance
back to 1 for every width.

:func:`sdpa_array.lab.dot_product_variance` draws ``N = 4096`` pairs per width and reports
the sample moments together with the interval in which they should fall. The standard error
of a sample variance depends on the fourth moment: each term ``q_l k_l`` has kurtosis 9, so
``q·k`` has kurtosis ``3 + 6/d_k`` and
``SE(S²) = d_k · sqrt(2/(N - 1) + 6/(d_k N))`` (derived in the function's docstring). The
intervals drawn are ``theory ± 3.29 SE`` (99.9 % each; with nine widths, one point outside
its interval now and then is expected).
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
