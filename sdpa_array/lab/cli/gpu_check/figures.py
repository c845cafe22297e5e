"""The figures of ``gpu-check``, measured in its child process against their peers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .sections import load_module
from .setup import Setup


def paired_ratios(ours: list[float], peer: list[float]) -> tuple[float, float, float]:
    """``(median(ours) / median(peer), min, max)`` of the per-round ratios: rounds are
    interleaved, so round ``i`` of each saw the same state of the machine."""
    per_round = [a / b for a, b in zip(ours, peer, strict=True)]
    return statistics.median(ours) / statistics.median(peer), min(per_round), max(per_round)


def timed_rounds(
    candidates: dict[str, Callable[[], Any]], sync: Callable[[Any], None], setup: Setup
) -> dict[str, list[float]]:
    """Seconds per call of each candidate: one warm-up of ``reps`` queued calls each, then
    ``rounds`` rounds in a new order each, each ``reps`` queued calls synchronised once."""

    def queued(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            result = None
            for _ in range(setup.reps):
                result = fn()
            return result[0] if isinstance(result, tuple) else result

        return run

    runs = {name: queued(fn) for name, fn in candidates.items()}
    for fn in runs.values():
        sync(fn())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(setup.rounds):
        order = list(runs)
        random.Random(round_).shuffle(order)
        for name in order:
            start = time.perf_counter()
            sync(runs[name]())
            times[name].append((time.perf_counter() - start) / setup.reps)
    return times


@dataclasses.dataclass(frozen=True)
class Figure:
    """One figure of the targets: ``measure(setup, case)`` returns the timed candidates'
    seconds (``"ours"`` against ``"peer"``) or, for accuracy, errors."""

    key: str
    title: str
    target: float
    peer: str


#: The figures, in the order they are measured (cheap and important first).
FIGURES = {
    f.key: f
    for f in (
        Figure("accuracy", "fp16 max-abs error / torch.sdpa's", 1.1, "torch.sdpa"),
        Figure("forward", "torch `auto` forward / torch.sdpa", 1.03, "torch.sdpa"),
        Figure("autograd", "autograd backward through `auto` / torch's", 1.03, "torch backward"),
        Figure("vjp_given", "VJP given out and lse / torch's backward", 1.1, "torch backward"),
        Figure("decode", "KV-cache decode, paged / torch.sdpa on the tokens", 3.0, "torch.sdpa"),
        Figure("jax", "JAX `auto` under jit / jax.nn.dot_product_attention", 1.1, "jax.nn"),
        Figure("triton_forward", "Triton forward / torch.sdpa", 1.25, "torch.sdpa"),
        Figure("triton_vjp", "Triton VJP / torch's backward", 1.5, "torch backward"),
        Figure("blocked", "generic blocked path / the two bare products", 10.0, "two products"),
    )
}


def _shape(text: str) -> tuple[tuple[int, int, int, int], bool]:
    dims, _, flag = text.partition("-")
    B, H, L, E = (int(n) for n in dims.split("x"))
    return (B, H, L, E), flag == "causal"


def random_inputs(backend: Any, shape: str, dtype: str, count: int = 3, seed: int = 0) -> list[Any]:
    import numpy as np

    dims, _ = _shape(shape)
    rng = np.random.default_rng(seed)
    return [
        backend.asarray(rng.standard_normal(dims, dtype=np.float32), dtype) for _ in range(count)
    ]


def configured_backend(backend_id: str | None, dtype: str) -> Any:
    """The configured backend, or ``NotImplementedError`` (a skip) where it cannot run."""
    from ....testing.backends import get_backend

    if backend_id is None:
        raise NotImplementedError("no such backend for this run")
    backend = get_backend(backend_id)
    if not backend.is_available():
        raise NotImplementedError(f"{backend_id} is not installed or has no device here")
    if dtype not in backend.dtypes:
        raise NotImplementedError(f"{backend_id} has no {dtype}")
    backend.configure()
    return backend


def _torch_backward(q: Any, k: Any, v: Any, g: Any, causal: bool) -> Callable[[], Any]:
    """torch's autograd backward of its own SDPA on the same memory (the graph kept)."""
    torch = load_module("torch")

    leaves = [torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    grad = torch.from_dlpack(g)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def _torch_sdpa(q: Any, k: Any, v: Any, causal: bool) -> Callable[[], Any]:
    torch = load_module("torch")

    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    return lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)


