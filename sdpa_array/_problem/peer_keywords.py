"""Other libraries' spellings of this library's keywords, named in the error a caller gets.

People come with the keywords of torch (``attn_mask``), FlashAttention (``causal``,
``softmax_scale``, ``window_size``), xFormers (``attn_bias``), JAX (``query_seq_lengths``)
or FlashInfer (``sm_scale``). :func:`unexpected_keywords` words the ``TypeError`` for
unknown keyword names, saying what each known spelling is called here, and
:func:`names_peer_spellings` gives a public function that error in place of Python's bare
"unexpected keyword argument" (at no cost to a call whose keywords are known: it looks only
once the call failed to bind).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

__all__ = ["PEER_SPELLINGS", "names_peer_spellings", "unexpected_keywords"]

#: A peer's keyword -> what this library calls it (and where it differs, how).
PEER_SPELLINGS = {
    # torch.nn.functional.scaled_dot_product_attention, torch.nn.MultiheadAttention
    "attn_mask": (
        "mask= for a boolean mask (True = may attend, as torch's boolean attn_mask) or "
        "bias= for a floating additive mask (as torch's float attn_mask)"
    ),
    "key_padding_mask": (
        "key_lengths= (valid keys per sequence) or mask= (boolean, True = may attend; note "
        "that torch's key_padding_mask marks the padding with True)"
    ),
    "need_weights": "return_weights=",
    # FlashAttention
    "causal": "is_causal=",
    "softmax_scale": "scale=",
    "window_size": "window=(left, right) (None for an unbounded side, where -1 there)",
    "return_attn_probs": "return_weights= (and return_lse=)",
    "alibi_slopes": "bias_mod=sdpa_array.mods.alibi(slopes)",
    "cu_seqlens_q": "sdpa_array.scaled_dot_product_attention_varlen(...) for packed sequences",
    "cu_seqlens_k": "sdpa_array.scaled_dot_product_attention_varlen(...) for packed sequences",
    "dropout": "dropout_p= (with dropout_seed=)",
    "cache_seqlens": "cache_lengths= (attention_with_kv_cache)",
    # xFormers
    "attn_bias": "bias= (an additive floating array) or mask_mod= for a mask function",
    "p": "dropout_p= (with dropout_seed=)",
    # jax.nn.dot_product_attention
    "query_seq_lengths": "query_lengths=",
    "key_value_seq_lengths": "key_lengths=",
    "local_window_size": "window=(left, right)",
    # FlashInfer, Triton tutorials
    "sm_scale": "scale=",
    "logits_soft_cap": "softcap=",
    "logit_cap": "softcap=",
    # FlexAttention
    "block_mask": "mask_mod= (a BlockMask from sdpa_array.create_block_mask is accepted)",
    "return_lse_and_max": "return_lse= and return_max_scores=",
}


def unexpected_keywords(where: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """The message of the ``TypeError`` for keyword names ``unknown`` given to ``where``
    (a function's name), which takes ``known``: each peer spelling with this library's name
    for it, then the keywords there are.

    Examples
    --------
    >>> print(unexpected_keywords("f", ["causal"], ["is_causal", "scale"]))
    f() got an unexpected keyword argument 'causal': here it is is_causal=; f()'s keywords are is_causal, scale
    """  # noqa: E501
    unknown = sorted(unknown)
    words = "an unexpected keyword argument" if len(unknown) == 1 else "unexpected keywords"
    named = [
        f"{name!r}: here it is {PEER_SPELLINGS[name]}" if name in PEER_SPELLINGS else repr(name)
        for name in unknown
    ]
    return f"{where}() got {words} {'; '.join(named)}; {where}()'s keywords are " + ", ".join(
        sorted(known)
    )


P = ParamSpec("P")
R = TypeVar("R")


def names_peer_spellings(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` whose call with keyword names it does not take raises the
    ``TypeError`` of :func:`unexpected_keywords` instead of Python's bare one. Only a
    ``TypeError`` raised while the call had such names is replaced: Python raises it on
    binding, before the function runs. ``function`` takes no ``**kwargs`` (a function that
    does checks its names itself, with :func:`unexpected_keywords`)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise TypeError(f"{function.__name__} takes **kwargs: it names unknown keywords itself")
    names = frozenset(p.name for p in parameters)
    known = frozenset(p.name for p in parameters if p.kind is not p.POSITIONAL_ONLY)

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except TypeError:
            unknown = kwargs.keys() - names
            if not unknown:
                raise
            raise TypeError(unexpected_keywords(function.__name__, unknown, known)) from None

    return call
