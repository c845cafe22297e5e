"""The caller's choice of optional kernels: :func:`set_optional_kernels` and
:func:`get_optional_kernels`."""

from __future__ import annotations

from .._kernels.native.torch_on_numpy import KNOWN, allow, allowed
from . import cache

__all__ = ["get_optional_kernels", "set_optional_kernels"]


def set_optional_kernels(*names: str) -> None:
    """Allow kernels of optional dependencies on the NumPy path (none by default).

    ``"torch"``: where torch is installed, NumPy calls may run on torch's CPU kernels, on
    the same memory (``torch.from_numpy``, no copy; the results come back as NumPy arrays).
    ``implementation="auto"`` then takes them for the forward call where they compute it
    exactly (``explain()`` names the kernel, "... on NumPy memory"), and
    ``implementation="native"`` for the forward call and the VJP; the VJP's ``"auto"``
    keeps the library's own backward, which is faster on the CPU. Without torch, or for a
    call torch's kernels do not compute exactly, the library's own Array-API path runs, as
    it does by default. ``set_optional_kernels()`` with no name turns them off again.

    Parameters
    ----------
    *names : str
        The optional kernels to allow: ``"torch"`` (the only one).

    Raises
    ------
    ValueError
        For a name that is not an optional kernel.

    Examples
    --------
    >>> import sdpa_array
    >>> sdpa_array.set_optional_kernels("torch")
    >>> sdpa_array.get_optional_kernels()
    ('torch',)
    >>> sdpa_array.set_optional_kernels()  # off again, the default
    """
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ValueError(f"unknown optional kernels {unknown}; known: {', '.join(KNOWN)}")
    allow(frozenset(names))
    cache.clear()  # kept plans chose without them


def get_optional_kernels() -> tuple[str, ...]:
    """The optional kernels :func:`set_optional_kernels` allowed, sorted.

    Returns
    -------
    tuple of str
        The allowed kernels' names (``"torch"``), empty when none is allowed.

    Examples
    --------
    >>> import sdpa_array
    >>> sdpa_array.get_optional_kernels()  # none by default
    ()
    """
    return tuple(sorted(allowed()))