def cases(setup: Setup) -> list[tuple[str, str, str, str]]:
    """``(figure, backend, dtype, shape)`` of every measurement, in order."""
    first = setup.shapes[0]
    out: list[tuple[str, str, str, str]] = []
    out.append(("accuracy", setup.torch_backend, "float16", first))
    for key in ("forward", "autograd", "vjp_given"):
        out += [(key, setup.torch_backend, d, s) for d in setup.dtypes for s in setup.shapes]
    out.append(("decode", setup.torch_backend, "float16", setup.decode_shape))
    out += [("jax", setup.jax_backend, d, s) for d in setup.dtypes for s in setup.shapes]
    triton_backends = [setup.torch_backend] + ([setup.cupy_backend] if setup.cupy_backend else [])
    for b in triton_backends:
        out += [("triton_forward", b, d, s) for d in setup.dtypes for s in setup.shapes]
    out += [("triton_vjp", setup.torch_backend, d, s) for d in setup.dtypes for s in setup.shapes]
    out.append(("blocked", setup.torch_backend, setup.dtypes[0], first))
    return out


def measure(setup: Setup, figure: str, backend_id: str, dtype: str, shape: str) -> dict[str, Any]:
    """One measurement: candidate name -> per-call seconds (errors, for accuracy)."""
    sa = load_module("sdpa_array")

    if figure == "triton_forward" and backend_id == "cupy" and dtype == "bfloat16":
        raise NotImplementedError("CuPy has no bfloat16")
    backend = configured_backend(backend_id, dtype)
    sync = backend.synchronize
    dims, causal = _shape(shape) if figure != "decode" else ((0, 0, 0, 0), False)
    if figure == "accuracy":
        return _accuracy(backend, shape)
    if figure == "decode":
        return _decode(backend, setup, dtype, shape)
    if figure == "jax":
        return _jax(backend, setup, dtype, shape)
    q, k, v, g = random_inputs(backend, shape, dtype, count=4)
    attention, vjp = sa.scaled_dot_product_attention, sa.scaled_dot_product_attention_vjp
    if figure in ("forward", "triton_forward"):
        impl = "auto" if figure == "forward" else "triton"
        candidates = {
            "ours": lambda: attention(q, k, v, is_causal=causal, implementation=impl),
            "peer": _torch_sdpa(q, k, v, causal),
        }
    elif figure == "blocked":
        from ..bench import two_products

        candidates = {
            "ours": lambda: attention(q, k, v, is_causal=causal, implementation="blocked"),
            "peer": lambda: two_products(q, k, v),
        }
    elif figure == "autograd":
        torch = load_module("torch")

        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = attention(*leaves, is_causal=causal)
        candidates = {
            "ours": lambda: torch.autograd.grad(out, leaves, g, retain_graph=True),
            "peer": _torch_backward(q, k, v, g, causal),
        }
    else:  # vjp_given, triton_vjp
        impl = "auto" if figure == "vjp_given" else "triton"
        out, lse = attention(q, k, v, is_causal=causal, implementation=impl, return_lse=True)
        candidates = {
            "ours": lambda: vjp(
                q, k, v, g, is_causal=causal, implementation=impl, out=out, lse=lse
            ),
            "plain": lambda: vjp(q, k, v, g, is_causal=causal, implementation=impl),
            "peer": _torch_backward(q, k, v, g, causal),
        }
    result: dict[str, Any] = dict(timed_rounds(candidates, sync, setup))
    B, H, L, E = dims
    flops = 4.0 * B * H * L * L * E * (0.5 if causal else 1.0)
    result["flops"] = flops * (2.5 if figure in ("autograd", "vjp_given", "triton_vjp") else 1.0)
    return result


def _accuracy(backend: Any, shape: str) -> dict[str, Any]:
    """Max-abs error against float64 of ours (``auto``) and of torch.sdpa, float16 inputs."""
    import numpy as np

    torch = load_module("torch")

    sa = load_module("sdpa_array")

    dims, causal = _shape(shape)
    rng = np.random.default_rng(1)
    exact = [rng.standard_normal(dims) * 3 for _ in range(3)]
    q, k, v = (backend.asarray(a, "float16") for a in exact)
    rounded = [torch.from_dlpack(x).double() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*rounded, is_causal=causal)
    ours = torch.from_dlpack(sa.scaled_dot_product_attention(q, k, v, is_causal=causal))
    peer = _torch_sdpa(q, k, v, causal)()
    return {
        "ours": [float((ours.double() - ref).abs().max())],
        "peer": [float((peer.double() - ref).abs().max())],
    }


