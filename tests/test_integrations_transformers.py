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
    assert ours.config._attn_implementation == DEFAULT_NAME  # not a config both share
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


def _spy_calls(monkeypatch):
    """The restriction options of every attention call the adapter makes."""
    from sdpa_array.integrations import transformers as adapter

    seen = []
    original = adapter.scaled_dot_product_attention
    names = ("mask", "mask_mod", "is_causal", "window", "padding_side", "key_lengths")
    names += ("segment_ids",)

    def spy(*args, **kwargs):
        found = {n: kwargs.get(n) for n in names}
        if found["key_lengths"] is not None:
            found["key_lengths"] = found["key_lengths"].tolist()
        seen.append(found)
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_t5_generation_matches_eager(cache):
    """T5 (an encoder-decoder with a relative position bias, cross-attention and a
    bidirectional encoder): greedy tokens through the adapter equal eager's, with a static
    cache too (whose keys past the queries are cut off, and their position bias with
    them)."""

    def build():
        config = transformers.T5Config(
            vocab_size=97,
            d_model=32,
            d_kv=8,
            d_ff=48,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
        return transformers.T5ForConditionalGeneration(config)

    ours, theirs = _pair(build)
    ids = torch.tensor([[5, 17, 3, 44, 9, 61], [1, 2, 3, 12, 0, 0]])
    kwargs = {"attention_mask": (ids != 0).long(), "max_new_tokens": 5, "do_sample": False}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    logits = {"output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        got = ours.generate(ids, **kwargs, **logits)
        expected = theirs.generate(ids, **kwargs, **logits)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.logits, expected.logits, strict=True)):
        _close(a, b, f"logits of step {step}")


def test_causal_padding_reaches_the_kernel_as_options(monkeypatch):
    """Without padding the kernel gets ``is_causal``; with a left-padded batch, key lengths
    padded on the left: never a mask or a mask function."""
    seen = _spy_calls(monkeypatch)
    ours, _ = _pair(_llama)
    ids, mask, positions = _batch(padded=True)
    with torch.no_grad():
        ours(ids[:1, :4])
        ours(ids, attention_mask=mask, position_ids=positions)
    plain = dict(mask=None, mask_mod=None, is_causal=True, window=None, segment_ids=None)
    assert seen[:2] == [{**plain, "padding_side": None, "key_lengths": None}] * 2
    assert seen[2:] == [{**plain, "padding_side": "left", "key_lengths": [8, 5]}] * 2


def test_a_bert_encoder_matches_eager_with_right_padding(monkeypatch):
    """A bidirectional encoder (BERT) with a right-padded batch: its hidden states at the
    real tokens equal eager's, and its calls get key lengths, not a mask."""
    config = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )  # a config each: the implementation is the config's
    ours, theirs = _pair(lambda: transformers.BertModel(transformers.BertConfig(**config)))
    ids = torch.tensor([[5, 17, 3, 44, 9, 61], [1, 2, 3, 12, 0, 0]])
    mask = (ids != 0).long()
    seen = _spy_calls(monkeypatch)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).last_hidden_state[mask.bool()]
        b = theirs(ids, attention_mask=mask).last_hidden_state[mask.bool()]
    _close(a, b, "hidden states")
    expected = dict(mask=None, mask_mod=None, is_causal=False, window=None, segment_ids=None)
    assert seen == [{**expected, "padding_side": "right", "key_lengths": [6, 4]}] * 2


#: Three sequences packed into one row (FlashAttention's offsets), as transformers'
#: ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them.
PACKED = [[5, 17, 3, 44, 9], [61, 2, 30, 1, 2, 3, 12, 7], [88, 21, 4]]


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_sequences_equal_each_sequence_alone(family, use_cache, monkeypatch):
    """A packed row with ``cu_seq_lens_q``/``cu_seq_lens_k`` (and positions restarting at
    each sequence): the logits and gradients equal eager's on each sequence alone, and
    every layer runs the packed layout's function, not a dense mask. Without a cache (as
    in training) transformers finds the sequences from the positions too, and the mask
    builder's segment ids are left to the offsets."""
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
    logits = ours(ids, position_ids=positions, use_cache=use_cache, **packed).logits[0]
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


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_positions_become_segment_ids(family, monkeypatch):
    """A packed row without the offsets, only positions restarting at each sequence (what
    transformers detects itself, without a cache: training): the logits equal eager's on
    each sequence alone, and every layer gets the sequences as ``segment_ids``, not a
    mask."""
    seen = _spy_calls(monkeypatch)
    dtype, _ = SETUPS[family]
    ours, theirs = _pair(MODELS[family], dtype)
    ids = torch.tensor([[token for sequence in PACKED for token in sequence]])
    positions = torch.cat([torch.arange(len(p)) for p in PACKED])[None]
    with torch.no_grad():
        logits = ours(ids, position_ids=positions, use_cache=False).logits[0]
        expected = torch.cat([theirs(torch.tensor([p])).logits[0] for p in PACKED])
    _close(logits, expected, "logits")
    ids_of_tokens = [n for n, p in enumerate(PACKED) for _ in p]
    assert len(seen) == 2
    for call in seen:
        assert call["mask"] is None
        assert call["mask_mod"] is None
        assert [x.tolist() for x in call["segment_ids"]] == [[ids_of_tokens]] * 2


