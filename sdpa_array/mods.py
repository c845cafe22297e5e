"""Ready-made ``mask_mod``, ``bias_mod`` and ``score_mod`` functions (FlexAttention style).

A *mask mod* says which keys each query may attend to, a *bias mod* what is added to the
scores, as functions of the positions instead of arrays of the scores' shape:

- ``mask_mod(batch, head, q_idx, kv_idx)`` returns a boolean array, True where the query may
  attend to the key;
- ``bias_mod(batch, head, q_idx, kv_idx)`` returns a real floating array added to the scores
  (``-inf`` excludes the key);
- ``score_mod(score, batch, head, q_idx, kv_idx)`` returns new scores from the scaled ones,
  element by element (:func:`score_function` attaches the derivative a gradient needs).

The four arguments are integer arrays (the namespace's default integer dtype) of one array
library and device that broadcast together to the shape of the scores being computed, for
example ``batch`` of shape ``(B, 1, 1, 1)``, ``head`` ``(1, H, 1, 1)``, ``q_idx``
``(1, 1, L, 1)`` and ``kv_idx`` ``(1, 1, 1, S)``; other arrangements, with more axes, may
arrive, so a mod relies on broadcasting only. ``batch`` is the index of the batch element,
the leading batch axes (those before the heads axis) flattened in row-major order (0 where
there are none); ``head`` the query head; ``q_idx`` and ``kv_idx`` absolute positions in
the query and key sequences. A mod's result has the broadcast shape of the arguments it
uses (a causal mask ignores ``batch`` and ``head``); the caller broadcasts it. A score
function's result has exactly the shape of the scores it is given (a ``ValueError`` says
otherwise): one new score per score.

A function of yours is always called with index arrays of the inputs' library and device
(:func:`sdpa_array.create_block_mask`, which is given sizes only, calls it with NumPy ones),
so it may use that library's own operations. The ready-made functions below give the same
values on any library's indices, so the kernels classify their blocks on the host with
NumPy ones. Data a mod captures (segment ids, slopes, a table) may come from any
library: it is used as it is where the libraries match (JAX tracers under ``jax.jit``, lazy
Dask arrays), copied to the host where the indices are NumPy arrays (a ``TypeError`` says
so where the data cannot be read there), and moved into the indices' library otherwise.

A bias or score function may hold trained parameters: :func:`alibi`'s slopes,
:func:`relative_position_bias`'s table and :func:`temperature`'s temperatures declare them
(``parameters``, and ``parameter_cotangents``, the sums of ``cotangent * d value / d
parameter`` over the grid: ``(cotangent, batch, head, q_idx, kv_idx)`` for a bias function,
``(cotangent, score, batch, head, q_idx, kv_idx)`` for a score function), so that they get
their gradients through torch autograd and ``jax.grad`` on every path, and from
:func:`sdpa_array.scaled_dot_product_attention_vjp` with ``return_mod_gradients=True``;
``with_parameters(*arrays)`` gives the same function with other parameters (traced ones,
under JAX). The oracle needs a score function's ``parameter_derivatives(score, batch, head,
q_idx, kv_idx)`` too: ``d value / d parameter`` on the grid, one array per parameter.

Examples
--------
>>> import numpy as np
>>> from sdpa_array import mods
>>> b = h = np.zeros((1, 1), dtype=int)
>>> q, kv = np.ogrid[:3, :4]
>>> mods.causal()(b, h, q, kv).astype(int)
array([[1, 0, 0, 0],
       [1, 1, 0, 0],
       [1, 1, 1, 0]])
>>> mods.and_masks(mods.causal(), mods.sliding_window(1, 0))
and_masks(causal(offset=0), sliding_window(left=1, right=0, offset=0))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sdpa_array._problem.mods_data import (
    AlibiMod,
    AndMasks,
    Captured,
    CausalMod,
    DocumentMod,
    OrMasks,
    PrefixLMMod,
    RelativePositionBiasMod,
    SlidingWindowMod,
    check_index,
)
from sdpa_array._problem.score_mods import score_function, tanh_softcap, temperature

__all__ = [
    "alibi",
    "alibi_slopes",
    "and_masks",
    "causal",
    "document",
    "or_masks",
    "prefix_lm",
    "relative_position_bias",
    "score_function",
    "sliding_window",
    "tanh_softcap",
    "temperature",
]

#: What a mod is called with and returns.
Mod = Callable[[Any, Any, Any, Any], Any]


def causal(offset: int = 0) -> Mod:
    """Causal mask mod: query ``i`` attends to the keys ``j <= i + offset``.

    Parameters
    ----------
    offset : int, default 0
        Shift of the diagonal. 0 is torch's and FlexAttention's ``q_idx >= kv_idx``
        (top-left alignment); ``S - L`` aligns the last query with the last key
        (bottom-right alignment, as in decoding with a cache).

    Returns
    -------
    callable
        ``mask_mod(batch, head, q_idx, kv_idx)``, True where ``kv_idx <= q_idx + offset``.

    Examples
    --------
    >>> import numpy as np
    >>> b = h = np.zeros((1, 1), dtype=int)
    >>> q, kv = np.ogrid[:2, :4]
    >>> causal(offset=2)(b, h, q, kv).astype(int)
    array([[1, 1, 1, 0],
           [1, 1, 1, 1]])
    >>> causal(offset=2)
    causal(offset=2)
    """
    return CausalMod(check_index("offset", offset))


def sliding_window(left: int | None, right: int | None, *, offset: int = 0) -> Mod:
    """Sliding-window (local) mask mod: keys within ``left`` before and ``right`` after.

    Parameters
    ----------
    left, right : int or None
        How many keys before and after the (shifted) diagonal are kept, non-negative;
        ``None`` leaves that side unbounded. ``sliding_window(w, 0)`` is causal attention
        over the last ``w + 1`` keys.
    offset : int, default 0
        Shift of the diagonal, as in :func:`causal`.

    Returns
    -------
    callable
        ``mask_mod(batch, head, q_idx, kv_idx)``, True where
        ``q_idx + offset - left <= kv_idx <= q_idx + offset + right``.

    Raises
    ------
    TypeError
        If ``left`` or ``right`` is neither an integer nor None, or ``offset`` no integer.
    ValueError
        If ``left`` or ``right`` is negative.

    Examples
    --------
    >>> import numpy as np
    >>> b = h = np.zeros((1, 1), dtype=int)
    >>> q, kv = np.ogrid[:4, :4]
    >>> sliding_window(1, 0)(b, h, q, kv).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    left = None if left is None else check_index("left", left, minimum=0)
    right = None if right is None else check_index("right", right, minimum=0)
    return SlidingWindowMod(left, right, check_index("offset", offset))


