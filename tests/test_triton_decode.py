"""The Triton decoding kernel behind ``attention_with_kv_cache``: split-KV, contiguous and paged.

Every case runs the public function with ``implementation="triton"`` and checks, with
``tests/test_kv_cache.py``'s helpers, the output and log-sum-exp against the float64 oracle
on the gathered tokens within that file's derived bound (the kernel attends disjoint splits
of each sequence's tokens and merges them by their log-sum-exps, the split-KV scheme the
bound covers), and the caches' contents. Empty cache slots hold NaN: a slot past the
lengths that the kernel read would show in the output. A spy checks that the decoding
kernel ran (not the chunk-by-chunk path), and which calls go to the chunks instead.
Runs where the kernels run: under ``TRITON_INTERPRET=1`` on CPU torch tensors, else on a GPU
(torch CUDA and CuPy).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install triton): the Triton kernels need it",
        allow_module_level=True,
    )

from sdpa_array._api import kv_cache as _kv_cache
from sdpa_array._api.kv_cache import args as kv_args
from sdpa_array._kernels.triton import CannotUseTritonError
from sdpa_array._kernels.triton.configs import interpreting
from sdpa_array._kernels.triton.decoding import (
    BLOCK_N,
    MAX_DECODE_ROWS,
    DecodeCall,
    decode_reason,
    decode_splits,
)
from sdpa_array._plan import decode as kv_decode
from sdpa_array.testing.backends import Backend
from tests.test_kv_cache import (
    CACHED_LENGTHS,
    CACHED_STARTS,
    HQ,
    NEW_LENGTHS,
    NEW_STARTS,
    make_case,
    run,
)

# the backends and dtypes the kernels run on here (test_triton.py skips this module too
# where there are none)
from tests.test_triton import DTYPES, TRITON_BACKENDS

BACKENDS = TRITON_BACKENDS
PAIRS = [(b, d) for b in BACKENDS for d in DTYPES[b.id]]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[DecodeCall]:
    """The calls the decoding kernel ran."""
    seen: list[DecodeCall] = []
    original = kv_decode.triton_decode

    def recording(xp: Any, call: DecodeCall) -> Any:
        seen.append(call)
        return original(xp, call)

    monkeypatch.setattr(kv_decode, "triton_decode", recording)
    return seen


#: (id, paged, new tokens, options): the decoding kernel's features, alone and combined.
CONFIGS = [
    ("contiguous-new-causal-gqa", False, True, dict(is_causal=True, enable_gqa=True)),
    ("contiguous-cached-window", False, False, dict(window=(3, 1), heads_kv=4)),
    (
        "paged-new-causal-gqa-splits",
        True,
        True,
        dict(is_causal=True, enable_gqa=True, num_splits=3),
    ),
    ("paged-cached-softcap", True, False, dict(is_causal=True, softcap=1.5, num_splits=2)),
    ("paged-new-window-scale", True, True, dict(window=(5, 0), scale=0.3, enable_gqa=True)),
    ("paged-cached-mqa-no-lse", True, False, dict(heads_kv=1, is_causal=True, return_lse=False)),
    ("paged-new-every-split", True, True, dict(num_splits=16, heads_kv=4)),
]


@pytest.mark.parametrize(
    ("config", "paged", "new", "options"), CONFIGS, ids=[c[0] for c in CONFIGS]
)
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{b.id}-{d}" for b, d in PAIRS])
def test_decoding_kernel_matches_oracle(
    pair: tuple[Backend, str], config: str, paged: bool, new: bool, options: dict, spy: list
) -> None:
    backend, dtype = pair
    backend.configure()
    options = dict(options)
    heads_kv = options.pop("heads_kv", 2 if options.get("enable_gqa") else 4)
    options.setdefault("return_lse", True)
    lengths = NEW_LENGTHS if new else CACHED_LENGTHS
    case = make_case(config, lengths=lengths, new=new, paged=paged, heads_kv=heads_kv)
    run(backend, dtype, case, implementation="triton", **options)
    assert len(spy) == 1, "the decoding kernel did not run"
    assert spy[0].groups == HQ // heads_kv


@pytest.mark.parametrize("new", [True, False], ids=["new", "cached"])
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{b.id}-{d}" for b, d in PAIRS])
def test_left_padded_cache(pair: tuple[Backend, str], new: bool, spy: list) -> None:
    """``cache_leftpad``: the kernel starts each sequence at its first token (the slots
    before hold NaN), with a window and splits that begin inside the padding."""
    backend, dtype = pair
    backend.configure()
    lengths, starts = (NEW_LENGTHS, NEW_STARTS) if new else (CACHED_LENGTHS, CACHED_STARTS)
    case = make_case("left", lengths=lengths, new=new, paged=True, heads_kv=4, starts=starts)
    run(backend, dtype, case, implementation="triton", window=(4, 0), num_splits=4)
    assert len(spy) == 1, "the decoding kernel did not run"


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{b.id}-{d}" for b, d in PAIRS])
def test_long_pages_across_key_blocks(pair: tuple[Backend, str], spy: list) -> None:
    """Pages shorter and longer than a key block, sequences of several blocks, out of
    order: a block's tokens come from several pages, and a page spans blocks."""
    backend, dtype = pair
    backend.configure()
    for page_size, max_pages in ((8, 32), (128, 2)):
        case = make_case(
            f"long-{page_size}",
            lengths=[3 * BLOCK_N + 5, 0, 2 * BLOCK_N - 2],
            new=True,
            paged=True,
            page_size=page_size,
            max_pages=max_pages,
            heads_kv=4,
        )
        run(backend, dtype, case, implementation="triton", is_causal=True, num_splits=2)
    assert len(spy) == 2


