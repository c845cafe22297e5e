"""The transformers adapter (:mod:`sdpa_array.integrations.transformers`) against
transformers' own ``eager`` attention on the same weights.

Tiny models built from configs (no downloads): Llama (GQA) in float64 with a left-padded
batch, compared with each sequence run alone and unpadded (padding must change nothing
for the real tokens); Gemma 2 (softcap, sliding window) in float64 and gpt-oss (sinks,
float32: its experts' grouped products take no float64) on unpadded batches. Logits of
the real tokens, every parameter's gradient, the attention weights and greedy generation
(dynamic and static caches) are compared; so are a packed row's (FlashAttention's
``cu_seq_lens`` offsets) against each of its sequences alone.

The bound: transformers' eager attention computes its softmax in float32 whatever the
model's dtype, so its weights carry a relative error of a few float32 ulps (``u32 = 2**-24``);
through two layers of a randomly initialised model that reaches the logits amplified by
far less than 64, and each layer adds its own few ulps: ``TOL = 100 * 64 * 2**-24``
(3.8e-4) relative to the largest value is therefore loose for a correct adapter, while a
wrong mask, causality, window, scale, softcap, sink or padding changes the results by
order one.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sdpa_array.integrations.transformers import DEFAULT_NAME, register  # noqa: E402

#: See the module docstring: eager's float32 softmax, two layers.
TOL = 100 * 64 * 2.0**-24


#: The size every tiny model shares: 2 layers, 4 query heads over 2 key/value heads.
TINY = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def _gemma2():
    config = transformers.Gemma2Config(
        **TINY,
        head_dim=8,
        sliding_window=4,
        attn_logit_softcapping=0.3,  # small enough to bend these scores
        final_logit_softcapping=None,
    )
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():  # scores of order one, so that the softcap bends them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def _gpt_oss():
    config = transformers.GptOssConfig(
        **{**TINY, "intermediate_size": 32},
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(std=1.0)  # sinks that matter
    return model


MODELS = {"llama": _llama, "gemma2": _gemma2, "gpt-oss": _gpt_oss}
#: The models' dtypes (gpt-oss's experts take no float64) and whether the batch is left
#: padded (Gemma 2's and gpt-oss's windows count padding slots, as transformers defines
#: them, so a padded sequence does not equal itself alone there).
SETUPS = {
    "llama": (torch.float64, True),
    "gemma2": (torch.float64, False),
    "gpt-oss": (torch.float32, False),
}


def _pair(build, dtype=torch.float64):
    torch.manual_seed(0)
    ours = build().to(dtype).eval()
    theirs = build().to(dtype).eval()
    theirs.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(register())
    theirs.set_attn_implementation("eager")
    return ours, theirs


def _batch(padded: bool):
    """Two sequences of 8 tokens, the second left-padded by three where ``padded``, with
    the mask and the positions transformers' generation would give them."""
    ids = torch.tensor([[5, 17, 3, 44, 9, 61, 2, 30], [1, 2, 3, 12, 7, 88, 21, 4]])
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3] = 0
        mask[1, :3] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _close(ours, theirs, what):
    scale = 1.0 + float(theirs.abs().max())
    err = float((ours - theirs).abs().max())
    assert err <= TOL * scale, f"{what}: max abs difference {err:.3e} > {TOL * scale:.3e}"


