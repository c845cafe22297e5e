r"""
Drop-in use in a transformers model
===================================

:mod:`sdpa_array.integrations.transformers` registers the library as an attention
implementation of Hugging Face transformers (see :doc:`/integrations`):
:func:`~sdpa_array.integrations.transformers.register` returns its name, and a model built
or loaded with ``attn_implementation=name`` (or switched with
``model.set_attn_implementation(name)``) computes every attention layer with
:func:`sdpa_array.scaled_dot_product_attention`, each layer's mask passed as options
(causal, sliding window, padding as lengths) rather than as an :math:`L \times S` array.

This example builds a tiny Llama from a config (nothing is downloaded), generates a few
tokens with it, then runs a left-padded batch through it three times on the same weights,
with transformers' ``eager`` and ``sdpa`` attention and with this library's, and draws, for
every real token, how far the logits of each pair of runs lie apart, beside float32's unit
roundoff :math:`u = 2^{-24}`.

All three agree to a few float32 ulps on every real token (the padded positions are left
out: no token attends them, and their own rows are not part of any result). On torch's CPU
the library's ``"auto"`` hands this call (a boolean mask, float32) to torch's own
``scaled_dot_product_attention``, so it gives exactly ``sdpa``'s bits; ``eager`` differs
from both by rounding only. A library call that the native kernel cannot compute exactly
(sinks, say) runs the library's own kernels instead: :func:`sdpa_array.explain` says which.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from sdpa_array.integrations.transformers import register

name = register()  # "array_attention"
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
model = AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()
print("attention implementation:", model.config._attn_implementation)

prompt = torch.randint(1, 128, (1, 8))
generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
print("greedy generation:", generated[0].tolist())

# %%
# The same weights, three attention implementations
# -------------------------------------------------
#
# A batch of three sequences, left-padded by 0, 6 and 15 tokens as batched generation pads
# them; the logits of every real token, from each implementation.
L = 24
ids = torch.randint(1, 128, (3, L))
mask = torch.ones(3, L, dtype=torch.long)
mask[1, :6] = 0  # left padding, as batched generation pads
mask[2, :15] = 0
positions = (mask.cumsum(-1) - 1).clamp(min=0)

logits = {}
for implementation in ("eager", "sdpa", name):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions).logits
    logits[implementation] = out[mask.bool()].numpy()  # the real tokens, sequence by sequence

# %%
# The largest logit difference of each real token, relative to the token's largest logit.
pairs = [("array_attention", "eager"), ("array_attention", "sdpa"), ("sdpa", "eager")]
fig, ax = plt.subplots(figsize=(7, 3.5))
for a, b in pairs:
    diff = np.abs(logits[a] - logits[b]).max(axis=1) / np.abs(logits[b]).max(axis=1)
    ax.semilogy(np.maximum(diff, 1e-12), marker="o", ms=3, lw=1, label=f"{a} vs {b}")
    print(f"{a} vs {b}: largest relative difference {diff.max():.2e}")
ax.axhline(2.0**-24, color="grey", ls="--", lw=1, label="float32 unit roundoff")
ends = np.cumsum(mask.sum(axis=1).numpy())[:-1]
for end in ends:
    ax.axvline(end - 0.5, color="black", lw=0.5)
ax.set_xlabel("real token (three sequences, left-padded by 0, 6 and 15)")
ax.set_ylabel("max |logit difference| / max |logit|")
ax.set_title("A tiny Llama, three attention implementations, float32")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
