"""Hugging Face transformers' models through :func:`sdpa_array.scaled_dot_product_attention`.

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface``
(and :func:`~._transformers_masks.build_restriction` to its ``AttentionMaskInterface``)
under a name, so that a model loaded or built with ``attn_implementation=name`` (or switched with
``model.set_attn_implementation(name)``) computes every attention layer with this library.

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from sdpa_array.integrations.transformers import register
>>> name = register()
>>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
...                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
>>> model = LlamaForCausalLM(config).eval()
>>> model.set_attn_implementation(name)
>>> model(torch.tensor([[1, 2, 3]])).logits.shape
torch.Size([1, 3, 64])

What reaches the kernel: each layer type's mask as options, never an ``(L, S)`` array
(:mod:`~sdpa_array.integrations._transformers_masks`): transformers' causal, bidirectional
and sliding-window patterns as ``is_causal``, ``alignment`` and ``window``, left or right
padding as ``key_lengths`` with ``padding_side``, and any other mask as a ``mask_mod``
(transformers' own function); a 4-D mask the caller prepared as the boolean mask of its
finite-above-minimum entries plus the rest as a bias (transformers fills masked entries
with the dtype's minimum, which would make a fully masked row uniform instead of empty).
Fewer key/value heads than query heads go as ``enable_gqa``; ``scaling``, ``softcap``
(Gemma 2) and ``s_aux`` sinks (gpt-oss) as themselves; a T5-style ``position_bias`` as a
bias; dropout (training only) with a seed drawn from torch's generator;
``output_attentions`` as the weights.

Packed sequences (a batch of one row holding several sequences, as transformers'
``DataCollatorWithFlattening`` gives them with ``return_flash_attn_kwargs=True``): where the
call carries FlashAttention's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` offsets, the row is
computed by :func:`sdpa_array.scaled_dot_product_attention_varlen`, each sequence alone
(causal and the layer's ``sliding_window`` per sequence), and transformers' mask, which
says the same for the whole row as an (L, S) array, is not used. Calls with a position
bias, asking for the weights, or with a window on a layer that is not causal take the
mask as above.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import (
    attention_with_kv_cache,
    scaled_dot_product_attention,
    scaled_dot_product_attention_varlen,
)
from ._transformers_masks import LayerRestriction, build_restriction

__all__ = ["DECODE_QUERIES", "DEFAULT_NAME", "attention_forward", "register"]

#: The name :func:`register` uses unless given another.
DEFAULT_NAME = "array_attention"

#: A call of at most this many queries over more keys is a decoding step: on a CUDA device
#: it goes through :func:`sdpa_array.attention_with_kv_cache` (its split-KV Triton kernel).
DECODE_QUERIES = 8


def register(name: str = DEFAULT_NAME) -> str:
    """Register :func:`attention_forward` with transformers under ``name``.

    Parameters
    ----------
    name : str
        The ``attn_implementation`` name models will use; it must not be one of
        transformers' own (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...).

    Returns
    -------
    str
        ``name``, for ``from_pretrained(..., attn_implementation=name)``.

    Raises
    ------
    ValueError
        If ``name`` is empty, not a string, or names one of transformers' own
        implementations.

    Examples
    --------
    A tiny Llama built from a config (nothing is downloaded), computed by this library:

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from sdpa_array.integrations.transformers import register
    >>> name = register()
    >>> name
    'array_attention'
    >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM._from_config(config, attn_implementation=name).eval()
    >>> model.config._attn_implementation
    'array_attention'
    >>> model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 64])
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    builtin = {"sdpa", "eager", "flex_attention", "paged|eager"}
    if not isinstance(name, str) or not name or name in builtin or name.startswith("flash"):
        raise ValueError(
            f"name must be a new attention implementation name, not one of transformers' "
            f"own ({sorted(builtin)}, flash_attention_*); got {name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_restriction)
    return name


def _mask_and_bias(
    attention_mask: torch.Tensor | None, position_bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Transformers' mask (boolean, or additive with the dtype's minimum where masked) and
    T5-style position bias as this library's boolean ``mask`` and float ``bias``."""
    mask, bias = None, position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            lowest = torch.finfo(attention_mask.dtype).min
            mask = attention_mask > lowest / 2
            extra = torch.where(mask, attention_mask, torch.zeros((), dtype=attention_mask.dtype))
            if bool(torch.any(extra != 0)):
                bias = extra if bias is None else bias + extra
    if bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    return mask, bias


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One attention layer of a transformers model, computed by this library.

    The signature of transformers' attention functions (``AttentionInterface``).

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer (read for ``is_causal`` and ``training``).
    query : torch.Tensor, shape (B, Hq, L, E)
        The layer's queries, heads first (as transformers hands them over).
    key : torch.Tensor, shape (B, Hkv, S, E)
        Its keys (the cache's, in generation), ``Hq`` a multiple of ``Hkv``.
    value : torch.Tensor, shape (B, Hkv, S, Ev)
        Its values.
    attention_mask : LayerRestriction, torch.Tensor or None
        What the registered mask builder made (the mask as options), or a prepared mask,
        boolean (True = attend) or additive, broadcastable to ``(B, Hq, L, S)``.
    dropout : float
        Dropout probability on the weights (applied when the module is training).
    scaling : float or None
        Score scale (``1 / sqrt(E)`` when None).
    is_causal : bool or None
        Whether the layer is causal (the module's ``is_causal`` when None); used where no
        mask is given and ``L > 1``, as transformers' ``sdpa`` does.
    position_bias : torch.Tensor or None
        Additive bias broadcastable to ``(B, Hq, L, S)`` (T5).
    **kwargs
        ``softcap`` (float), ``s_aux`` (sinks, shape ``(Hq,)``), ``output_attentions``
        (bool), ``sliding_window`` (int: the query and the ``sliding_window - 1`` keys
        before it, used with packed sequences), ``cu_seq_lens_q`` / ``cu_seq_lens_k``
        (packed sequences' offsets, with a batch of one); others are ignored, as
        transformers' own functions ignore them.

    Returns
    -------
    out : torch.Tensor, shape (B, L, Hq, E)
        Contiguous, as transformers' layers expect.
    weights : torch.Tensor or None
        The attention weights ``(B, Hq, L, S)`` when ``output_attentions`` is true.

    Raises
    ------
    ValueError
        If ``query``, ``key`` or ``value`` is not a 4-D tensor; the library's own errors
        for shapes, masks, sinks or offsets that do not fit, naming the argument.

    Examples
    --------
    Called as a causal layer with 4 query heads and 2 key/value heads would call it; the
    output comes back sequence first:

    >>> import torch
    >>> from sdpa_array.integrations.transformers import attention_forward
    >>> layer = torch.nn.Module()
    >>> layer.is_causal = True
    >>> q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    >>> out, weights = attention_forward(layer, q, kv, kv, None)
    >>> out.shape, weights
    (torch.Size([1, 3, 4, 8]), None)
    >>> expected = torch.nn.functional.scaled_dot_product_attention(
    ...     q, kv, kv, is_causal=True, enable_gqa=True
    ... )
    >>> torch.allclose(out, expected.transpose(1, 2), atol=1e-6)
    True
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"attention_forward: {name} must be a 4-D tensor (batch, heads, length, "
                f"features), as transformers' layers pass it; got {shape}"
            )
    L = int(query.shape[2])
    causal_layer = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    options: dict[str, Any] = {"scale": scaling}
    if isinstance(attention_mask, LayerRestriction):  # from our mask builder
        stop = attention_mask.kv_stop
        if stop is not None:  # the keys past the last query's position (and their bias)
            key, value = key[:, :, :stop], value[:, :, :stop]
            if position_bias is not None and int(position_bias.shape[-1]) > stop:
                position_bias = position_bias[..., :stop]
        options.update(attention_mask.options)
        options["bias"] = _mask_and_bias(None, position_bias, query.dtype)[1]
    else:  # a mask transformers did not build with us (given 4-D, or None)
        options["mask"], options["bias"] = _mask_and_bias(
            attention_mask, position_bias, query.dtype
        )
        options["is_causal"] = bool(causal_layer and attention_mask is None and L > 1)
    bias = options["bias"]
    options["enable_gqa"] = int(query.shape[1]) != int(key.shape[1])
    if kwargs.get("softcap") is not None:
        options["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        options["sinks"] = kwargs["s_aux"]
    if dropout and getattr(module, "training", False):
        options["dropout_p"] = float(dropout)
        options["dropout_seed"] = int(torch.randint(0, 2**31 - 1, (), device="cpu"))
    packed = _packed(query, key, kwargs)
    plain = bias is None and not kwargs.get("output_attentions", False)
    if packed is not None and plain and (kwargs.get("sliding_window") is None or causal_layer):
        return _varlen_forward(query, key, value, packed, options, bool(causal_layer), kwargs)
    if isinstance(attention_mask, LayerRestriction) and plain:
        out = _cache_decode(query, key, value, attention_mask, options)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    weights = None
    if kwargs.get("output_attentions", False):
        out, weights = scaled_dot_product_attention(
            query, key, value, return_weights=True, **options
        )
    else:
        out = scaled_dot_product_attention(query, key, value, **options)
    return out.transpose(1, 2).contiguous(), weights


def _decodes_through_cache(query: torch.Tensor) -> bool:
    """Whether decoding steps go through the cache function: on a CUDA device, where its
    Triton decoding kernel runs (on the CPU, torch's flash kernel with the key lengths is
    faster than its chunks: ``asv_benchmarks/studies/decode_route.py``)."""
    return bool(query.device.type == "cuda")


def _cache_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    restriction: LayerRestriction,
    options: dict[str, Any],
) -> torch.Tensor | None:
    """A decoding step as :func:`sdpa_array.attention_with_kv_cache` over transformers'
    cache (the keys it holds are the cache, the query's own tokens included), or ``None``
    where that does not apply: not a decoding step, not on a CUDA device, or options the
    cache function does not take (sinks, dropout, a mask function, right padding)."""
    L, S = int(query.shape[2]), int(key.shape[2])
    if not _decodes_through_cache(query) or not 0 < L <= DECODE_QUERIES or L >= S:
        return None
    taken = {"scale", "is_causal", "alignment", "window", "key_lengths", "padding_side"}
    taken |= {"enable_gqa", "softcap"}
    if any(v is not None for n, v in options.items() if n not in taken):
        return None  # a bias, sinks, dropout, a mask function, segment ids
    if options.get("alignment") != "bottom_right" or options.get("padding_side") == "right":
        return None
    B = int(query.shape[0])
    lengths = restriction.key_lengths
    starts = None if lengths is None else [S - n for n in lengths]
    keep = ("scale", "is_causal", "window", "enable_gqa", "softcap")
    out: torch.Tensor = attention_with_kv_cache(
        query,
        key,
        value,
        cache_lengths=[S] * B,
        cache_leftpad=starts,
        **{n: options[n] for n in keep if options.get(n) is not None},
    )[0]
    return out


def _packed(
    query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The offsets of packed sequences, where the call carries them for its one row."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None or int(query.shape[0]) != 1:
        return None
    cu_k = kwargs.get("cu_seq_lens_k")
    return cu_q, cu_q if cu_k is None else cu_k


def _varlen_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets: tuple[torch.Tensor, torch.Tensor],
    options: dict[str, Any],
    causal: bool,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """The packed row's sequences, each attending within itself (causal where the layer
    is): ``(1, L, Hq, E)``."""
    # the offsets say what the mask, the lengths and the segment ids would
    restriction = {"mask", "bias", "is_causal", "alignment", "window", "mask_mod"}
    restriction |= {"segment_ids", "key_lengths", "padding_side"}
    packed = {n: v for n, v in options.items() if n not in restriction}
    window = kwargs.get("sliding_window")
    if window is not None:  # transformers' window counts the query itself
        packed["window"] = (int(window) - 1, 0)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (total, heads, E)
    out = scaled_dot_product_attention_varlen(
        q, k, v, offsets[0], offsets[1], is_causal=bool(causal), **packed
    )
    return out[None].contiguous(), None
