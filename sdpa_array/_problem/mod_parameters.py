"""Trainable data of bias and score functions: their parameters and cotangents, tile by tile.

A ``bias_mod`` may hold trainable arrays (ALiBi's slopes, T5's relative position table), and
so may a ``score_mod`` (a temperature per head). A function says so with two members, which
the ready-made ones of :mod:`sdpa_array.mods` have and a user's function may have too:

* ``parameters``: a tuple of its trainable arrays;
* ``parameter_cotangents``: for a ``cotangent`` of the function's values on the grid of the
  index arrays (their broadcast shape), the tuple of
  ``sum(cotangent * d value / d parameter)`` over the grid, each of its parameter's shape,
  in the cotangent's dtype and library. A bias function's takes
  ``(cotangent, batch, head, q_idx, kv_idx)``; a score function's takes the scores it was
  applied to as well, ``(cotangent, score, batch, head, q_idx, kv_idx)``.

The trainable functions of a call are its ``score_mod`` and its ``bias_mod``, in that order
(:func:`trainable_mods`): their parameters, and the gradients returned for them, follow
that order.

A third member, ``with_parameters(*arrays)`` (the same function holding other arrays),
is what ``jax.grad`` through the blocked kernel (whose ``jax.custom_vjp`` rebuilds the
function with its traced parameters) and the oracle (which forms the Jacobian from it)
need; without it JAX differentiates the materialized path instead. A function of the
caller's that declares nothing but captures floating arrays that torch's or JAX's autodiff
follows is given these members for them by :mod:`sdpa_array._plan.autograd`
(``parameter_cotangents`` through the library's autodiff of the function on the tile).

The backward kernels call the second tile by tile and add the parts: a bias function's
with the tile's score gradient ``dZ`` (the bias is added to the scores, so ``dZ`` is its
cotangent), a score function's with the gradient of its values (``dZ`` times the
soft-cap's derivative) and the scaled scores it was given.
:func:`sum_by_index` and :func:`sum_by_head_and_bucket` are the sums the ready-made mods
need, written with the Array API only (one-hot matrix products: the standard has no
scatter-add).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._arrays.compat import device, in_library, namespace_name

__all__ = [
    "BUCKET_CHUNK",
    "check_mod_gradients",
    "declared_parameters",
    "diagonal_sums",
    "has_parameters",
    "sum_by_head_and_bucket",
    "sum_by_index",
    "sum_where_constant",
    "trainable_mods",
]

#: Elements of one one-hot block of :func:`sum_by_head_and_bucket` (tile cells times
#: buckets), so that a large tile (the materialized kernel's whole grid) is done in rows.
BUCKET_CHUNK = 2**22


def has_parameters(mod: Any) -> bool:
    """Whether ``mod`` declares trainable data (the two members above)."""
    return hasattr(mod, "parameters") and callable(getattr(mod, "parameter_cotangents", None))


def trainable_mods(score_mod: Any, bias_mod: Any) -> tuple[tuple[str, Any], ...]:
    """``(name, function)`` of each of ``score_mod`` and ``bias_mod`` (in that order) that
    declares trainable data (:func:`has_parameters`)."""
    pairs = (("score_mod", score_mod), ("bias_mod", bias_mod))
    return tuple((name, mod) for name, mod in pairs if mod is not None and has_parameters(mod))


def declared_parameters(score_mod: Any, bias_mod: Any) -> tuple[Any, ...]:
    """The parameters of the trainable functions, ``score_mod``'s first."""
    return tuple(a for _, mod in trainable_mods(score_mod, bias_mod) for a in mod.parameters)


def check_mod_gradients(xp: ModuleType, score_mod: Any, bias_mod: Any) -> tuple[Any, ...]:
    """The parameters of ``score_mod`` and ``bias_mod`` whose gradients are asked for
    (:func:`declared_parameters`); ``TypeError`` before any work where neither has any, one
    has ``parameters`` without ``parameter_cotangents`` (its gradients would be left out),
    or one holds arrays that are not real floating arrays of the inputs' namespace ``xp``
    (their gradients are returned in it)."""
    pairs = (("score_mod", score_mod), ("bias_mod", bias_mod))
    for name, mod in pairs:
        if hasattr(mod, "parameters") and not has_parameters(mod):
            raise TypeError(
                f"return_mod_gradients=True: {name} {mod!r} has 'parameters' but no "
                "'parameter_cotangents' method, so its parameters' gradients cannot be "
                "computed"
            )
    trainable = trainable_mods(score_mod, bias_mod)
    if not trainable:
        given = [f"{n} {m!r}" for n, m in pairs if m is not None]
        what = " and ".join(given) or "no score_mod or bias_mod"
        raise TypeError(
            "return_mod_gradients=True needs a score_mod or bias_mod with trainable "
            "parameters (a 'parameters' tuple and 'parameter_cotangents', as "
            "sdpa_array.mods.alibi, relative_position_bias and temperature have); got "
            f"{what}"
        )
    for name, mod in trainable:
        for i, a in enumerate(tuple(mod.parameters)):
            if not in_library(xp, a) or not xp.isdtype(a.dtype, "real floating"):
                raise TypeError(
                    f"return_mod_gradients=True: {name}'s parameter {i} must be a real "
                    f"floating array of the inputs' library ({namespace_name(xp)}), got "
                    f"{type(a).__module__}.{type(a).__qualname__}"
                )
    return declared_parameters(score_mod, bias_mod)