@pytest.mark.parametrize(
    ("paged", "new"),
    [(False, True), (True, True), (True, False)],
    ids=["contiguous-new", "paged-new", "paged-cached"],
)
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{b.id}-{d}" for b, d in PAIRS])
def test_lengths_only_on_the_device(
    pair: tuple[Backend, str], paged: bool, new: bool, spy: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lengths and a block table the host cannot read (as while a CUDA graph is captured)
    stay on the device: the kernel still decodes, its splits cover the cache's capacity,
    and splits past a sequence's length read nothing (the NaN in empty slots would show);
    the new tokens are written through device indices."""
    backend, dtype = pair
    backend.configure()

    def unreadable(x: Any) -> Any:
        raise RuntimeError("not readable here")

    monkeypatch.setitem(kv_args._HOST_READERS, backend.library, unreadable)
    case = make_case(
        f"device-{paged}-{new}",
        lengths=[5, 0, 2 * BLOCK_N + 3],
        new=new,
        paged=paged,
        page_size=32,
        max_pages=8,
        heads_kv=4,
    )
    run(
        backend,
        dtype,
        case,
        implementation="triton",
        is_causal=True,
        num_splits=4,
        lengths_as="array",
    )
    assert len(spy) == 1, "the decoding kernel did not run"
    assert spy[0].longest == 32 * 8, "the splits must cover the capacity"


def test_auto_decodes_through_it_on_a_gpu_only(spy: list) -> None:
    """``"auto"`` takes the decoding kernel on a GPU; under the interpreter (CPU tensors)
    only when asked for by name, as the main function's ``"auto"`` does."""
    backend = BACKENDS[0]
    backend.configure()
    case = make_case("auto", lengths=[5, 9, 0], new=True, paged=True, heads_kv=4)
    run(backend, "float32", case, is_causal=True)
    assert len(spy) == (0 if interpreting() else 1)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (dict(mask=1), "mask"),
        (dict(bias=1), "bias"),
        (dict(n_query=MAX_DECODE_ROWS // 2 + 1, heads_kv=2), "query rows"),
    ],
    ids=["mask", "bias", "long-prefill"],
)
def test_calls_it_does_not_take_go_chunk_by_chunk(extra: dict, reason: str, spy: list) -> None:
    """A dense mask or bias, or more query rows than a program holds: the chunks' calls run
    the Triton kernels instead (still correct against the oracle), and the reason is
    :func:`decode_reason`'s."""
    from tests.test_kv_cache import _bias, _mask

    backend = BACKENDS[0]
    backend.configure()
    extra = dict(extra)
    n_query = extra.pop("n_query", 2)
    heads_kv = extra.pop("heads_kv", 4)
    pages = 4 if n_query == 2 else 16  # room for the long prefill
    case = make_case("refused", lengths=[5, 9, 0], new=True, paged=True, n_query=n_query,
                     heads_kv=heads_kv, max_pages=pages)  # fmt: skip
    if n_query == 2:
        mask = _mask("refused") if extra.get("mask") else None
        bias = _bias("refused") if extra.get("bias") else None
        run(backend, "float32", case, implementation="triton", mask=mask, bias=bias)
    else:
        run(backend, "float32", case, implementation="triton", enable_gqa=True)
    assert spy == []
    rows = (HQ // heads_kv) * n_query
    why = decode_reason(
        rows,
        scale_is_array=False,
        has_terms="mask" in extra or "bias" in extra,
        requires_grad=False,
    )
    assert why is not None
    assert reason in why


def test_refusals_before_any_work() -> None:
    """``implementation="triton"`` on arrays the kernels cannot take raises before the
    caches are written; an unknown name is a ``ValueError`` naming the choices."""
    case = make_case("refusal", lengths=[2, 3, 0], new=True, paged=False, heads_kv=4)
    k = case.key_cache.copy()
    with pytest.raises(CannotUseTritonError, match="torch tensors or CuPy arrays"):
        _kv_cache.attention_with_kv_cache(
            case.query, k, case.value_cache.copy(), cache_lengths=case.lengths,
            new_key=case.new_key, new_value=case.new_value, implementation="triton",
        )  # fmt: skip
    np.testing.assert_array_equal(k, case.key_cache)
    with pytest.raises(ValueError, match="implementation must be one of"):
        _kv_cache.attention_with_kv_cache(
            case.query, k, case.value_cache, cache_lengths=case.lengths, implementation="fast"
        )


def test_splits_cover_the_longest_sequence() -> None:
    """Chunks are whole key blocks, at most one split per block, and cover every token."""
    backend = BACKENDS[0]
    q = backend.asarray(np.zeros((1, 8, 1, 16)), "float32")
    pages = backend.asarray(np.zeros((4, 2, 64, 16)), "float32")
    for longest, wanted in ((0, None), (1, 5), (64, 2), (1000, 3), (1000, None), (1000, 100)):
        call = DecodeCall(q, pages, pages, q, q, q, longest, 1.0, None, None, None, wanted)
        splits, chunk = decode_splits(call)
        assert chunk % BLOCK_N == 0
        assert splits >= 1
        assert splits * chunk >= longest
        assert (splits - 1) * chunk < max(longest, 1)
        if wanted is not None:
            assert splits <= wanted


@pytest.mark.parametrize("masked", [False, True], ids=["kernel", "mask"])
def test_explained_choice_is_the_one_that_runs(masked: bool, spy: list) -> None:
    """``explain_kv_cache`` names the decoding kernel where it runs, and where a dense mask
    keeps it out, the reason (:func:`decode_reason`'s) and the choice that runs instead."""
    from sdpa_array._api.explain_cache import explain_kv_cache
    from tests.test_kv_cache import _mask

    backend = BACKENDS[0]
    backend.configure()
    case = make_case("explained", lengths=[5, 9, 0], new=True, paged=True, heads_kv=4)
    mask = _mask("explained") if masked else None
    q, k, v, nk, nv = (
        backend.asarray(a, "float32")
        for a in (case.query, case.key_cache, case.value_cache, case.new_key, case.new_value)
    )
    found = explain_kv_cache(
        q, k, v, cache_lengths=case.lengths, new_key=nk, new_value=nv, block_table=case.table,
        mask=None if mask is None else backend.asarray(mask), implementation="triton",
    )  # fmt: skip
    run(backend, "float32", case, mask=mask, implementation="triton")
    assert found.kernel == ("split" if masked else "triton")
    assert len(spy) == (0 if masked else 1)
    if masked:
        assert found.why[0] == "triton: the decoding kernel takes no dense mask or bias"
    else:
        assert found.why == ()