def _bad_calls():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    wrong_heads = torch.randn(1, 3, 3, 8)
    return [
        ((q[0], k, k, None), {}, r"query must be a 4-D tensor .* got \(4, 3, 8\)"),
        ((q, k, k[0], None), {}, r"value must be a 4-D tensor"),
        ((q, k, k, torch.ones(1, 1, 3, 5, dtype=torch.bool)), {}, r"mask of shape \(1, 1, 3, 5\)"),
        ((q, wrong_heads, wrong_heads, None), {}, r"query heads \(4\) to be a multiple"),
        ((q, k, k, None), {"cu_seq_lens_q": torch.tensor([0, 2, 1, 3])}, r"cu_seqlens_q must"),
        ((q, k, k, None), {"s_aux": torch.randn(3)}, r"sinks of shape \(3,\)"),
    ]


@pytest.mark.parametrize(("args", "kwargs", "message"), _bad_calls())
def test_bad_input_names_the_argument(args, kwargs, message):
    from sdpa_array.integrations.transformers import attention_forward

    module = torch.nn.Module()
    with pytest.raises(ValueError, match=message):
        attention_forward(module, *args, **kwargs)


def test_register_refuses_transformers_own_names():
    assert register() == DEFAULT_NAME
    for bad in ("sdpa", "eager", "flash_attention_2", "", None):
        with pytest.raises(ValueError, match="name must be a new attention implementation"):
            register(bad)


def _padding_mask(rows, n):
    """A 2-D padding mask of ``n`` positions: ``"left"``/``"right"`` with that many real
    tokens, or an explicit 0/1 list."""
    out = []
    for row in rows:
        side, count = row if isinstance(row, tuple) else (None, row)
        if side == "left":
            out.append([0] * (n - count) + [1] * count)
        elif side == "right":
            out.append([1] * count + [0] * (n - count))
        else:
            out.append(list(count))
    return torch.tensor(out, dtype=torch.bool)


def _patterns():
    from transformers import masking_utils as m

    return {
        "causal": m.causal_mask_function,
        "bidirectional": m.bidirectional_mask_function,
        "sliding3": m.sliding_window_causal_mask_function(3),
        "bidirectional_window2": m.sliding_window_bidirectional_mask_function(2),
        "chunked2": m.chunked_causal_mask_function(2, torch.tensor([0, 1])),
        "causal_or_prefix": m.or_masks(m.causal_mask_function, lambda b, h, q, kv: kv < 2),
        "packed_causal": _packed_pattern(m.causal_mask_function),
        "packed_sliding3": _packed_pattern(m.sliding_window_causal_mask_function(3)),
    }


def _packed_pattern(pattern):
    """``pattern`` on two rows of packed sequences, as ``create_causal_mask`` builds it."""
    from transformers import masking_utils as m

    positions = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 2, 0]])
    segments = m.find_packed_sequence_indices(positions)
    remapped = m.remap_positions_for_packed_sequence(pattern, positions)
    return m.and_masks(remapped, m.packed_sequence_mask_function(segments))


#: (pattern, q_length, kv_length, q_offset, kv_offset, padding rows, padded positions,
#: expected form): prefill, decode, a static cache (keys past the queries), a sliding
#: cache (kv_offset > 0), encoders and cross-attention, packed sequences found from the
#: positions, and the masks only a mask_mod says.
RESTRICTIONS = [
    ("causal", 6, 6, 0, 0, None, 0, "options"),
    ("causal", 6, 6, 0, 0, [("left", 6), ("left", 3)], 6, "options"),
    ("causal", 6, 6, 0, 0, [("right", 6), ("right", 4)], 6, "options"),
    ("causal", 1, 6, 5, 0, [("left", 6), ("left", 2)], 6, "options"),
    ("causal", 2, 10, 4, 0, [("left", 6), ("left", 4)], 6, "options"),
    ("causal", 2, 10, 4, 0, None, 0, "options"),
    ("sliding3", 6, 6, 0, 0, [("left", 6), ("left", 4)], 6, "options"),
    ("sliding3", 1, 4, 9, 6, [("left", 10), ("left", 7)], 10, "options"),
    ("sliding3", 2, 4, 8, 6, None, 0, "options"),
    ("bidirectional", 6, 6, 0, 0, [("right", 6), ("right", 2)], 6, "options"),
    ("bidirectional", 6, 6, 0, 0, [("left", 5), ("left", 0)], 6, "options"),
    ("bidirectional", 3, 5, 0, 0, [("right", 5), ("right", 3)], 5, "options"),
    ("bidirectional_window2", 6, 6, 0, 0, [("left", 6), ("left", 4)], 6, "options"),
    ("bidirectional_window2", 6, 6, 0, 0, [("right", 6), ("right", 4)], 6, "options"),
    ("causal", 6, 6, 0, 0, [(None, [1, 0, 1, 1, 1, 1]), ("left", 6)], 6, "mask_mod"),
    ("causal", 1, 6, 5, 0, [("right", 6), ("right", 4)], 6, "mask_mod"),
    ("chunked2", 6, 6, 0, 0, [("left", 6), ("left", 5)], 6, "mask_mod"),
    ("causal_or_prefix", 6, 6, 0, 0, None, 0, "mask_mod"),
    ("packed_causal", 6, 6, 0, 0, None, 0, "segment_ids"),
    ("packed_sliding3", 6, 6, 0, 0, None, 0, "segment_ids"),
]


