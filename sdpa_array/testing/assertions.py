"""Assertions that compare any library's attention results with the float64 oracle.

The oracle (:mod:`sdpa_array.reference`) receives exactly the inputs the library received,
converted to float64, so a comparison measures the library's arithmetic only; the bounds
come from :mod:`sdpa_array.testing.bounds`, where they are derived.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference
from .._arrays.compat import array_namespace, device
from .._arrays.typing import Array
from .bounds import (
    UNIT_ROUNDOFF,
    compute_dtype,
    dtype_name,
    lse_bound,
    mod_bias_extent,
    mod_score_derivative,
    output_bound,
    scale_is_array,
    score_error,
)
from .vjp_bounds import vjp_oracle_and_bounds

__all__ = [
    "assert_array_like",
    "assert_close",
    "assert_close_to_oracle",
    "assert_vjp_close_to_oracle",
    "assert_within",
    "dtype_name",
    "forward_oracle_and_bounds",
]


def assert_array_like(actual: Array, like: Array, *, shape: tuple[int, ...], dtype: Any) -> None:
    """Check library, array type, shape, dtype and device of ``actual`` against ``like``.

    Parameters
    ----------
    actual : array
        The array to check.
    like : array
        An array of the expected type, library and device.
    shape : tuple of int
        The expected shape.
    dtype : dtype
        The expected dtype, a dtype object of the library (compared with ``==``).

    Raises
    ------
    AssertionError
        Naming what differs.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention
    >>> from sdpa_array.testing import assert_array_like
    >>> q = np.ones((2, 3, 4), dtype=np.float32)
    >>> out = scaled_dot_product_attention(q, q, q)
    >>> assert_array_like(out, q, shape=(2, 3, 4), dtype=np.float32)
    >>> assert_array_like(out, q, shape=(2, 3, 4), dtype=np.float64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    AssertionError: dtype float32 != <class 'numpy.float64'>...
    """
    assert type(actual) is type(like), f"array type {type(actual)} != {type(like)}"
    assert array_namespace({"a": actual}) is array_namespace({"b": like})
    assert tuple(actual.shape) == tuple(shape), f"shape {tuple(actual.shape)} != {shape}"
    assert actual.dtype == dtype, f"dtype {actual.dtype} != {dtype}"
    assert device(actual) == device(like), f"device {device(actual)} != {device(like)}"


def assert_close(actual: Array, expected: np.ndarray, bound: float, what: str = "out") -> None:
    """Compare on the host: same shape, identical non-finite pattern, error within ``bound``.

    ``actual`` must have no NaN, and infinities exactly where ``expected`` has them, with
    the same signs.

    Parameters
    ----------
    actual : array
        The result, of any library; compared as a float64 NumPy copy.
    expected : numpy.ndarray
        The oracle's value (float64).
    bound : float
        Largest allowed absolute error over the finite entries of ``expected``.
    what : str, default "out"
        Name of the result in the failure messages.

    Raises
    ------
    AssertionError
        Naming ``what`` and what differs (shape, NaN, non-finite entries, largest error).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.testing import assert_close
    >>> assert_close(np.array([1.0, -np.inf]), np.array([1.05, -np.inf]), 0.1)
    >>> assert_close(np.array([1.0, 2.0]), np.array([1.0, 2.5]), 0.1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    AssertionError: out: max error 5.000e-01 exceeds the bound 1.000e-01...
    """
    got = reference.to_numpy(actual).astype(np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN in result"
    np.testing.assert_array_equal(
        np.isfinite(got), np.isfinite(expected), err_msg=f"{what}: non-finite pattern differs"
    )
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got[~finite], expected[~finite], err_msg=f"{what}: infinities")
    err = float(np.max(np.abs(got[finite] - expected[finite]))) if finite.any() else 0.0
    assert err <= bound, f"{what}: max error {err:.3e} exceeds the bound {bound:.3e}"


def assert_within(actual: Array, expected: np.ndarray, bound: np.ndarray, what: str) -> None:
    """Element-wise ``|actual - expected| <= bound`` on the host, with no NaN anywhere.

    Parameters
    ----------
    actual : array
        The result, of any library; compared as a float64 NumPy copy.
    expected : numpy.ndarray
        The oracle's value (float64).
    bound : numpy.ndarray
        Bound of each entry's absolute error, same shape as ``expected``.
    what : str
        Name of the result in the failure messages.

    Raises
    ------
    AssertionError
        Naming ``what``, the number of entries over their bound and the worst of them.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array.testing import assert_within
    >>> expected, bound = np.array([1.0, 2.0]), np.array([0.0, 0.1])
    >>> assert_within(np.array([1.0, 2.05]), expected, bound, "out")
    >>> assert_within(np.array([1.01, 2.0]), expected, bound, "out")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    AssertionError: out: 1 of 2 entries exceed their bound; at ...
    """
    got = reference.to_numpy(actual).astype(np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN in result"
    err = np.abs(got - expected)
    bad = ~(err <= bound)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), got.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.size} entries exceed their bound; at {worst} "
            f"got {got[worst]!r}, expected {expected[worst]!r}, bound {bound[worst]:.3e}"
        )


def _host(x: Array) -> np.ndarray:
    return reference.to_numpy(x).astype(np.float64)


def _host_or_none(x: Array | None) -> np.ndarray | None:
    return None if x is None else _host(x)


def assert_close_to_oracle(
    result: Array | tuple[Array, ...],
    query: Array,
    key: Array,
    value: Array,
    /,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_max_scores: bool = False,
    fused: bool = False,
    **options: Any,
) -> None:
    """Check a result of :func:`sdpa_array.scaled_dot_product_attention` in one call.

    ``result`` is what the library returned for ``query``, ``key``, ``value`` (any library)
    and the same keyword arguments. Each returned array must have the query's library,
    array type and device, the promised shape and dtype (``lse`` in the compute dtype), and
    be within the derived bound of :mod:`sdpa_array.testing.bounds` from the oracle's value
    for the same inputs. ``fused`` says the call ran a fused kernel in the inputs' dtype
    (:attr:`sdpa_array.Explanation.forward_fused`): the bound then has the ``base2`` and
    ``rounded_operands`` terms.

    Parameters
    ----------
    result : array or tuple of arrays
        What the call returned: ``out``, then ``weights``, ``lse`` and ``max_scores``
        where requested.
    query, key, value : array
        The call's arrays (any library).
    mask, bias : array, optional
        The call's ``mask`` and ``bias``.
    return_weights, return_lse, return_max_scores : bool, default False
        What the call was asked for. The maximum scores must be within the error of one
        scaled product ``scale · q·k`` (:func:`~sdpa_array.testing.bounds.score_error`
        without softcap or bias: the maximum of values each within a bound is within it),
        and ``-inf`` exactly where the oracle's are.
    fused : bool, default False
        Whether the call ran a fused kernel in the inputs' dtype (see above).
    **options
        The call's other keyword arguments (``is_causal``, ``scale``, ...), as given to it.

    Raises
    ------
    AssertionError
        Naming the output (``out``, ``weights``, ``lse``, ``max_scores``) and what differs.

    Examples
    --------
    The same keywords as the call; here a causal call on 2 sequences of 1 head, with 5 and
    3 valid keys, that also returns the log-sum-exp:

    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention
    >>> from sdpa_array.testing import assert_close_to_oracle
    >>> q = np.random.default_rng(0).standard_normal((2, 1, 5, 4), dtype=np.float32)
    >>> kw = dict(is_causal=True, key_lengths=np.array([5, 3]), return_lse=True)
    >>> out, lse = scaled_dot_product_attention(q, q, q, **kw)
    >>> assert_close_to_oracle((out, lse), q, q, q, **kw)
    """
    parts = result if isinstance(result, tuple) else (result,)
    expected = 1 + return_weights + return_lse + return_max_scores
    assert len(parts) == expected, f"{len(parts)} arrays returned, {expected} asked for"
    dtype = dtype_name(query)
    q64, k64, v64 = (_host(a) for a in (query, key, value))
    mask_np = None if mask is None else reference.to_numpy(mask)
    oracle = forward_oracle_and_bounds(
        dtype, q64, k64, v64, mask=mask_np, bias=_host_or_none(bias), fused=fused, **options
    )
    xp = array_namespace({"query": query})
    compute = query.dtype if compute_dtype(dtype) == dtype else xp.float32
    asked = {"weights": return_weights, "lse": return_lse, "max_scores": return_max_scores}
    names = ["out", *(name for name, wanted in asked.items() if wanted)]
    for name, got in zip(names, parts, strict=True):
        ref, bound = oracle[name]
        like_dtype = compute if name in ("lse", "max_scores") else query.dtype
        assert_array_like(got, query, shape=ref.shape, dtype=like_dtype)
        assert_close(got, ref, bound, name)


def forward_oracle_and_bounds(
    dtype: str,
    q64: np.ndarray,
    k64: np.ndarray,
    v64: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    fused: bool = False,
    **options: Any,
) -> dict[str, tuple[np.ndarray, float]]:
    """The oracle's ``out``, ``weights``, ``lse`` and ``max_scores`` for float64 host
    copies of a call's arrays, each with the bound its ``dtype`` result must stay within.

    ``q64``, ``k64``, ``v64`` are ``(..., H, L, E)`` (heads first); ``fused`` as for
    :func:`assert_close_to_oracle`, which documents the bounds.
    """
    ref_out, ref_w, ref_lse, ref_max = reference.scaled_dot_product_attention(
        q64,
        k64,
        v64,
        mask=mask,
        bias=bias,
        return_weights=True,
        return_lse=True,
        return_max_scores=True,
        **options,
    )
    given = options.get("scale")
    E = q64.shape[-1]
    scale = (1.0 / np.sqrt(E) if E else 1.0) if given is None else float(_host(given))
    S = k64.shape[-2]
    extent = mod_bias_extent(options.get("bias_mod"), ref_w.shape)
    mod = None
    if options.get("score_mod") is not None:
        fwd = reference.intermediates(q64, k64, v64, mask=mask, bias=bias, **options)
        slope = np.abs(mod_score_derivative(options["score_mod"], fwd["raw"]))
        modded = np.abs(fwd["modded"][np.isfinite(fwd["modded"])])
        mod = (float(np.max(slope, initial=0.0)), float(np.max(modded, initial=0.0)))
    ds = score_error(dtype, q64, k64, scale, bias, options.get("softcap"), extent, score_mod=mod)
    # A sink is one more term of each row's softmax (rounded once to the compute dtype);
    # dropout multiplies kept weights by 1 / (1 - p), so the output's magnitudes grow by it.
    sinks = options.get("sinks")
    if sinks is not None:
        S += 1
        sink_max = float(np.max(np.abs(_host(sinks)), initial=0.0))
        ds += UNIT_ROUNDOFF[compute_dtype(dtype)] * sink_max
    grow = 1.0 / (1.0 - options.get("dropout_p", 0.0))
    v_max = grow * float(np.max(np.abs(v64))) if v64.size else 0.0
    out_max = float(np.max(np.abs(ref_out))) if ref_out.size else 0.0
    finite = ref_lse[np.isfinite(ref_lse)]
    lse_max = float(np.max(np.abs(finite))) if finite.size else 0.0
    return {
        "out": (
            ref_out,
            output_bound(
                dtype, S=S, ds=ds, v_max=v_max, out_max=out_max, base2=fused,
                rounded_operands=fused,
            ),
        ),
        "weights": (ref_w, output_bound(dtype, S=S, ds=ds, v_max=grow, out_max=grow)),
        "lse": (ref_lse, lse_bound(dtype, S=S, ds=ds, lse_max=lse_max, base2=fused)),
        "max_scores": (ref_max, score_error(dtype, q64, k64, scale)),
    }  # fmt: skip


def assert_vjp_close_to_oracle(
    grads: tuple[Array, ...],
    query: Array,
    key: Array,
    value: Array,
    grad_output: Array,
    /,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    fused: bool = False,
    rounded_output: bool = False,
    **options: Any,
) -> None:
    """Check gradients of attention (``(dq, dk, dv[, dbias][, dsinks][, dscale][,
    dparameters])``) against the oracle.

    ``dsinks`` is expected when ``sinks`` is given, ``dscale`` when ``scale`` is an array,
    the gradients of the parameters of ``score_mod`` and ``bias_mod`` with
    ``return_mod_gradients=True``.

    Each gradient must have its input's library, array type, shape, dtype and device, and
    every entry must be within the element-wise bound of
    :func:`~sdpa_array.testing.vjp_bounds.vjp_oracle_and_bounds`. ``fused`` says the backward
    ran a fused kernel in the inputs' dtype (:attr:`sdpa_array.Explanation.vjp_fused`):
    the bound then has the ``base2`` and ``rounded_operands`` terms.

    Parameters
    ----------
    grads : tuple of arrays
        What :func:`sdpa_array.scaled_dot_product_attention_vjp` (or autodiff) returned.
    query, key, value, grad_output : array
        The call's arrays and the output's cotangent (any library).
    mask, bias : array, optional
        The call's ``mask`` and ``bias``.
    fused : bool, default False
        Whether the backward ran a fused kernel in the inputs' dtype (see above).
    rounded_output : bool, default False
        Whether the backward read the forward's output in the inputs' dtype (the call's
        ``out=``): ``D = rowsum(dO * O)`` then carries its rounding.
    **options
        The call's other keyword arguments, as given to it.

    Raises
    ------
    AssertionError
        Naming the gradient and what differs.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_array import scaled_dot_product_attention_vjp
    >>> from sdpa_array.testing import assert_vjp_close_to_oracle
    >>> q = np.random.default_rng(0).standard_normal((2, 5, 4), dtype=np.float32)
    >>> grad_out = np.ones_like(q)
    >>> grads = scaled_dot_product_attention_vjp(q, q, q, grad_out, is_causal=True)
    >>> assert_vjp_close_to_oracle(grads, q, q, q, grad_out, is_causal=True)
    """
    dtype = dtype_name(query)
    q64, k64, v64, g64 = (_host(a) for a in (query, key, value, grad_output))
    mask_np = None if mask is None else reference.to_numpy(mask)
    sinks = options.get("sinks")
    if sinks is not None:
        options = {**options, "sinks": _host(sinks)}
    expected, bounds = vjp_oracle_and_bounds(
        dtype,
        q64,
        k64,
        v64,
        g64,
        mask=mask_np,
        bias=_host_or_none(bias),
        base2=fused,
        rounded_operands=fused,
        rounded_output=rounded_output,
        **options,
    )
    named = {"dq": query, "dk": key, "dv": value, "dbias": bias, "dsinks": sinks}
    named["dscale"] = options.get("scale")
    named["dscale"] = named["dscale"] if scale_is_array(named["dscale"]) else None
    if options.get("return_mod_gradients"):  # score_mod's, then bias_mod's parameters, last
        trained: list[Any] = [options.get(n) for n in ("score_mod", "bias_mod")]
        params = [a for mod in trained if hasattr(mod, "parameters") for a in mod.parameters]
        for i, a in enumerate(params):
            named[f"dparameter{i}"] = a
    inputs = {n: x for n, x in named.items() if x is not None}
    assert len(grads) == len(inputs), f"{len(grads)} gradients for {len(inputs)} inputs"
    for (name, x), g, e, b in zip(inputs.items(), grads, expected, bounds, strict=True):
        assert_array_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert_within(g, e, b, name)