def _real_logits_and_grads(model, ids, mask, positions, alone):
    """Logits of the real tokens (row-major) and every parameter's gradient of the sum of
    their squares: the batch in one call, or (``alone``) each sequence's real tokens
    unpadded in a call of its own."""
    model.zero_grad()
    if alone:
        parts = [model(ids[b][mask[b].bool()][None]).logits[0] for b in range(ids.shape[0])]
        logits = torch.cat(parts)
    else:
        logits = model(ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]
    (logits**2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("family", sorted(MODELS))
def test_logits_and_gradients_match_eager(family):
    dtype, padded = SETUPS[family]
    ours, theirs = _pair(MODELS[family], dtype)
    ids, mask, positions = _batch(padded)
    a, grads_a = _real_logits_and_grads(ours, ids, mask, positions, alone=False)
    b, grads_b = _real_logits_and_grads(theirs, ids, mask, positions, alone=padded)
    _close(a, b, "logits")
    assert grads_a.keys() == grads_b.keys()
    assert grads_a
    for name in grads_a:
        _close(grads_a[name], grads_b[name], f"gradient of {name}")


def test_attention_weights_match_eager():
    ours, theirs = _pair(_llama)
    ids = _batch(padded=False)[0]
    with torch.no_grad():
        a = ours(ids, output_attentions=True).attentions
        b = theirs(ids, output_attentions=True).attentions
    assert len(a) == len(b) == 2
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        _close(x, y, f"weights of layer {i}")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_generation_matches_eager(family, cache):
    """Greedy tokens of the batch through the adapter equal eager's: for Llama the batch is
    left padded and eager generates each sequence alone."""
    dtype, padded = SETUPS[family]
    ours, theirs = _pair(MODELS[family], dtype)
    ids, mask, _ = _batch(padded)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        got = ours.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
        for b in range(ids.shape[0]):
            alone = ids[b][mask[b].bool()][None]
            expected = theirs.generate(alone, attention_mask=torch.ones_like(alone), **kwargs)
            assert torch.equal(got[b], expected[0, alone.shape[1] :]), f"sequence {b}"


def test_unpadded_causal_calls_pass_no_mask(monkeypatch):
    """Without padding transformers leaves the mask out, and the kernel gets ``is_causal``,
    not an (L, S) mask."""
    from sdpa_array.integrations import transformers as adapter

    seen = []
    original = adapter.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("mask"), kwargs.get("is_causal")))
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter, "scaled_dot_product_attention", spy)
    ours, _ = _pair(_llama)
    with torch.no_grad():
        ours(torch.tensor([[5, 17, 3, 44]]))
    assert seen == [(None, True)] * 2


#: Three sequences packed into one row (FlashAttention's offsets), as transformers'
#: ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them.
PACKED = [[5, 17, 3, 44, 9], [61, 2, 30, 1, 2, 3, 12, 7], [88, 21, 4]]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_sequences_equal_each_sequence_alone(family, monkeypatch):
    """A packed row with ``cu_seq_lens_q``/``cu_seq_lens_k`` (and positions restarting at
    each sequence): the logits and gradients equal eager's on each sequence alone, and
    every layer runs the packed layout's function, not a dense mask."""
    from sdpa_array.integrations import transformers as adapter

    calls = []
    original = adapter.scaled_dot_product_attention_varlen

    def spy(*args, **kwargs):
        calls.append(kwargs.get("window"))
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter, "scaled_dot_product_attention_varlen", spy)
    dtype, _ = SETUPS[family]
    ours, theirs = _pair(MODELS[family], dtype)
    ids = torch.tensor([[token for sequence in PACKED for token in sequence]])
    positions = torch.cat([torch.arange(len(p)) for p in PACKED])[None]
    cu = torch.tensor([0, 5, 13, 16], dtype=torch.int32)
    packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 8, "max_length_k": 8}
    logits = ours(ids, position_ids=positions, **packed).logits[0]
    (logits**2).sum().backward()
    parts = [theirs(torch.tensor([p])).logits[0] for p in PACKED]
    expected = torch.cat(parts)
    (expected**2).sum().backward()
    _close(logits.detach(), expected.detach(), "logits")
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if b.grad is not None:
            _close(a.grad, b.grad, f"gradient of {name}")
    windows = {"llama": [None, None], "gemma2": [(3, 0), None]}[family]
    assert calls == windows  # Gemma 2 alternates sliding-window and global layers


def test_register_refuses_transformers_own_names():
    assert register() == DEFAULT_NAME
    for bad in ("sdpa", "eager", "flash_attention_2", "", None):
        with pytest.raises(ValueError, match="name must be a new attention implementation"):
            register(bad)
