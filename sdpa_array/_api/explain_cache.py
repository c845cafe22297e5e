"""``explain_kv_cache``: which kernel a call of
:func:`~sdpa_array.attention_with_kv_cache` runs, and why.

It checks the call exactly as :func:`~sdpa_array.attention_with_kv_cache` does and asks the
decoding planner (:func:`~sdpa_array._plan.decode.plan_decode`) the same question, without
writing the new tokens or running anything; for the ``"single"`` choice it also asks
:func:`~sdpa_array.explain` about the forward call that choice makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._arrays.typing import Array, Layout
from .._plan.decode import plan_decode
from .explain import explain
from .kv_cache.call import gather
from .kv_cache.chunks import single_call

__all__ = ["CacheExplanation", "explain_kv_cache"]


@dataclass(frozen=True)
class CacheExplanation:
    """What :func:`explain_kv_cache` found.

    Attributes
    ----------
    kernel : str
        The planner's choice: ``"triton"`` (the Triton split-KV decoding kernel),
        ``"single"`` (one forward call over a slice of a contiguous cache) or ``"split"``
        (split-KV chunks, each a forward call, merged by their log-sum-exps).
    automatic : bool
        Whether ``implementation="auto"`` was given.
    why : tuple of str
        Why each kernel the planner prefers to this one was passed over.
    implementation : str
        The caller's ``implementation``, which every forward call is given.
    span : (int, int) or None
        ``"single"``: the tokens ``[lo, n)`` the forward call attends.
    pieces : int
        ``"split"``: how many pieces (chunks, cut at page boundaries) are attended.
    forward, forward_kernel : str or None
        ``"single"``: the implementation the forward call runs and the native kernel it
        delegates to (:func:`~sdpa_array.explain`); ``None`` otherwise.

    Examples
    --------
    >>> import numpy as np
    >>> import sdpa_array
    >>> q, cache = np.zeros((1, 4, 1, 8)), np.zeros((1, 2, 16, 8))
    >>> found = sdpa_array.explain_kv_cache(q, cache, cache, cache_lengths=[5], enable_gqa=True)
    >>> found.kernel, found.span
    ('single', (0, 5))
    """

    kernel: str
    automatic: bool
    why: tuple[str, ...]
    implementation: str
    span: tuple[int, int] | None = None
    pieces: int = 0
    forward: str | None = None
    forward_kernel: str | None = None

    def __str__(self) -> str:
        detail = {
            "triton": "the Triton decoding kernel",
            "single": "one forward call over tokens [{}, {})".format(*(self.span or (0, 0))),
            "split": f"{self.pieces} pieces, merged",
        }[self.kernel]
        lines = [f"kv cache: {self.kernel} ({detail})"]
        lines.extend(f"  passed over: {reason}" for reason in self.why)
        if self.forward is not None:
            kernel = f" ({self.forward_kernel})" if self.forward_kernel else ""
            lines.append(f"forward: {self.forward}{kernel}")
        return "\n".join(lines)


def explain_kv_cache(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    /,
    *,
    cache_lengths: Array | list[int],
    cache_leftpad: Array | list[int] | None = None,
    new_key: Array | None = None,
    new_value: Array | None = None,
    block_table: Array | list[list[int]] | None = None,
    num_splits: int | None = None,
    layout: Layout = "BHLE",
    **options: Any,
) -> CacheExplanation:
    """Which kernel a call of :func:`~sdpa_array.attention_with_kv_cache` with these
    arguments runs, and why the planner passed over the ones it prefers. Nothing is written
    or computed.

    Parameters
    ----------
    query, key_cache, value_cache, cache_lengths, cache_leftpad, new_key, new_value
        As for :func:`~sdpa_array.attention_with_kv_cache`.
    block_table, num_splits, layout, **options
        Likewise.

    Returns
    -------
    CacheExplanation
        Printable (``print(explain_kv_cache(...))``).

    Raises
    ------
    TypeError, ValueError
        As the call itself would, before any work (``CannotUseTritonError`` included).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import explain_kv_cache
    >>> q = np.zeros((1, 4, 1, 8))
    >>> cache = np.zeros((1, 2, 16, 8))
    >>> print(explain_kv_cache(q, cache, cache, cache_lengths=[5], enable_gqa=True))
    kv cache: single (one forward call over tokens [0, 5))
      passed over: triton: auto uses the Triton kernels on a GPU only
    forward: materialized
    """
    c, _ = gather(locals())  # planned as the call runs: heads first
    plan = plan_decode(c)
    choice = plan.choice
    forward = kernel = None
    if choice.name == "single":  # the forward call it makes, on the caches as they are
        q, k, v, keywords = single_call(plan, (c.key_cache, c.value_cache))
        found = explain(q, k, v, **keywords)
        forward, kernel = found.forward, found.forward_kernel
    return CacheExplanation(
        kernel=choice.name,
        automatic=choice.automatic,
        why=choice.why,
        implementation=choice.implementation,
        span=plan.span,
        pieces=len(plan.pieces),
        forward=forward,
        forward_kernel=kernel,
    )
