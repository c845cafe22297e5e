r"""
Decoding with a KV cache, contiguous and paged
==============================================

Generating text one token at a time, each step attends the new token's query to the keys
and values of every token so far. Those are kept in a *KV cache* instead of recomputed:
:func:`sdpa_array.attention_with_kv_cache` writes the new token's key and value into the
cache and attends the query to the cached tokens, in one call. With :math:`n_b` tokens in
sequence :math:`b`'s cache, the new query attends

.. math::

   o_b = \sum_{t < n_b + 1} \operatorname{softmax}_t\!\left(
   \frac{q_b \cdot k_{b,t}}{\sqrt{E}}\right) v_{b,t},

which is :func:`sdpa_array.scaled_dot_product_attention` over the filled part of the cache
with ``alignment="bottom_right"`` (the new query's diagonal is the last token). The cache
comes in two layouts:

* **contiguous**, ``(B, Hkv, S_max, E)``: one row of ``S_max`` slots per sequence;
* **paged**, ``(num_pages, Hkv, page_size, E)`` with a ``block_table`` ``(B, max_pages)``:
  sequence ``b``'s token ``t`` lives in page ``block_table[b, t // page_size]`` (vLLM's
  PagedAttention), so sequences of very different lengths share one pool of pages.

This example decodes 8 steps for a batch of 3 sequences of different prompt lengths with
grouped-query attention (8 query heads, 2 key/value heads) in both layouts, and checks each
step against a full call on the tokens so far.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np

from sdpa_array import attention_with_kv_cache, scaled_dot_product_attention

rng = np.random.default_rng(0)
B, HQ, HKV, E = 3, 8, 2, 16  # batch, query heads, key/value heads, head width
prompt = np.array([5, 17, 11])  # tokens already in each sequence's cache
STEPS, S_MAX, PAGE = 8, 32, 4


def token(n):
    """n new tokens per sequence: queries (B, HQ, n, E), keys and values (B, HKV, n, E)."""
    return (
        rng.standard_normal((B, HQ, n, E), dtype=np.float32),
        rng.standard_normal((B, HKV, n, E), dtype=np.float32),
        rng.standard_normal((B, HKV, n, E), dtype=np.float32),
    )


# The prompts' keys and values, written into a contiguous cache.
k_cache = np.zeros((B, HKV, S_MAX, E), dtype=np.float32)
v_cache = np.zeros((B, HKV, S_MAX, E), dtype=np.float32)
_, k_prompt, v_prompt = token(S_MAX)
for b, n in enumerate(prompt):
    k_cache[b, :, :n], v_cache[b, :, :n] = k_prompt[b, :, :n], v_prompt[b, :, :n]

# The same tokens in a paged cache: pages of 4 tokens handed out in a shuffled order.
pages_needed = -(-(prompt + STEPS) // PAGE)  # ceil: pages each sequence will use
free = list(rng.permutation(int(pages_needed.sum())))
block_table = np.zeros((B, int(pages_needed.max())), dtype=np.int64)
for b, n in enumerate(pages_needed):
    block_table[b, :n] = [free.pop() for _ in range(n)]
k_pages = np.zeros((int(pages_needed.sum()), HKV, PAGE, E), dtype=np.float32)
v_pages = np.zeros_like(k_pages)
for b, n in enumerate(prompt):
    for t in range(n):
        page, row = block_table[b, t // PAGE], t % PAGE
        k_pages[page, :, row], v_pages[page, :, row] = k_cache[b, :, t], v_cache[b, :, t]
print("block table (pages of each sequence):")
print(block_table)

# %%
# Decoding
# --------
#
# Each step writes one token per sequence (``new_key``, ``new_value``) at position
# ``cache_lengths[b]`` and attends the new query to the tokens ``[0, cache_lengths[b] +
# 1)``; the caches are updated in place for NumPy. The reference is the plain call over
# each sequence's filled cache.

lengths = prompt.copy()
errors = []
for _ in range(STEPS):
    q, k_new, v_new = token(1)
    out, k_cache, v_cache = attention_with_kv_cache(
        q,
        k_cache,
        v_cache,
        cache_lengths=lengths,
        new_key=k_new,
        new_value=v_new,
        enable_gqa=True,
    )
    out_paged, k_pages, v_pages = attention_with_kv_cache(
        q,
        k_pages,
        v_pages,
        cache_lengths=lengths,
        new_key=k_new,
        new_value=v_new,
        block_table=block_table,
        enable_gqa=True,
    )
    lengths = lengths + 1
    for b in range(B):
        n = lengths[b]
        full = scaled_dot_product_attention(
            q[b], k_cache[b, :, :n], v_cache[b, :, :n], enable_gqa=True
        )
        errors.append(
            (
                float(np.abs(out[b] - full).max()),
                float(np.abs(out_paged[b] - full).max()),
            )
        )
errors = np.array(errors)
print(f"cache lengths after {STEPS} steps: {lengths.tolist()}")
print(f"contiguous vs full call: max |diff| = {errors[:, 0].max():.1e}")
print(f"paged vs full call:      max |diff| = {errors[:, 1].max():.1e}")

# %%
# Where the tokens are
# --------------------
#
# Left: the contiguous cache, one row of slots per sequence (dark: filled, by the prompt or
# by decoding). Right: the pool of pages, coloured by the sequence that owns each page.

fig, (ax1, ax2) = plt.subplots(
    1, 2, figsize=(7, 2.6), layout="constrained", width_ratios=[S_MAX, 3 * len(k_pages)]
)
filled = np.zeros((B, S_MAX))
for b in range(B):
    filled[b, : prompt[b]] = 1
    filled[b, prompt[b] : lengths[b]] = 2
ax1.imshow(filled, cmap="Blues", vmin=0, vmax=2.5, aspect="auto", interpolation="nearest")
ax1.set(xlabel="slot", ylabel="sequence", yticks=range(B), title="contiguous cache")
owner = np.full((1, len(k_pages)), np.nan)
for b in range(B):
    owner[0, block_table[b, : pages_needed[b]]] = b
ax2.imshow(owner, cmap="Set2", aspect="auto", interpolation="nearest")
for page in range(len(k_pages)):
    ax2.text(page, 0, f"{int(owner[0, page])}", ha="center", va="center", fontsize=8)
ax2.set(xlabel="page", yticks=[], title="paged cache (number: owning sequence)")
plt.show()
