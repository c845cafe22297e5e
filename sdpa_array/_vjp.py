"""The public vector-Jacobian product: validate, choose an implementation, finish the gradients.

The implementations (:mod:`sdpa_array._vjp_materialized`, :mod:`sdpa_array._vjp_blocked`)
return gradients in the compute dtype and in the layout of their products; this module sums
each one back to the shape of its own input (broadcast batch axes, GQA groups, broadcast
bias axes) and casts it to that input's dtype. :mod:`sdpa_array._autograd` calls
:func:`attention_vjp` with the forward pass's saved output and log-sum-exp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

from ._compat import array_namespace
from ._problem import Problem, validate
from ._scores import ungroup
from ._vjp_blocked import blocked_vjp
from ._vjp_materialized import materialized_vjp
from ._vjp_tiles import RawGrads, sum_to_shape

__all__ = ["VJP_IMPLEMENTATIONS", "attention_vjp", "scaled_dot_product_attention_vjp"]

VJPImplementation = Callable[..., RawGrads]

#: Backward implementations by name; each takes ``(problem, query, key, value, mask, bias,
#: grad_output, out=..., lse=..., grad_lse=...)`` and returns :class:`RawGrads`.
VJP_IMPLEMENTATIONS: dict[str, VJPImplementation] = {
    "materialized": materialized_vjp,
    "blocked": blocked_vjp,
}

VJPImplementationName = Literal["auto", "materialized", "blocked"]


def choose_vjp(
    p: Problem, implementation: str, blocks: tuple[int | None, int | None] = (None, None)
) -> VJPImplementation:
    """The backward implementation for ``implementation`` (same rules as the forward's).

    ``"auto"`` picks the blocked path when block sizes are given or when the score matrix
    would exceed :data:`sdpa_array._api.AUTO_BLOCKED_BYTES`, the materialized one otherwise.

    Raises
    ------
    ValueError
        An unknown ``implementation``, or block sizes that are not positive ints or are
        given to the materialized implementation.
    """
    from ._api import AUTO_BLOCKED_BYTES, _score_bytes
    from ._blocked import choose_block_sizes

    choices = ("auto", *VJP_IMPLEMENTATIONS)
    if implementation not in choices:
        raise ValueError(f"implementation must be one of {choices}, got {implementation!r}")
    sized = any(b is not None for b in blocks)
    if sized:
        if implementation not in ("auto", "blocked"):
            raise ValueError(
                f"block_q/block_k apply to the blocked implementation, not {implementation!r}"
            )
        choose_block_sizes(p, *blocks)  # raises for sizes that are not positive ints
    if implementation == "auto":
        implementation = (
            "blocked" if sized or _score_bytes(p) > AUTO_BLOCKED_BYTES else "materialized"
        )
    if implementation == "blocked":
        return functools.partial(blocked_vjp, block_q=blocks[0], block_k=blocks[1])
    return VJP_IMPLEMENTATIONS[implementation]


def _check_grad_output(p: Problem, query: Any, grad_output: Any) -> None:
    try:
        array_namespace({"query": query, "grad_output": grad_output})
    except TypeError:
        kind = f"{type(grad_output).__module__}.{type(grad_output).__qualname__}"
        raise TypeError(
            "grad_output must be an array of the inputs' library "
            f"({type(query).__module__}.{type(query).__qualname__}), got {kind}"
        ) from None
    if grad_output.dtype != query.dtype:
        raise TypeError(
            f"grad_output must have the output's dtype {query.dtype}, got {grad_output.dtype}"
        )
    if tuple(grad_output.shape) != p.out_shape:
        raise ValueError(
            f"grad_output has shape {tuple(grad_output.shape)}; it must have the output's "
            f"shape (..., Hq, L, Ev) = {p.out_shape}"
        )


def attention_vjp(
    p: Problem,
    run: VJPImplementation,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    grad_output: Any,
    *,
    out: Any | None = None,
    lse: Any | None = None,
    grad_lse: Any | None = None,
) -> tuple[Any, ...]:
    """Run a backward implementation and finish its gradients (no validation).

    Parameters
    ----------
    p : Problem
        The validated call.
    run : callable
        An entry of :data:`VJP_IMPLEMENTATIONS` (or :func:`choose_vjp`'s result).
    query, key, value, mask, bias : array or None
        The caller's arrays.
    grad_output : array
        Cotangent of the output, broadcastable to ``(..., Hq, L, Ev)``; any floating dtype.
    out, lse : array, optional
        The forward pass's output and log-sum-exp, when saved (both or neither).
    grad_lse : array, optional
        Cotangent of the log-sum-exp ``(..., Hq, L)``.

    Returns
    -------
    tuple of array
        ``(grad_query, grad_key, grad_value)`` and ``grad_bias`` if ``bias`` is given, each
        with its input's shape, dtype and device.
    """
    xp = p.xp
    inputs = [query, key, value] + ([bias] if bias is not None else [])
    if p.L == 0 or p.S == 0:  # nothing reaches the output: every gradient is zero
        return tuple(xp.zeros(x.shape, dtype=x.dtype, device=p.device) for x in inputs)
    raw = run(p, query, key, value, mask, bias, grad_output, out=out, lse=lse, grad_lse=grad_lse)
    grads = [ungroup(p, raw.dq), raw.dk, raw.dv]
    if bias is not None:
        grads.append(ungroup(p, raw.dbias))
    return tuple(
        xp.astype(sum_to_shape(p, g, tuple(x.shape)), x.dtype, copy=False)
        for g, x in zip(grads, inputs, strict=True)
    )


def scaled_dot_product_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    grad_output: Any,
    /,
    *,
    mask: Any | None = None,
    bias: Any | None = None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: Literal["top_left", "bottom_right"] = "top_left",
    scale: float | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    implementation: VJPImplementationName | str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Any, ...]:
    r"""Gradients of :func:`scaled_dot_product_attention` for an output cotangent.

    Returns ``(dL/dQ, dL/dK, dL/dV[, dL/dBias])`` for ``L = sum(out * grad_output)``: the
    vector-Jacobian product, on any Array-API library, including those without autograd
    (NumPy, CuPy, array-api-strict, Dask).

    Parameters
    ----------
    query, key, value : array
        As for :func:`scaled_dot_product_attention`.
    grad_output : array, shape (..., Hq, L, Ev)
        Cotangent of the output: exactly the output's shape, same library and dtype.
    mask, bias, is_causal, window, alignment, scale, softcap, enable_gqa
        As for :func:`scaled_dot_product_attention`; ``mask`` has no gradient.
    implementation : {"auto", "materialized", "blocked"}, default "auto"
        ``"materialized"`` forms the full score matrix once; ``"blocked"`` works tile by
        tile in ``O(block_q * block_k)`` memory per batch element, skipping the tiles that
        causal or window restrictions exclude. ``"auto"`` chooses as the forward does:
        blocked when block sizes are given or the score matrix would be large.
    block_q, block_k : int, optional
        Block sizes of the blocked implementation (chosen from the shapes by default).

    Returns
    -------
    grad_query : array
        Same shape, dtype, library and device as ``query``.
    grad_key, grad_value : array
        Same as ``key`` and ``value``; with ``enable_gqa`` summed over each group of query
        heads, and with broadcast batch axes summed back to the input's own shape.
    grad_bias : array
        Only if ``bias`` is given: same shape and dtype as ``bias``, summed over the axes
        along which it was broadcast.

    Raises
    ------
    TypeError
        As for the forward; also a ``grad_output`` that is not an array of the same
        library, or whose dtype is not the output's.
    ValueError
        As for the forward; also a ``grad_output`` whose shape is not the output's, an
        unknown ``implementation``, or block sizes for the materialized implementation.

    Notes
    -----
    With ``Z`` the final scores, ``P = softmax(Z)`` and the softmax Jacobian
    ``dp_j/dz_k = p_j (delta_jk - p_k)``:

    .. math::

        dV = P^T dO, \quad dP = dO\, V^T, \quad D_i = \sum_j P_{ij} dP_{ij}
        = (dO \odot O)_i \mathbf{1}, \quad dZ = P \odot (dP - D),

    ``dBias = dZ``, and with ``dS = dZ`` (times ``1 - tanh²`` under a soft-cap),
    ``dQ = scale · dS K`` and ``dK = scale · dSᵀ Q``. Everything runs in at least float32
    and is returned in the inputs' dtypes. Rows with no admissible key, and keys no query
    may attend, get gradients of exactly zero.

    The blocked implementation computes ``P`` tile by tile: from the tile's own softmax when
    a tile holds whole rows, otherwise as ``exp(Z - lse)`` from the blocked forward pass's
    log-sum-exp (FlashAttention-2). :mod:`sdpa_array.reference` has an independent float64
    version that forms the Jacobian explicitly.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention_vjp
    >>> q, k = np.ones((1, 2)), np.ones((3, 2))
    >>> v = np.arange(3.0)[:, None]
    >>> dq, dk, dv = scaled_dot_product_attention_vjp(q, k, v, np.ones((1, 1)))
    >>> dv.round(4)
    array([[0.3333],
           [0.3333],
           [0.3333]])
    """
    p = validate(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        window=window,
        alignment=alignment,
        scale=scale,
        softcap=softcap,
        enable_gqa=enable_gqa,
    )
    _check_grad_output(p, query, grad_output)
    run = choose_vjp(p, implementation, (block_q, block_k))
    return attention_vjp(p, run, query, key, value, mask, bias, grad_output)
