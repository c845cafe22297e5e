"""Every misuse raises ValueError or TypeError, before any work, naming arguments and shapes."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

import sdpa_array
from sdpa_array._plan import dispatch as _dispatch

F = np.float32


def arrays(*shapes: tuple[int, ...], dtype: Any = F) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


Q, K, V = arrays((2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 3))


def call(q=Q, k=K, v=V, **kwargs):
    return sdpa_array.scaled_dot_product_attention(q, k, v, **kwargs)


BAD_SHAPES = [
    (
        "E mismatch",
        dict(k=arrays((2, 4, 6, 7))[0]),
        ValueError,
        r"query and key must have the same feature size E.*\(2, 4, 5, 8\).*\(2, 4, 6, 7\)",
    ),
    (
        "S mismatch",
        dict(v=arrays((2, 4, 5, 3))[0]),
        ValueError,
        r"key and value must have the same length S.*\(2, 4, 6, 8\).*\(2, 4, 5, 3\)",
    ),
    (
        "batch does not broadcast",
        dict(q=arrays((3, 4, 5, 8))[0]),
        ValueError,
        r"batch axes of query, key and value do not broadcast.*\(3, 4, 5, 8\)",
    ),
    (
        "heads differ without gqa",
        dict(q=arrays((2, 8, 5, 8))[0]),
        ValueError,
        r"heads differ.*\(2, 8, 5, 8\).*enable_gqa=True",
    ),
    (
        "gqa heads not divisible",
        dict(q=arrays((2, 6, 5, 8))[0], enable_gqa=True),
        ValueError,
        r"enable_gqa=True needs query heads \(6\) to be a multiple of key/value heads \(4\)",
    ),
    (
        "gqa key/value heads differ",
        dict(
            q=arrays((2, 4, 5, 8))[0],
            k=arrays((2, 2, 6, 8))[0],
            v=arrays((2, 4, 6, 3))[0],
            enable_gqa=True,
        ),
        ValueError,
        r"key and value must have the same number of heads.*\(2, 2, 6, 8\).*\(2, 4, 6, 3\)",
    ),
    (
        "gqa without heads axis",
        dict(q=arrays((5, 8))[0], k=arrays((6, 8))[0], v=arrays((6, 3))[0], enable_gqa=True),
        ValueError,
        r"enable_gqa=True needs a heads axis",
    ),
    ("query 1-d", dict(q=arrays((8,))[0]), ValueError, r"query must have at least 2 dim.*\(8,\)"),
    ("key 0-d", dict(k=np.float32(1.0)), ValueError, r"key must have at least 2 dim.*\(\)"),
    (
        "mask shape",
        dict(mask=np.ones((5, 7), dtype=bool)),
        ValueError,
        r"mask of shape \(5, 7\) does not broadcast .*\(2, 4, 5, 6\)",
    ),
    (
        "mask enlarges batch",
        dict(mask=np.ones((3, 2, 4, 5, 6), dtype=bool)),
        ValueError,
        r"mask of shape \(3, 2, 4, 5, 6\) does not broadcast",
    ),
    (
        "bias shape",
        dict(bias=np.ones((4, 4, 6), dtype=F)),
        ValueError,
        r"bias of shape \(4, 4, 6\) does not broadcast .*\(2, 4, 5, 6\)",
    ),
]


BAD_DTYPES = [
    (
        "integer inputs",
        dict(q=np.ones((2, 4, 5, 8), dtype=np.int32)),
        TypeError,
        r"query must have a real floating dtype.*int32",
    ),
    (
        "complex inputs",
        dict(v=np.ones((2, 4, 6, 3), dtype=np.complex64)),
        TypeError,
        r"value must have a real floating dtype.*complex64",
    ),
    (
        "mixed dtypes",
        dict(k=K.astype(np.float64)),
        TypeError,
        r"share one dtype.*query float32, key float64, value float32",
    ),
    ("non-boolean mask", dict(mask=np.ones((5, 6), dtype=F)), TypeError, r"mask must be boolean"),
    (
        "integer bias",
        dict(bias=np.ones((5, 6), dtype=np.int64)),
        TypeError,
        r"bias must have a real floating dtype.*int64",
    ),
    ("list input", dict(q=[[1.0, 2.0]]), TypeError, r"query must be an array.*list"),
]


BAD_OPTIONS = [
    ("zero scale", dict(scale=0.0), ValueError, r"scale must be a positive finite number.*0\.0"),
    ("negative scale", dict(scale=-1.0), ValueError, r"scale must be a positive finite"),
    ("nan scale", dict(scale=float("nan")), ValueError, r"scale must be a positive finite"),
    ("inf scale", dict(scale=float("inf")), ValueError, r"scale must be a positive finite"),
    ("string scale", dict(scale="0.1"), TypeError, r"scale must be a real number.*str"),
    ("bool scale", dict(scale=True), TypeError, r"scale must be a real number.*bool"),
    ("zero softcap", dict(softcap=0.0), ValueError, r"softcap must be a positive finite number"),
    ("negative softcap", dict(softcap=-3.0), ValueError, r"softcap must be a positive finite"),
    ("negative window", dict(window=(-1, 2)), ValueError, r"window left size must be non-neg"),
    ("negative right", dict(window=(1, -2)), ValueError, r"window right size must be non-neg"),
    ("float window", dict(window=(1.5, 2)), TypeError, r"window left size must be an int"),
    ("window not a pair", dict(window=3), TypeError, r"window must be a pair"),
    ("window of three", dict(window=(1, 2, 3)), TypeError, r"window must be a pair"),
    ("alignment", dict(alignment="center"), ValueError, r"alignment must be one of.*'center'"),
    (
        "implementation",
        dict(implementation="flash"),
        ValueError,
        r"implementation must be one of.*'flash'",
    ),
    ("is_causal not bool", dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
    ("return flag not bool", dict(return_lse=1), TypeError, r"return_lse must be a bool"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [c[1:] for c in BAD_SHAPES + BAD_DTYPES + BAD_OPTIONS],
    ids=[c[0] for c in BAD_SHAPES + BAD_DTYPES + BAD_OPTIONS],
)
def test_bad_input_raises_clear_error(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        call(**kwargs)


def test_mixed_array_libraries_are_a_type_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"one array library.*key: torch\.Tensor"):
        call(k=torch.from_numpy(K))
    with pytest.raises(TypeError, match=r"one array library.*mask: torch\.Tensor"):
        call(mask=torch.ones((5, 6), dtype=torch.bool))


def test_bad_input_on_every_backend(backend):
    """The checks are library-independent: integer dtypes and shape errors on each backend."""
    q = backend.asarray(np.ones((2, 5, 8)), "float32")
    k = backend.asarray(np.ones((2, 6, 7)), "float32")
    v = backend.asarray(np.ones((2, 6, 3)), "float32")
    with pytest.raises(ValueError, match=re.escape("(2, 5, 8)")):
        sdpa_array.scaled_dot_product_attention(q, k, v)
    bad_mask = backend.asarray(np.ones((5, 6), dtype=np.float32), "float32")
    k = backend.asarray(np.ones((2, 6, 8)), "float32")
    with pytest.raises(TypeError, match="mask must be boolean"):
        sdpa_array.scaled_dot_product_attention(q, k, v, mask=bad_mask)


def test_errors_are_raised_before_any_work(monkeypatch):
    """Validation runs first: a failing call never reaches an implementation."""

    def fail(*args, **kwargs):
        raise AssertionError("an implementation ran before validation finished")

    failing = {
        name: dataclasses.replace(row, forward=fail, backward=row.backward and fail)
        for name, row in _dispatch.IMPLEMENTATIONS.items()
    }
    monkeypatch.setattr(_dispatch, "IMPLEMENTATIONS", failing)
    with pytest.raises(AssertionError, match="before validation"):  # the table is used
        call(implementation="materialized")
    for implementation in failing:
        with pytest.raises(ValueError, match="scale"):
            call(scale=-1.0, implementation=implementation)
        with pytest.raises(TypeError, match="mask"):
            call(mask=np.ones((5, 6), dtype=F), implementation=implementation)
    for implementation in (n for n, row in failing.items() if row.backward is not None):
        with pytest.raises(ValueError, match="scale"):
            sdpa_array.scaled_dot_product_attention_vjp(
                Q, K, V, np.ones((2, 4, 5, 3), F), scale=-1.0, implementation=implementation
            )


def test_zero_width_features_use_unit_scale():
    """E == 0: every score is 0, so the weights are uniform and the default scale is moot."""
    q, k, v = np.ones((2, 0)), np.ones((3, 0)), np.arange(6.0).reshape(3, 2)
    out = sdpa_array.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=0), (2, 2)), rtol=1e-15)


def test_keyword_type_lists_every_keyword():
    """The overloads' keyword type holds every keyword of the implementation's signature
    but the three ``return_*`` flags, and every option of the options record is one."""
    import inspect
    import typing

    from sdpa_array._api.keywords import AttentionKeywords
    from sdpa_array._problem.options import Options

    parameters = inspect.signature(sdpa_array.scaled_dot_product_attention).parameters
    keywords = {n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    flags = {"return_weights", "return_lse", "return_max_scores"}
    typed = set(typing.get_type_hints(AttentionKeywords, include_extras=False).keys())
    assert typed == keywords - flags
    assert {f.name for f in dataclasses.fields(Options)} <= typed


#: Entry points and their arrays, each called with keywords other libraries spell.
PEER_ENTRIES = {
    "scaled_dot_product_attention": lambda **kw: call(**kw),
    "scaled_dot_product_attention_vjp": lambda **kw: sdpa_array.scaled_dot_product_attention_vjp(
        Q, K, V, np.ones((2, 4, 5, 3), dtype=F), **kw
    ),
    "scaled_dot_product_attention_varlen": lambda **kw: (
        sdpa_array.scaled_dot_product_attention_varlen(
            Q[0, :, :5].transpose(1, 0, 2),
            K[0].transpose(1, 0, 2),
            V[0].transpose(1, 0, 2),
            np.array([0, 5]),
            np.array([0, 6]),
            **kw,
        )
    ),
    "explain": lambda **kw: sdpa_array.explain(Q, K, V, **kw),
    "attention_with_kv_cache": lambda **kw: sdpa_array.attention_with_kv_cache(
        Q[:, :, :1], K, V, cache_lengths=np.array([6, 6]), **kw
    ),
    "multi_head_attention": lambda **kw: sdpa_array.multi_head_attention(
        np.ones((2, 5, 8), dtype=F),
        np.ones((2, 5, 8), dtype=F),
        np.ones((2, 5, 8), dtype=F),
        {name: np.eye(8, dtype=F) for name in ("q_weight", "k_weight", "v_weight", "out_weight")},
        num_heads=2,
        **kw,
    ),
}


@pytest.mark.parametrize("entry", sorted(PEER_ENTRIES))
@pytest.mark.parametrize(
    ("spelling", "meant"),
    [
        ("attn_mask", r"mask= for a boolean mask .* bias= for a floating additive mask"),
        ("attn_bias", r"bias="),
        ("causal", r"is_causal="),
        ("softmax_scale", r"scale="),
    ],
)
def test_peer_spellings_name_what_they_are_here(entry, spelling, meant):
    with pytest.raises(TypeError, match=rf"{entry}\(\) got an unexpected keyword argument") as e:
        PEER_ENTRIES[entry](**{spelling: None})
    assert re.search(rf"'{spelling}': here it is {meant}", str(e.value))


def test_unknown_keywords_list_the_keywords_there_are():
    with pytest.raises(TypeError) as e:
        call(frobnicate=1, causal=True)
    text = str(e.value)
    assert "got unexpected keywords 'causal': here it is is_causal=; 'frobnicate';" in text
    assert text.endswith(
        "scaled_dot_product_attention()'s keywords are alignment, bias, "
        + (
            "bias_mod, block_k, block_q, dropout_p, dropout_seed, enable_gqa, implementation, "
            "is_causal, key_lengths, layout, mask, mask_mod, padding_side, query_lengths, "
            "return_lse, return_max_scores, return_weights, scale, score_mod, segment_ids, sinks, "
            "softcap, window"
        )
    )


def test_errors_inside_a_call_with_known_keywords_are_not_replaced():
    with pytest.raises(
        TypeError, match=r"mask must be boolean \(True = may attend\), got dtype float32"
    ):
        call(mask=np.ones((5, 6), dtype=F))
    with pytest.raises(TypeError, match=r"positional-only arguments passed as keyword"):
        sdpa_array.scaled_dot_product_attention(query=Q, key=K, value=V)
