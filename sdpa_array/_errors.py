"""The library's own exceptions, below every layer so that each may raise them.

Both are ``ValueError`` subclasses: a call asked for an implementation that cannot compute
it exactly. The public face exports them as ``sdpa_array.CannotDelegateError`` and
``sdpa_array.CannotUseTritonError``.
"""

from __future__ import annotations

__all__ = ["CannotDelegateError", "CannotUseTritonError"]


class CannotDelegateError(ValueError):
    """``implementation="native"`` was asked for a call no native kernel computes exactly.

    The message lists, for each kernel of the caller's library, why it does not apply.

    Examples
    --------
    >>> import numpy as np
    >>> import sdpa_array
    >>> q = np.zeros((1, 2, 4, 8), dtype=np.float32)
    >>> try:
    ...     sdpa_array.scaled_dot_product_attention(q, q, q, implementation="native")
    ... except sdpa_array.CannotDelegateError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    CannotDelegateError True
    """


class CannotUseTritonError(ValueError):
    """The Triton kernels cannot compute this call exactly (the message says why).

    Examples
    --------
    >>> import numpy as np
    >>> import sdpa_array
    >>> q = np.zeros((1, 2, 4, 8), dtype=np.float32)
    >>> try:
    ...     sdpa_array.scaled_dot_product_attention(q, q, q, implementation="triton")
    ... except sdpa_array.CannotUseTritonError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    CannotUseTritonError True
    """


# shown as the public names they are
CannotDelegateError.__module__ = "sdpa_array"
CannotUseTritonError.__module__ = "sdpa_array"