@pytest.mark.parametrize(
    ("pattern", "L", "S", "q_offset", "kv_offset", "rows", "n", "form"), RESTRICTIONS
)
def test_restrictions_equal_transformers_masks(pattern, L, S, q_offset, kv_offset, rows, n, form):
    """The adapter's mask builder against transformers' own ``sdpa_mask`` on the same
    arguments: the call with its options (keys cut to ``kv_stop``) equals the oracle
    with transformers' dense mask, every row included; transformers' own patterns become
    options, never a mask, and the rest a ``mask_mod``."""
    from transformers.masking_utils import sdpa_mask

    from sdpa_array import scaled_dot_product_attention
    from sdpa_array.integrations._transformers_masks import build_restriction
    from sdpa_array.testing import assert_close_to_oracle

    function = _patterns()[pattern]
    padding = None if rows is None else _padding_mask(rows, n)
    args = dict(
        batch_size=2,
        q_length=L,
        kv_length=S,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=function,
        attention_mask=padding,
    )
    dense = sdpa_mask(**args, allow_is_causal_skip=False)
    restriction = build_restriction(**args)
    assert ("mask_mod" in restriction.options) == (form == "mask_mod")
    assert ("segment_ids" in restriction.options) == (form == "segment_ids")
    assert "mask" not in restriction.options
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n_, 4, dtype=torch.float64, generator=g) for n_ in (L, S, S))
    stop = S if restriction.kv_stop is None else restriction.kv_stop
    out = scaled_dot_product_attention(q, k[:, :, :stop], v[:, :, :stop], **restriction.options)
    assert not bool(dense[..., stop:].any())  # the keys cut off are masked there too
    assert_close_to_oracle(out, q, k[:, :, :stop], v[:, :, :stop], mask=dense[..., :stop])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_decoding_steps_go_through_the_cache_function(family, cache, monkeypatch):
    """Where decoding steps go through ``attention_with_kv_cache`` (on a CUDA device; here
    forced on the CPU, where it runs chunk by chunk), greedy generation of a left-padded
    batch gives the tokens it gives without that route (and, for Llama, eager's on each
    sequence alone), and every step after the prompt (one query over more keys) went
    through it, with each row's start."""
    from sdpa_array.integrations import transformers as adapter

    calls = []
    original = adapter.attention_with_kv_cache

    def spy(*args, **kwargs):
        calls.append((int(args[0].shape[2]), kwargs["cache_leftpad"]))
        return original(*args, **kwargs)

    dtype, _ = SETUPS[family]
    ours, theirs = _pair(MODELS[family], dtype)
    ids, mask, _ = _batch(padded=True)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    logits = {"output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        without = ours.generate(ids, attention_mask=mask, **kwargs, **logits)
        monkeypatch.setattr(adapter, "_decodes_through_cache", lambda query: True)
        monkeypatch.setattr(adapter, "attention_with_kv_cache", spy)
        routed = ours.generate(ids, attention_mask=mask, **kwargs, **logits)
        got = routed.sequences
        assert torch.equal(got, without.sequences)
        for step, (a, b) in enumerate(zip(routed.logits, without.logits, strict=True)):
            _close(a, b, f"logits of step {step}")
        for b in range(ids.shape[0] if family == "llama" else 0):
            alone = ids[b][mask[b].bool()][None]  # Gemma 2's window counts padding slots
            expected = theirs.generate(alone, attention_mask=torch.ones_like(alone), **kwargs)
            assert torch.equal(got[b, ids.shape[1] :], expected[0, alone.shape[1] :])
    layers = 2
    assert len(calls) == 3 * layers  # the three steps after the prompt, every layer
    assert all(n_queries == 1 for n_queries, _ in calls)
    starts = {tuple(s) if s is not None else None for _, s in calls}
    assert (0, 3) in starts  # the second row's three padding tokens
