"""The multi-head attention layer, written once against the Array API.

:func:`multi_head_attention` projects the inputs to queries, keys and values, splits the heads,
attends with :func:`~sdpa_array.scaled_dot_product_attention` (every option passed through)
and merges the heads through the output projection. :class:`MultiheadAttention` (in
:mod:`.torch_module`) is torch's drop-in module around it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from .._arrays.compat import array_namespace, device
from .._arrays.typing import Array
from .._problem.peer_keywords import unexpected_keywords
from .._problem.scalar_options import check_flag
from .forward import scaled_dot_product_attention

__all__ = ["PARAMETER_NAMES", "multi_head_attention"]

#: The parameters :func:`multi_head_attention` reads: the four projections' weights (torch's
#: ``Linear`` layout, ``(out_features, in_features)``; required) and biases (optional), and
#: the learned key and value rows appended to every sequence (optional, both or neither).
PARAMETER_NAMES = (
    "q_weight",
    "k_weight",
    "v_weight",
    "out_weight",
    "q_bias",
    "k_bias",
    "v_bias",
    "out_bias",
    "bias_k",
    "bias_v",
)
_REQUIRED = ("q_weight", "k_weight", "v_weight", "out_weight")

#: The keywords :func:`multi_head_attention` passes on to the attention function.
_ATTENTION_KEYWORDS = frozenset(
    name
    for name, p in inspect.signature(scaled_dot_product_attention).parameters.items()
    if p.kind is p.KEYWORD_ONLY
)


def _check(
    query: Array, key: Array, value: Array, params: Mapping[str, Array],
    num_heads: int, num_kv_heads: int,
) -> None:  # fmt: skip
    """Every shape and name, before any work."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of parameter names to arrays, got {params!r}")
    unknown = sorted(set(params) - set(PARAMETER_NAMES))
    if unknown:
        raise TypeError(f"params has unknown names {unknown}; known: {', '.join(PARAMETER_NAMES)}")
    for name in _REQUIRED:
        if params.get(name) is None:
            raise ValueError(f"params[{name!r}] is required")
    for name, x in (("query", query), ("key", key), ("value", value), *params.items()):
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "ndim")):
            label = name if name in ("query", "key", "value") else f"params[{name!r}]"
            raise TypeError(f"{label} must be an array, got {type(x).__name__}")
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 2:
            raise ValueError(f"{name} must be (..., length, features), got shape {x.shape}")
    shapes = {n: tuple(params[n].shape) for n in PARAMETER_NAMES if params.get(n) is not None}
    for name, x, heads, what in (
        ("q_weight", query, ("num_heads", num_heads), "query"),
        ("k_weight", key, ("num_kv_heads", num_kv_heads), "key"),
        ("v_weight", value, ("num_kv_heads", num_kv_heads), "value"),
    ):
        shape = shapes[name]
        if len(shape) != 2 or shape[1] != x.shape[-1] or shape[0] % heads[1]:
            raise ValueError(
                f"params[{name!r}] must be (heads * head_dim, {x.shape[-1]}) with a multiple of "
                f"{heads[0]} = {heads[1]} rows to project {what} of shape {tuple(x.shape)}, "
                f"got {shape}"
            )
    if shapes["q_weight"][0] // num_heads != shapes["k_weight"][0] // num_kv_heads:
        raise ValueError(
            f"query and key head dims differ: q_weight {shapes['q_weight']} over {num_heads} "
            f"heads, k_weight {shapes['k_weight']} over {num_kv_heads}"
        )
    merged = shapes["v_weight"][0] // num_kv_heads * num_heads
    if len(shapes["out_weight"]) != 2 or shapes["out_weight"][1] != merged:
        raise ValueError(
            f"params['out_weight'] must be (out_features, {merged}) (value head dim x "
            f"num_heads), got {shapes['out_weight']}"
        )
    for b, w in (("q_bias", "q_weight"), ("k_bias", "k_weight"), ("v_bias", "v_weight"),
                 ("out_bias", "out_weight")):  # fmt: skip
        if b in shapes and shapes[b] != (shapes[w][0],):
            raise ValueError(f"params[{b!r}] must be ({shapes[w][0]},), got {shapes[b]}")
    if ("bias_k" in shapes) != ("bias_v" in shapes):
        raise ValueError("params['bias_k'] and params['bias_v'] go together: give both or neither")
    for b, w in (("bias_k", "k_weight"), ("bias_v", "v_weight")):
        if b in shapes and shapes[b][-1:] != (shapes[w][0],):
            raise ValueError(
                f"params[{b!r}] must end in ({shapes[w][0]},) (one projected row), got {shapes[b]}"
            )
    for name, x in (("key", key), ("value", value)):
        if x.shape[-2] != key.shape[-2]:
            raise ValueError(f"key and value lengths differ: key {key.shape}, {name} {x.shape}")


def _linear(xp: Any, x: Array, weight: Array, bias: Array | None) -> Array:
    y = xp.matmul(x, xp.matrix_transpose(weight))
    return y if bias is None else y + bias