def _padded(index: Any, ndim: int, xp: ModuleType) -> Any:
    return xp.reshape(index, (1,) * (ndim - index.ndim) + tuple(index.shape))


def sum_where_constant(xp: ModuleType, values: Any, index: Any, tail: int = 0) -> Any:
    """``(summed, index)``: ``values`` summed (keeping the axes) along the axes, but the
    last ``tail``, where ``index`` (which broadcasts to it) is constant, and ``index``
    padded to as many axes."""
    index = _padded(index, values.ndim, xp)
    axes = tuple(
        a for a in range(values.ndim - tail) if index.shape[a] == 1 and values.shape[a] != 1
    )
    return (xp.sum(values, axis=axes, keepdims=True) if axes else values), index


def sum_by_index(xp: ModuleType, values: Any, index: Any, n: int) -> Any:
    """``out[k] = sum(values where index == k)``, shape ``(n,)``.

    ``index`` holds integers in ``[0, n)`` and broadcasts to ``values``' shape. The axes
    along which ``index`` is constant (size 1) are summed first; what remains has one
    entry per index entry, and a product with a one-hot matrix adds them up by value.
    """
    reduced, index = sum_where_constant(xp, values, index)
    flat = xp.reshape(reduced, (1, -1))
    keys = xp.reshape(xp.broadcast_to(index, tuple(reduced.shape)), (-1, 1))
    onehot = xp.astype(keys == xp.arange(n, device=device(keys))[None, :], values.dtype)
    return xp.reshape(xp.matmul(flat, onehot), (n,))


def sum_by_head_and_bucket(
    xp: ModuleType, values: Any, head: Any, bucket: Any, heads: int, buckets: int
) -> Any:
    """``out[h, n] = sum(values where head == h and bucket == n)``, shape
    ``(heads, buckets)``.

    ``head`` varies only along axes where ``bucket`` has size 1 and the reverse (the
    kernels' layout: heads on the batch axes, buckets on the tile's two axes); the last
    two axes of ``values`` are the tile's. The tile's cells are added by bucket with a
    one-hot product, in blocks of rows of at most :data:`BUCKET_CHUNK` one-hot entries,
    then the rows by head (:func:`sum_by_index`).
    """
    ndim = values.ndim
    head, bucket = _padded(head, ndim, xp), _padded(bucket, ndim, xp)
    if any(n != 1 for n in head.shape[-2:]) or any(n != 1 for n in bucket.shape[:-2]):
        raise ValueError(
            "sum_by_head_and_bucket: the heads must vary along the batch axes and the "
            f"buckets along the tile's, got shapes {tuple(head.shape)} and "
            f"{tuple(bucket.shape)}"
        )
    reduced, _ = sum_where_constant(xp, values, head, tail=2)
    rows, cols = int(reduced.shape[-2]), int(reduced.shape[-1])
    lead = tuple(int(n) for n in reduced.shape[:-2])
    cells = xp.reshape(reduced, (-1, rows, cols))  # (head entries, rows, cols)
    corner = (0,) * (ndim - 2) + (Ellipsis,)  # the tile's axes of the bucket array
    bucket = xp.broadcast_to(bucket[corner], (rows, cols))
    step = max(1, BUCKET_CHUNK // max(1, cols * buckets))
    arange = xp.arange(buckets, device=device(bucket))
    by_bucket = None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        keys = xp.reshape(bucket[r0:r1, :], (-1, 1))
        onehot = xp.astype(keys == arange[None, :], values.dtype)
        part = xp.matmul(xp.reshape(cells[:, r0:r1, :], (cells.shape[0], -1)), onehot)
        by_bucket = part if by_bucket is None else by_bucket + part
    if by_bucket is None:  # no rows
        by_bucket = xp.zeros((cells.shape[0], buckets), dtype=values.dtype, device=device(values))
    head_keys = xp.reshape(xp.broadcast_to(head[..., 0, 0], lead), (-1, 1))
    onehot = xp.astype(head_keys == xp.arange(heads, device=device(head))[None, :], values.dtype)
    return xp.matmul(xp.matrix_transpose(onehot), by_bucket)


def diagonal_sums(xp: ModuleType, x: Any) -> Any:
    """Sums of ``x`` ``(..., r, c)`` along its diagonals: ``out[..., m]`` is the sum of
    ``x[..., i, j]`` over ``j - i = m - (r - 1)``, shape ``(..., r + c - 1)``.

    The rows are reversed and each is padded with ``r`` zeros; read back with rows of
    ``c + r - 1`` entries, row ``i`` is shifted by ``i`` against the next, so that each
    diagonal falls into one column, which a sum over the rows adds up (the entries shifted
    out of a row are padding zeros).
    """
    r, c = int(x.shape[-2]), int(x.shape[-1])
    lead = tuple(int(n) for n in x.shape[:-2])
    pad = xp.zeros((*lead, r, r), dtype=x.dtype, device=device(x))
    rows = xp.concat([xp.flip(x, axis=-2), pad], axis=-1)  # (..., r, c + r)
    flat = xp.reshape(rows, (*lead, r * (c + r)))[..., : r * (c + r - 1)]
    return xp.sum(xp.reshape(flat, (*lead, r, c + r - 1)), axis=-2)