def prefix_lm(prefix_lengths: int | Sequence[int] | Any) -> Mod:
    """Prefix-LM mask mod: bidirectional attention within a prefix, causal after it.

    Parameters
    ----------
    prefix_lengths : int or 1-D array of int
        Length of the prefix, the same for every batch element (an int), or one per batch
        element (an array or sequence of the flattened batch's length, of any library).

    Returns
    -------
    callable
        ``mask_mod(batch, head, q_idx, kv_idx)``, True where
        ``kv_idx < prefix_lengths[batch]`` or ``kv_idx <= q_idx``.

    Examples
    --------
    >>> import numpy as np
    >>> b = h = np.zeros((1, 1), dtype=int)
    >>> q, kv = np.ogrid[:4, :4]
    >>> prefix_lm(2)(b, h, q, kv).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    if isinstance(prefix_lengths, (int, np.integer)) and not isinstance(prefix_lengths, bool):
        return PrefixLMMod(check_index("prefix_lengths", prefix_lengths, minimum=0))
    if isinstance(prefix_lengths, bool):
        check_index("prefix_lengths", prefix_lengths)
    data = Captured("prefix_lm", "prefix_lengths", prefix_lengths, kind="integral", ndims=(1,))
    return PrefixLMMod(data)


def document(query_segments: Any, key_segments: Any) -> Mod:
    """Document (packed sequences) mask mod: queries attend to keys of their own segment.

    Parameters
    ----------
    query_segments, key_segments : array of int
        Segment id of each query and key position: shape ``(L,)`` and ``(S,)`` shared by
        every batch element, or ``(B, L)`` and ``(B, S)`` with ``B`` the flattened batch
        count; any library, or sequences.

    Returns
    -------
    callable
        ``mask_mod(batch, head, q_idx, kv_idx)``, True where
        ``query_segments[batch, q_idx] == key_segments[batch, kv_idx]``.

    Raises
    ------
    ValueError
        If a segments array is neither 1-D nor 2-D, or two 2-D arrays disagree on ``B``.
    TypeError
        If a segments array has no integer dtype.

    Examples
    --------
    >>> import numpy as np
    >>> b = h = np.zeros((1, 1), dtype=int)
    >>> q, kv = np.ogrid[:4, :4]
    >>> segments = [0, 0, 1, 1]
    >>> document(segments, segments)(b, h, q, kv).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [0, 0, 1, 1],
           [0, 0, 1, 1]])
    """
    query = Captured("document", "query_segments", query_segments, kind="integral", ndims=(1, 2))
    key = Captured("document", "key_segments", key_segments, kind="integral", ndims=(1, 2))
    if len(query.shape) == len(key.shape) == 2 and query.shape[0] != key.shape[0]:
        raise ValueError(
            "document: query_segments and key_segments must have the same number of batch "
            f"rows, got shapes {query.shape} and {key.shape}"
        )
    return DocumentMod(query, key)


def alibi(slopes: Any) -> Mod:
    """ALiBi bias mod: ``-slopes[head] * |q_idx - kv_idx|``.

    The symmetric form of the ALiBi paper (Press et al., *Train Short, Test Long*), as in
    FlexAttention's examples; combine it with :func:`causal` for the paper's causal model.

    Parameters
    ----------
    slopes : 1-D real floating array or sequence of numbers
        One slope per query head, of any library (:func:`alibi_slopes` gives the paper's).

    Returns
    -------
    callable
        ``bias_mod(batch, head, q_idx, kv_idx)`` in the slopes' dtype (a sequence becomes
        float64; where the indices' library lacks float64, its default floating dtype).
        The slopes are its trainable ``parameters`` (see the module docstring).

    Examples
    --------
    >>> import numpy as np
    >>> b = np.zeros((1, 1, 1), dtype=int)
    >>> h = np.arange(2)[:, None, None]
    >>> q, kv = np.ogrid[:2, :3]
    >>> alibi([0.5, 0.25])(b, h, q, kv)
    array([[[ 0.  , -0.5 , -1.  ],
            [-0.5 ,  0.  , -0.5 ]],
    <BLANKLINE>
           [[ 0.  , -0.25, -0.5 ],
            [-0.25,  0.  , -0.25]]])
    """
    return AlibiMod(Captured("alibi", "slopes", slopes, kind="real floating", ndims=(1,)))


def alibi_slopes(heads: int) -> np.ndarray:
    """The ALiBi paper's head slopes, a geometric sequence.

    For ``heads`` a power of two ``n``, the slopes are ``start ** (i + 1)`` for
    ``i = 0, ..., n - 1`` with ``start = 2 ** (-8 / n)``. Otherwise, with ``m`` the largest
    power of two at most ``heads``, they are the ``m`` slopes of ``m`` heads followed by
    every other slope of ``2 m`` heads (``[0::2]``), the first ``heads - m`` of them, as in
    the paper's reference implementation.

    Parameters
    ----------
    heads : int
        Number of heads, positive.

    Returns
    -------
    numpy.ndarray
        float64 array of shape ``(heads,)``.

    Examples
    --------
    >>> alibi_slopes(8) * 2**8
    array([128.,  64.,  32.,  16.,   8.,   4.,   2.,   1.])
    >>> alibi_slopes(3) * 2**8
    array([16.,  1., 64.])
    """
    heads = check_index("heads", heads, minimum=1, maximum=2**20)

    def power_of_two(n: int) -> list[float]:
        # start ** (i + 1) with start = 2 ** (-8 / n), one rounding each: exact where a
        # power of two (the repeated products of the reference drift by a few ulps)
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    m = 1 << (heads.bit_length() - 1)
    slopes = power_of_two(m) + power_of_two(2 * m)[0::2][: heads - m]
    return np.asarray(slopes, dtype=np.float64)


def relative_position_bias(
    table: Any, *, num_buckets: int, max_distance: int, bidirectional: bool = True
) -> Mod:
    """T5's bucketed relative position bias mod: ``table[head, bucket(kv_idx - q_idx)]``.

    The relative position ``kv_idx - q_idx`` (T5's ``memory_position - query_position``)
    goes to a bucket as in T5's ``_relative_position_bucket``: where ``bidirectional``,
    half of the buckets take the positive relative positions (offset by
    ``num_buckets // 2``) and the distance is ``|kv_idx - q_idx|``; otherwise the distance
    is ``max(q_idx - kv_idx, 0)`` (later keys share bucket 0). With ``n`` the buckets of one
    direction and ``max_exact = n // 2``, distances below ``max_exact`` have their own
    bucket, larger ones a logarithmic bucket ``max_exact + int(log(d / max_exact) /
    log(max_distance / max_exact) * (n - max_exact))``, clipped to ``n - 1``. The buckets
    are those of that formula in float64 in every library and dtype (T5's float32 logarithm
    may put a distance lying exactly on a bucket boundary one bucket lower).

    Parameters
    ----------
    table : 2-D real floating array
        Shape ``(heads, num_buckets)``, the learned bias of each query head and bucket, of
        any library.
    num_buckets : int
        Number of buckets: at least 4 where ``bidirectional``, 2 otherwise.
    max_distance : int
        Distance from which the last bucket is used; larger than ``max_exact``.
    bidirectional : bool, default True
        Whether keys after the query have buckets of their own (T5's encoder) or not (its
        decoder).

    Returns
    -------
    callable
        ``bias_mod(batch, head, q_idx, kv_idx)`` in the table's dtype. The table is its
        trainable ``parameters`` (see the module docstring).

    Raises
    ------
    ValueError
        If the table is not 2-D with ``num_buckets`` columns, or ``num_buckets`` or
        ``max_distance`` is too small.
    TypeError
        If the table is not real floating, or the others are not integers and a bool.

    Examples
    --------
    >>> import numpy as np
    >>> table = np.arange(8.0)[None, :]
    >>> b = h = np.zeros((1, 1), dtype=int)
    >>> q, kv = np.ogrid[:1, :8]
    >>> relative_position_bias(table, num_buckets=8, max_distance=4)(b, h, q, kv)
    array([[0., 5., 6., 7., 7., 7., 7., 7.]])
    """
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be a bool, got {type(bidirectional).__name__}")
    num_buckets = check_index("num_buckets", num_buckets, minimum=4 if bidirectional else 2)
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    max_distance = check_index("max_distance", max_distance, minimum=max_exact + 1)
    data = Captured("relative_position_bias", "table", table, kind="real floating", ndims=(2,))
    if data.shape[1] != num_buckets:
        raise ValueError(
            f"relative_position_bias: table must have num_buckets={num_buckets} columns "
            f"(shape (heads, num_buckets)), got shape {data.shape}"
        )
    return RelativePositionBiasMod(data, num_buckets, max_distance, bidirectional)


def _checked(name: str, mods: tuple[Any, ...]) -> tuple[Mod, ...]:
    if not mods:
        raise ValueError(f"{name} needs at least one mask mod")
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"{name}: mask mod {i} must be callable, got {type(mod).__name__}")
    return tuple(mods)


def and_masks(*mods: Mod) -> Mod:
    """Mask mod True where every one of ``mods`` is (the intersection of their masks).

    Parameters
    ----------
    *mods : callable
        Mask functions ``mod(batch, head, q_idx, kv_idx) -> bool array``, at least one.

    Returns
    -------
    callable
        The mask function of the intersection.

    Raises
    ------
    ValueError
        If no mod is given.
    TypeError
        If one is not callable.

    Examples
    --------
    >>> import numpy as np
    >>> b = h = np.zeros((1, 1), dtype=int)
    >>> q, kv = np.ogrid[:3, :3]
    >>> and_masks(causal(), sliding_window(0, None))(b, h, q, kv).astype(int)
    array([[1, 0, 0],
           [0, 1, 0],
           [0, 0, 1]])
    """
    return AndMasks(_checked("and_masks", mods))


def or_masks(*mods: Mod) -> Mod:
    """Mask mod True where any one of ``mods`` is (the union of their masks).

    Parameters
    ----------
    *mods : callable
        Mask functions ``mod(batch, head, q_idx, kv_idx) -> bool array``, at least one.

    Returns
    -------
    callable
        The mask function of the union.

    Raises
    ------
    ValueError
        If no mod is given.
    TypeError
        If one is not callable.

    Examples
    --------
    >>> import numpy as np
    >>> b = h = np.zeros((1, 1), dtype=int)
    >>> q, kv = np.ogrid[:3, :3]
    >>> or_masks(causal(), prefix_lm(2))(b, h, q, kv).astype(int)
    array([[1, 1, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """
    return OrMasks(_checked("or_masks", mods))
