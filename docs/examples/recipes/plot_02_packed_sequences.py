r"""
Packed variable-length batches
==============================

A batch of sequences of different lengths is usually padded to the longest one, and the
padding costs work: every query attends every padded key of its row, to be masked away.
:func:`sdpa_array.scaled_dot_product_attention_varlen` takes the sequences *packed* one
after another along the first axis, ``(total, H, E)``, with their cumulative offsets
``cu_seqlens`` (FlashAttention's ``flash_attn_varlen_func`` layout): sequence :math:`n`
holds rows ``cu_seqlens[n]:cu_seqlens[n + 1]`` and attends only within itself. Its cost is
the sum of the sequences' own costs, :math:`\sum_n \ell_n^2`, instead of
:math:`N \ell_{\max}^2` for the padded batch.

The result equals, sequence by sequence, the padded call with ``query_lengths`` and
``key_lengths``; this example checks that, the gradients of
:func:`sdpa_array.scaled_dot_product_attention_varlen_vjp`, and the oracle's bound with
:func:`sdpa_array.testing.assert_varlen_close_to_oracle`.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdpa_array import (
    scaled_dot_product_attention,
    scaled_dot_product_attention_varlen,
    scaled_dot_product_attention_varlen_vjp,
)
from sdpa_array.reference import pad_packed
from sdpa_array.testing import assert_varlen_close_to_oracle

rng = np.random.default_rng(0)
H, E = 4, 32
lengths = np.array([37, 120, 8, 64, 250, 19])
cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])  # [0, 37, 157, ...]
total = int(cu_seqlens[-1])
q, k, v = (rng.standard_normal((total, H, E), dtype=np.float32) for _ in range(3))

out = scaled_dot_product_attention_varlen(q, k, v, cu_seqlens, is_causal=True)
print("packed:", q.shape, "->", out.shape, "offsets", cu_seqlens.tolist())
assert_varlen_close_to_oracle(out, q, k, v, cu_seqlens, is_causal=True)
print("within the oracle's bound")

# %%
# The same as a padded batch with lengths
# ---------------------------------------
#
# :func:`sdpa_array.reference.pad_packed` pads the packed rows to ``(N, longest, H, E)``;
# ``layout="BLHE"`` takes that layout as it is (length before heads), and the lengths make
# every padded key invisible and every padded query row zero.

padded = [pad_packed(x, cu_seqlens) for x in (q, k, v)]
out_padded = scaled_dot_product_attention(
    *padded,
    is_causal=True,
    query_lengths=lengths,
    key_lengths=lengths,
    layout="BLHE",
)
rows = [out_padded[n, :length] for n, length in enumerate(lengths)]
print(f"packed vs padded: max |diff| = {np.abs(out - np.concatenate(rows)).max():.1e}")

# %%
# Gradients
# ---------
#
# The VJP takes the output's cotangent in the packed layout and returns the gradients of
# the packed queries, keys and values.

grad_out = rng.standard_normal(out.shape, dtype=np.float32)
dq, dk, dv = scaled_dot_product_attention_varlen_vjp(q, k, v, grad_out, cu_seqlens, is_causal=True)
print("gradients:", dq.shape, dk.shape, dv.shape)

# %%
# What packing saves
# ------------------
#
# The score entries each layout computes for these six sequences (causal attention
# computes about half of each square in both).

padded_work = len(lengths) * lengths.max() ** 2
packed_work = int((lengths**2).sum())
fig, ax = plt.subplots(figsize=(6, 2.4), layout="constrained")
ax.barh(["padded batch", "packed"], [padded_work, packed_work], color=["#bbbbbb", "C0"])
ax.set_xlabel("score entries (query-key pairs)")
ax.set_title(f"{len(lengths)} sequences, lengths {lengths.tolist()}")
for y, value in enumerate([padded_work, packed_work]):
    ax.text(value, y, f" {value:,}", va="center")
ax.set_xlim(0, padded_work * 1.25)
plt.show()
