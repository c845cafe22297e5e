r"""
Document masks and score functions with block sparsity
=======================================================

A *mask function* ``mask_mod(batch, head, q_idx, kv_idx)`` says which keys each query may
attend to as a function of the positions (FlexAttention style), instead of an ``(L, S)``
array: :mod:`sdpa_array.mods` has ready-made ones. :func:`sdpa_array.create_block_mask`
evaluates one once on NumPy indices and classifies each ``block_q x block_k`` tile of the
score matrix as *empty* (no pair may attend), *full* (every pair may) or *partial*. Passed
as ``mask_mod``, the resulting :class:`sdpa_array.BlockMask` lets the blocked kernel skip
the empty tiles, attend the full ones without evaluating the function, and evaluate it
only on the partial ones (see :doc:`/semantics`, "Mask and bias functions"). With
:math:`M` the mask and :math:`f` a *score function* (``score_mod``), the weights are

.. math::

   P_{ij} = \frac{M_{ij}\, \exp f(z_{ij})}{\sum_{j'} M_{ij'}\, \exp f(z_{ij'})},
   \qquad z_{ij} = \frac{q_i \cdot k_j}{\sqrt{E}} ,

and a tile where :math:`M` is all zero contributes nothing: its work is skipped.

Three mods, each drawn as its element mask at a small size (grid lines: the blocks), the
block mask of that small size, and the block mask of a realistic size with FlexAttention's
128 x 128 blocks:

* ``mods.document``: four packed documents of different lengths;
* ``mods.and_masks(mods.causal(), mods.sliding_window(w, None))``: sliding-window causal
  attention over the last ``w + 1`` keys;
* ``mods.prefix_lm``: bidirectional attention within a prefix, causal after it.

Then an ALiBi bias function, a score function (Gemma 2's soft-cap and a temperature per
head), and :func:`sdpa_array.explain`, which says what a call will run.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from sdpa_array import (
    BlockMask,
    create_block_mask,
    explain,
    mods,
    scaled_dot_product_attention,
)

SMALL, SMALL_BLOCK = 64, 8  # element masks: 64 x 64, blocks of 8
LARGE, LARGE_BLOCK = 4096, 128  # a realistic size, FlexAttention's blocks


def document_mod(n):
    """Four packed documents of 3/8, 1/8, 5/16 and 3/16 of the sequence."""
    lengths = [3 * n // 8, n // 8, 5 * n // 16]
    lengths.append(n - sum(lengths))
    segments = np.repeat(np.arange(len(lengths)), lengths)
    return mods.document(segments, segments)


def sliding_mod(n):
    """Causal attention over the last n/8 + 1 keys."""
    return mods.and_masks(mods.causal(), mods.sliding_window(n // 8, None))


def prefix_mod(n):
    """A prefix of 3/8 of the sequence attended bidirectionally, causal after it."""
    return mods.prefix_lm(3 * n // 8)


EXAMPLES = {
    "document": document_mod,
    "sliding window (causal)": sliding_mod,
    "prefix LM": prefix_mod,
}


def element_mask(mask_mod, n):
    """The mod on NumPy index grids: a boolean (n, n) array (batch 0, head 0)."""
    b = h = np.zeros((1, 1), dtype=np.int64)
    q_idx, kv_idx = np.ogrid[:n, :n]
    return np.broadcast_to(mask_mod(b, h, q_idx, kv_idx), (n, n))


block_masks = {}
print(f"{'blocks skipped':28}{f'L = S = {SMALL}':>16}{f'L = S = {LARGE}':>16}")
print(f"{'':28}{f'blocks of {SMALL_BLOCK}':>16}{f'blocks of {LARGE_BLOCK}':>16}")
for name, make in EXAMPLES.items():
    small = create_block_mask(
        make(SMALL), None, None, SMALL, SMALL, block_q=SMALL_BLOCK, block_k=SMALL_BLOCK
    )
    large = create_block_mask(make(LARGE), None, None, LARGE, LARGE)
    block_masks[name] = small, large
    print(f"{name:28}{small.sparsity:16.1%}{large.sparsity:16.1%}")

# %%
# Element masks and block masks
# -----------------------------
#
# Left: the element mask at ``L = S = 64`` (dark: may attend), with the ``8 x 8`` blocks
# outlined. Middle: the block classes of that mask, ``BlockMask.kinds[0, 0]``. Right: the
# block classes at ``L = S = 4096`` with ``128 x 128`` blocks. Only the partial blocks
# (orange) evaluate the function; the empty ones (light) are not computed at all.

KIND_COLOURS = ["#eeeeee", "#f28e2b", "#2f6da3"]  # EMPTY, PARTIAL, FULL
KIND_NAMES = ["empty (skipped)", "partial (mod evaluated)", "full (no mod evaluated)"]
kinds_cmap = ListedColormap(KIND_COLOURS)
element_cmap = ListedColormap(["#ffffff", "#2f6da3"])


def draw_kinds(ax, bm: BlockMask, title):
    ax.imshow(bm.kinds[0, 0], cmap=kinds_cmap, vmin=0, vmax=2, interpolation="nearest")
    nq, nk = bm.kinds.shape[-2:]
    ax.set_xticks(np.arange(-0.5, nk, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, nq, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6 if max(nq, nk) > 16 else 1.0)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"{title}\n{bm.sparsity:.0%} of blocks skipped", fontsize=10)


fig, axes = plt.subplots(len(EXAMPLES), 3, figsize=(7, 7.9), layout="constrained")
for row, (name, (small, large)) in zip(axes, block_masks.items(), strict=True):
    ax = row[0]
    ax.imshow(element_mask(small.mask_mod, SMALL), cmap=element_cmap, interpolation="nearest")
    for edge in np.arange(SMALL_BLOCK, SMALL, SMALL_BLOCK) - 0.5:
        ax.axhline(edge, color="#999999", linewidth=0.5)
        ax.axvline(edge, color="#999999", linewidth=0.5)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_ylabel(name, fontsize=11)
    ax.set_title(f"element mask, L = S = {SMALL}", fontsize=10)
    draw_kinds(row[1], small, f"block mask, blocks of {SMALL_BLOCK}")
    draw_kinds(row[2], large, f"L = S = {LARGE}, blocks of {LARGE_BLOCK}")
for ax in axes[-1]:
    ax.set_xlabel("keys (kv_idx)")
fig.legend(
    handles=[
        Patch(facecolor=c, edgecolor="#666666", label=n)
        for c, n in zip(KIND_COLOURS, KIND_NAMES, strict=True)
    ],
    loc="outside lower center",
    ncols=3,
    frameon=False,
)
fig.suptitle("Queries (q_idx) down, keys (kv_idx) across", fontsize=11)
plt.show()

# %%
# The mod and the dense mask agree
# --------------------------------
#
# Attention with the document mod, as a plain function and as its block mask, on the
# blocked kernel with ``64 x 64`` tiles, against the same mask passed as a dense boolean
# array. The results agree to rounding: the mod only changes which tiles are computed.

rng = np.random.default_rng(0)
B, H, N, E, TILE = 1, 4, 512, 32, 64
q, k, v = (rng.standard_normal((B, H, N, E)) for _ in range(3))

doc = document_mod(N)
dense_mask = element_mask(doc, N)
dense = scaled_dot_product_attention(q, k, v, mask=dense_mask)
plain = scaled_dot_product_attention(
    q, k, v, mask_mod=doc, implementation="blocked", block_q=TILE, block_k=TILE
)
doc_blocks = create_block_mask(doc, None, None, N, N, block_q=TILE, block_k=TILE)
blocked = scaled_dot_product_attention(
    q, k, v, mask_mod=doc_blocks, implementation="blocked", block_q=TILE, block_k=TILE
)
empty, partial, full = np.bincount(doc_blocks.kinds.ravel(), minlength=3)
print(f"{empty} empty, {partial} partial and {full} full blocks of {TILE} x {TILE}")
print(f"document mod vs dense mask: max |diff| = {np.abs(plain - dense).max():.2e}")
print(f"its BlockMask vs dense mask: max |diff| = {np.abs(blocked - dense).max():.2e}")

# %%
# An ALiBi bias function
# ----------------------
#
# ``bias_mod=mods.alibi(mods.alibi_slopes(H))`` adds ``-slope[head] * |q_idx - kv_idx|`` to
# the scores; combined here with the causal mod, against the same bias and mask as dense
# arrays. Below: the bias of each head for the first 32 positions (the causal mask hides the
# upper triangle).

slopes = mods.alibi_slopes(H)
i, j = np.ogrid[:N, :N]
dense_bias = -slopes[:, None, None] * np.abs(i - j)  # (H, L, S)
with_mods = scaled_dot_product_attention(
    q, k, v, mask_mod=mods.causal(), bias_mod=mods.alibi(slopes)
)
with_arrays = scaled_dot_product_attention(q, k, v, bias=dense_bias, is_causal=True)
print("slopes:", slopes)
print(
    f"alibi + causal mods vs dense arrays: max |diff| = {np.abs(with_mods - with_arrays).max():.2e}"
)

fig, axes = plt.subplots(1, H, figsize=(7, 2.3), layout="constrained")
shown = np.where(j[:32, :32] <= i[:32, :32], dense_bias[:, :32, :32], np.nan)
for head, ax in enumerate(axes):
    image = ax.imshow(
        shown[head],
        cmap="viridis",
        vmin=np.nanmin(shown),
        vmax=0,
        interpolation="nearest",
    )
    ax.set_title(f"head {head}, slope $2^{{{np.log2(slopes[head]):g}}}$", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
axes[0].set_ylabel("queries")
fig.colorbar(image, ax=axes, shrink=0.8, label="bias (white: masked)")
plt.show()

# %%
# Score functions
# ---------------
#
# ``score_mod(score, batch, head, q_idx, kv_idx)`` rewrites each scaled score before the
# softmax. ``mods.tanh_softcap(c)`` is Gemma 2's logit cap :math:`c \tanh(z / c)`, the
# same as ``softcap=c``; ``mods.temperature(t)`` divides head :math:`h`'s scores by
# :math:`t_h`. Both carry their derivative, so the VJP works on NumPy too; a function of
# your own gets one with :func:`sdpa_array.mods.score_function`. Score functions combine
# with the document mask's block sparsity.

capped = scaled_dot_product_attention(
    q, k, v, mask_mod=doc_blocks, score_mod=mods.tanh_softcap(5.0)
)
reference = scaled_dot_product_attention(q, k, v, mask=dense_mask, softcap=5.0)
print(f"tanh_softcap(5) vs softcap=5: max |diff| = {np.abs(capped - reference).max():.2e}")

temperatures = np.array([0.5, 1.0, 2.0, 4.0])
cooled = scaled_dot_product_attention(
    q, k, v, mask_mod=doc_blocks, score_mod=mods.temperature(temperatures)
)
rescaled = np.stack(
    [
        scaled_dot_product_attention(
            q[:, h], k[:, h], v[:, h], mask=dense_mask, scale=1 / (np.sqrt(E) * t)
        )
        for h, t in enumerate(temperatures)
    ],
    axis=1,
)
print(f"temperature per head vs scale per head: max |diff| = {np.abs(cooled - rescaled).max():.2e}")

square = mods.score_function(
    lambda s, b, h, i, j: -(s * s), lambda s, b, h, i, j: -2 * s
)  # a function of your own, with its derivative
print("own score function:", scaled_dot_product_attention(q, k, v, score_mod=square).shape)

# %%
# What runs: ``explain``
# ----------------------
#
# :func:`sdpa_array.explain` takes a call's arguments and says which implementation
# ``"auto"`` picks for the forward pass and the gradients, and why the others were passed
# over. A long document-masked call runs the blocked kernel, which skips the empty tiles.

long_q = np.zeros((1, 4, 4096, 64), dtype=np.float32)
long_blocks = create_block_mask(document_mod(4096), None, None, 4096, 4096)
print(explain(long_q, long_q, long_q, mask_mod=long_blocks))
print(f"tiles skipped: {long_blocks.sparsity:.0%}")