def _split_heads(xp: Any, x: Array, heads: int) -> Array:
    """``(..., L, heads * D)`` to ``(..., heads, L, D)``."""
    *batch, n, width = x.shape
    x = xp.reshape(x, (*batch, n, heads, width // heads))
    k = len(batch)
    return xp.permute_dims(x, (*range(k), k + 1, k, k + 2))


def _zero_row(xp: Any, t: Array) -> Array:
    """A row of zeros for every head of ``t`` (``(..., 1, D)``)."""
    return xp.zeros((*t.shape[:-2], 1, t.shape[-1]), dtype=t.dtype, device=device(t))


def _merge_heads(xp: Any, x: Array) -> Array:
    """``(..., H, L, D)`` to ``(..., L, H * D)``."""
    *batch, heads, n, d = x.shape
    k = len(batch)
    x = xp.permute_dims(x, (*range(k), k + 1, k, k + 2))
    return xp.reshape(x, (*batch, n, heads * d))


def multi_head_attention(
    query: Array,
    key: Array,
    value: Array,
    params: Mapping[str, Array],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    add_zero_attn: bool = False,
    **options: Any,
) -> Array | tuple[Array, ...]:
    r"""Multi-head attention with its projections, in the inputs' library.

    .. math::

        \mathrm{out} = \mathrm{concat}_h\big(\mathrm{attention}(x_q W_q^{(h)}, x_k W_k^{(h)},
        x_v W_v^{(h)})\big) W_o^\top + b_o

    Parameters
    ----------
    query : array, shape (..., L, Eq)
        The inputs the queries are projected from, batch axes first.
    key, value : array, shape (..., S, Ek) and (..., S, Ev)
        The inputs of the keys and values (the same array as ``query`` for self-attention).
    params : mapping of str to array
        ``q_weight`` ``(H * D, Eq)``, ``k_weight`` ``(Hkv * D, Ek)``, ``v_weight``
        ``(Hkv * Dv, Ev)`` and ``out_weight`` ``(Eo, H * Dv)``, in torch's ``Linear`` layout
        (``y = x @ W.T + b``); optional biases ``q_bias``, ``k_bias``, ``v_bias``,
        ``out_bias``; optional ``bias_k`` and ``bias_v`` (one projected key and value row,
        broadcastable to ``(..., 1, Hkv * D)``) appended to every sequence after the
        projection, as torch's ``add_bias_kv``.
    num_heads : int
        ``H``, the query heads.
    num_kv_heads : int, optional
        ``Hkv``, the key/value heads (grouped-query attention when fewer than ``H``);
        ``num_heads`` by default.
    add_zero_attn : bool, default False
        Append a key and value of zeros to every head after the heads are split, as torch's
        ``add_zero_attn``.
    **options
        Passed to :func:`~sdpa_array.scaled_dot_product_attention` (``mask``, ``bias``,
        ``is_causal``, lengths, ``dropout_p``, ``return_weights``...). Masks and biases
        index the keys as attended: ``S`` plus one for ``bias_k`` plus one for
        ``add_zero_attn``.

    Returns
    -------
    out : array, shape (..., L, Eo)
        In the inputs' library, dtype and device; followed by the weights and the
        log-sum-exp where ``options`` ask for them, as the attention function returns them.

    Raises
    ------
    ValueError, TypeError
        Unknown or missing parameters, shapes that do not fit together, head counts that
        do not divide, before any work; then whatever the attention function raises for
        ``options``.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import multi_head_attention
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 5, 8))  # batch 2, length 5, width 8
    >>> params = {n: rng.standard_normal((8, 8)) / 3 for n in ("q_weight", "k_weight",
    ...           "v_weight", "out_weight")}
    >>> multi_head_attention(x, x, x, params, num_heads=2, is_causal=True).shape
    (2, 5, 8)
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is None:
            raise TypeError(f"{name} must be an array, got None")
    check_flag("add_zero_attn", add_zero_attn)
    unknown = options.keys() - _ATTENTION_KEYWORDS
    if unknown:
        known = _ATTENTION_KEYWORDS | {"num_heads", "num_kv_heads", "add_zero_attn"}
        raise TypeError(unexpected_keywords("multi_head_attention", unknown, known))
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check(query, key, value, params, num_heads, kv_heads)
    given = {f"params[{n!r}]": v for n, v in params.items() if v is not None}
    xp = array_namespace({"query": query, "key": key, "value": value, **given})
    p = {n: params.get(n) for n in PARAMETER_NAMES}
    q = _linear(xp, query, p["q_weight"], p["q_bias"])
    k = _linear(xp, key, p["k_weight"], p["k_bias"])
    v = _linear(xp, value, p["v_weight"], p["v_bias"])
    if p["bias_k"] is not None:
        rows = (*k.shape[:-2], 1)
        k = xp.concat([k, xp.broadcast_to(p["bias_k"], (*rows, k.shape[-1]))], axis=-2)
        v = xp.concat([v, xp.broadcast_to(p["bias_v"], (*rows, v.shape[-1]))], axis=-2)
    qh, kh, vh = (_split_heads(xp, t, h) for t, h in ((q, num_heads), (k, kv_heads), (v, kv_heads)))
    if add_zero_attn:
        kh, vh = (xp.concat([t, _zero_row(xp, t)], axis=-2) for t in (kh, vh))
    if kv_heads != num_heads:
        options = {"enable_gqa": True, **options}
    result = scaled_dot_product_attention(qh, kh, vh, **options)
    attended, *rest = result if isinstance(result, tuple) else (result,)
    out = _linear(xp, _merge_heads(xp, attended), p["out_weight"], p["out_bias"])
    return (out, *rest) if rest else out