def _decode(backend: Any, setup: Setup, dtype: str, shape: str) -> dict[str, Any]:
    """One decoding step on a paged cache (pages of 256 tokens, shuffled) against torch.sdpa
    on the same tokens held contiguously."""
    import numpy as np

    torch = load_module("torch")

    from .... import attention_with_kv_cache

    B, Hq, Hkv, n, E = (int(x) for x in shape.split("x"))
    page = min(256, n)
    pages = B * -(-n // page)
    rng = np.random.default_rng(0)
    q = backend.asarray(rng.standard_normal((B, Hq, 1, E)), dtype)
    kc, vc = (backend.asarray(rng.standard_normal((pages, Hkv, page, E)), dtype) for _ in "kv")
    order = rng.permutation(pages).reshape(B, -1)
    table = backend.asarray(order.astype(np.int32))

    def gathered(cache: Any) -> Any:
        t = torch.from_dlpack(cache)[torch.as_tensor(order, device=t_device(cache))]
        return t.permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, E)[:, :, :n].contiguous()

    def t_device(cache: Any) -> Any:
        return torch.from_dlpack(cache).device

    tk, tv, tq = gathered(kc), gathered(vc), torch.from_dlpack(q)
    lengths = [n] * B
    candidates = {
        "ours": lambda: attention_with_kv_cache(
            q, kc, vc, cache_lengths=lengths, block_table=table, enable_gqa=True
        )[0],
        "peer": lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, enable_gqa=True
        ),
    }
    return timed_rounds(candidates, backend.synchronize, setup)


def _jax(backend: Any, setup: Setup, dtype: str, shape: str) -> dict[str, Any]:
    """Ours (``auto``) under ``jax.jit`` against ``jax.nn.dot_product_attention`` (cuDNN on
    a GPU, XLA's elsewhere), both jitted."""
    jax = load_module("jax")

    sa = load_module("sdpa_array")

    jax.config.update("jax_default_matmul_precision", None)  # as a user runs
    q, k, v = random_inputs(backend, shape, dtype)
    _, causal = _shape(shape)
    jnp = jax.numpy
    on_gpu = q.devices().pop().platform == "gpu"
    qt, kt, vt = (jnp.swapaxes(x, -3, -2) for x in (q, k, v))
    ours = jax.jit(lambda a, b, c: sa.scaled_dot_product_attention(a, b, c, is_causal=causal))
    peer = jax.jit(
        lambda a, b, c: jax.nn.dot_product_attention(
            a, b, c, is_causal=causal, implementation="cudnn" if on_gpu else None
        )
    )
    candidates = {"ours": lambda: ours(q, k, v), "peer": lambda: peer(qt, kt, vt)}
    return timed_rounds(candidates, backend.synchronize, setup)


def run_figures(setup: Setup, work: Path) -> int:
    """The child process of the figures section: one JSON line per case."""
    path = work / "figures.jsonl"
    planned = cases(setup)
    with path.open("w") as sink:
        for figure, backend_id, dtype, shape in planned:
            row: dict[str, Any] = {
                "figure": figure,
                "backend": backend_id,
                "dtype": dtype,
                "shape": shape,
            }
            label = f"{figure:15s} {backend_id:10s} {dtype:9s} {shape}"
            print(f"measuring {label} ...", flush=True)
            start = time.perf_counter()
            try:
                row.update(status="ok", **measure(setup, figure, backend_id, dtype, shape))
            except NotImplementedError as exc:
                row.update(status="skip", reason=str(exc))
            except Exception as exc:
                from .... import CannotDelegateError, CannotUseTritonError

                if isinstance(exc, (CannotDelegateError, CannotUseTritonError)):
                    row.update(status="skip", reason=f"{type(exc).__name__}: {exc}")
                else:
                    row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
                    traceback.print_exc()
            row["seconds"] = time.perf_counter() - start
            print(f"  {label}: {_describe(row)}", flush=True)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            _free_gpu_memory()
    return 0


def _describe(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason', '')[:200]}"
    ratio, low, high = paired_ratios(row["ours"], row["peer"])
    text = f"ours/peer {ratio:.3f} ({low:.3f}-{high:.3f})"
    if row["figure"] != "accuracy":
        text += f", ours {statistics.median(row['ours']) * 1e3:.3f} ms"
        text += f", peer {statistics.median(row['peer']) * 1e3:.3f} ms"
    if "plain" in row:
        text += f", without out/lse {statistics.median(row['plain']) * 1e3:.3f} ms"
    return text


def _free_gpu_memory() -> None:
    import gc

    gc.collect()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "cupy" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
