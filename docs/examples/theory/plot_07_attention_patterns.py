"""
What the masking options do to the weights
==========================================

One random problem, passed to :func:`sdpa_array.scaled_dot_product_attention` with
``return_weights=True`` under each option (grey cells: weight exactly 0):

* ``is_causal=True`` with ``L = S``;
* ``is_causal=True`` with 4 queries and 8 keys, ``alignment="top_left"`` (query ``i``'s
  diagonal is key ``i``) against ``"bottom_right"`` (key ``i + S - L``, the KV-cache view);
* ``window=(2, 1)``: two keys to the left of the diagonal, one to the right;
* ``is_causal=True, window=(2, 0)``: sliding-window causal attention;
* a padding mask of shape ``(1, 8)`` that hides the last three keys from every query (the
  padded queries still attend);
* grouped-query attention, 4 query heads on 2 key/value heads: every head gets the same
  queries here, so heads 0 and 1 (sharing key/value head 0) have identical weights, and so
  do heads 2 and 3.
"""

# %%
import matplotlib.pyplot as plt

from sdpa_array import lab

BACKEND = "numpy"  # any id of sdpa_array.testing.backends.BACKENDS

panels = lab.attention_patterns(backend=BACKEND)
print(lab.table_patterns(panels))

# %%
fig = plt.figure(layout="constrained")
lab.draw_patterns(panels, fig)
