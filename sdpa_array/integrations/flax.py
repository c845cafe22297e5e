"""Flax's attention layers through :func:`sdpa_array.scaled_dot_product_attention`.

:func:`attention_fn` has the signature of ``flax.nnx.dot_product_attention`` (and of
linen's), so it is passed where Flax takes an attention function:

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from sdpa_array.integrations.flax import attention_fn
>>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
...                                attention_fn=attention_fn, rngs=nnx.Rngs(0))
>>> layer(jnp.ones((1, 5, 8))).shape
(1, 5, 8)

Flax holds ``(batch..., length, heads, features)``: the library's ``layout="BLHE"``.
Masks attend where true (Flax's mask helpers give 0/1 floats, read as booleans), as in
this library; a query row whose keys are all masked gets a zero output here, where Flax's
own function gives the uniform average of the values. Key/value heads fewer than the
query heads (``num_kv_heads``) run as grouped-query attention without repeating them.
Dropout (``dropout_rate > 0`` and not ``deterministic``) takes its seed from the
``dropout_rng`` Flax passes (a traced array under ``jit``) and draws this library's keep
mask, independently for each batch element and head.
"""

from __future__ import annotations

from typing import Any

from .. import scaled_dot_product_attention

__all__ = ["attention_fn"]


def attention_fn(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Any = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> Any:
    """Attention as Flax calls it, computed by this library.

    Parameters
    ----------
    query : jax.Array, shape (batch..., L, Hq, E)
        Queries, Flax's layout.
    key : jax.Array, shape (batch..., S, Hkv, E)
        Keys; ``Hq`` a multiple of ``Hkv``.
    value : jax.Array, shape (batch..., S, Hkv, Ev)
        Values.
    bias : jax.Array or None
        Added to the scores, broadcastable to ``(batch..., Hq, L, S)``.
    mask : jax.Array or None
        True (or non-zero, as Flax's ``make_attention_mask`` gives it) = attend,
        broadcastable to ``(batch..., Hq, L, S)``.
    broadcast_dropout : bool
        Flax's option to share one dropout mask across the batch axes; not used: the keep
        mask is :func:`sdpa_array.dropout_keep_mask`'s, drawn for each batch element and
        head (dropout with the same rate either way, not Flax's bits).
    dropout_rng : jax.Array or None
        Flax's dropout key: the seed of the keep mask is
        ``jax.random.randint(dropout_rng, (), 0, 2**31 - 1)``, traced under ``jit``.
    dropout_rate : float
        Dropout probability (applied unless ``deterministic``).
    deterministic : bool
        Whether dropout is off.
    dtype : dtype or None
        The computation dtype (the inputs' promoted dtype when None).
    precision : Any
        Flax's matmul precision; not used (the library computes in the inputs' dtype,
        float32 for 16-bit inputs).
    module : Any
        The calling module; not used.
    promote_dtype : callable or None
        Flax's dtype promotion of ``(query, key, value)``; applied when given.
    is_causal : bool
        Causal attention (top-left aligned), without a dense mask.
    **kwargs
        Other options of Flax's functions (``force_fp32_for_softmax`` and the einsum
        hooks of linen); ignored.

    Returns
    -------
    jax.Array, shape (batch..., L, Hq, Ev)
        The output, in Flax's layout.

    Raises
    ------
    ValueError
        Dropout (``dropout_rate > 0`` without ``deterministic``) without a ``dropout_rng``.

    Examples
    --------
    Called directly, on Flax's ``(batch, length, heads, features)`` layout, it gives what
    Flax's own function gives:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from sdpa_array.integrations.flax import attention_fn
    >>> q = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    >>> out = attention_fn(q, q, q, is_causal=True)
    >>> out.shape
    (1, 5, 2, 8)
    >>> causal = nnx.make_causal_mask(jnp.ones((1, 5)))
    >>> bool(jnp.allclose(out, nnx.dot_product_attention(q, q, q, mask=causal), atol=1e-6))
    True

    and as the attention function of a layer:

    >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
    ...                                attention_fn=attention_fn, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 5, 8))).shape
    (1, 5, 8)
    """
    dropout: dict[str, Any] = {}
    if dropout_rate > 0.0 and not deterministic:
        if dropout_rng is None:
            raise ValueError(
                f"dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng "
                "(the keep mask's seed is drawn from it)"
            )
        import jax

        seed = jax.random.randint(dropout_rng, (), 0, 2**31 - 1)
        dropout = {"dropout_p": float(dropout_rate), "dropout_seed": seed}
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    elif dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    if mask is not None and mask.dtype != bool:  # Flax's mask helpers give 0/1 floats
        mask = mask != 0
    return scaled_dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=bool(is_causal),
        enable_gqa=int(query.shape[-2]) != int(key.shape[-2]),
        layout="BLHE",
        **dropout,
    )
