"""GPU benchmark: sdpa_array on torch CUDA and CuPy against torch's fused SDPA, as ratios.

Run on a machine with an NVIDIA GPU (torch with CUDA; CuPy optional)::

    python asv_benchmarks/studies/gpu_bench.py                      # every case, 5 rounds
    python asv_benchmarks/studies/gpu_bench.py --quick              # one shape, 3 rounds
    python asv_benchmarks/studies/gpu_bench.py --json out.json      # also write the figures

Each row times one call (forward, autograd backward or the VJP function) of one
implementation on one library, interleaved with its peer, torch's
``scaled_dot_product_attention`` on the same tensors (forward: the call; backward: its
autograd backward), and with the GEMM-bound limit: the two bare products ``Q Kᵀ`` and
``P V`` of the same shapes in the same library and dtype (scores written to memory, no
softmax). Each round times ``--reps`` calls queued back to back after warm-up, then one
synchronisation (``--sync-each``: the median of synchronised calls, which adds the host's
Python overhead to every call); the table gives the median over rounds and the spread
(min-max) of the ratios. TFLOP/s count
``4·B·H·L·S·E`` per forward (half when causal) and 2.5 times that for a backward, the
FlashAttention convention.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SHAPES = [(4, 16, 4096, 128), (1, 16, 16384, 128), (4, 16, 4096, 64), (4, 16, 1024, 128)]
QUICK_SHAPES = [(4, 16, 4096, 128)]
DTYPES = ("float16", "bfloat16")
SLOW_CALL_S = 0.5  # a call slower than this is timed once per round
SYNC_EACH = False  # --sync-each: time each call synchronised (latency, not throughput)


def _sync() -> None:
    import torch

    torch.cuda.synchronize()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.get_current_stream().synchronize()


def _time(fn: Callable[[], Any], reps: int) -> float:
    """Seconds per call: ``reps`` calls queued back to back, then one synchronisation (as
    a training loop runs them: the host's Python overhead overlaps the device's work); a
    call slower than :data:`SLOW_CALL_S` is timed alone. With ``SYNC_EACH`` every call is
    synchronised and the median taken (latency: the host overhead adds to each)."""
    fn()
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    first = time.perf_counter() - t0
    if first > SLOW_CALL_S:
        return first
    if SYNC_EACH:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - t0) / reps


def flops(B: int, H: int, L: int, S: int, E: int, causal: bool, backward: bool) -> float:
    f = 4.0 * B * H * L * S * E
    if causal:
        f *= 0.5 * (1 + 1 / L) if L == S else 0.5
    return f * (2.5 if backward else 1.0)


def _cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    import sdpa_array as sa

    try:
        import cupy
    except ImportError:
        cupy = None
    dev = torch.device("cuda")
    out: list[dict[str, Any]] = []
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    for B, H, L, E in shapes:
        for dtype_name in args.dtypes:
            dt = getattr(torch, dtype_name)
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v, do = (
                torch.randn(B, H, L, E, device=dev, dtype=dt, generator=g) for _ in range(4)
            )
            for causal in (False, True):
                tag = f"{B}x{H}x{L}x{E} {dtype_name} {'causal' if causal else 'full'}"

                def peer_fwd(q=q, k=k, v=v, causal=causal) -> Any:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def bare(q=q, k=k, v=v) -> Any:
                    return (q @ k.mT) @ v

                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                peer_out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

                def peer_bwd(out=peer_out, qg=qg, kg=kg, vg=vg, do=do) -> Any:
                    return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

                fl_f = flops(B, H, L, L, E, causal, False)
                fl_b = flops(B, H, L, L, E, causal, True)
                impls = [i for i in args.impls if i != "materialized" or L <= 4096]
                for impl in impls:

                    def ours(q=q, k=k, v=v, causal=causal, impl=impl) -> Any:
                        return sa.scaled_dot_product_attention(
                            q, k, v, is_causal=causal, implementation=impl
                        )

                    out.append(_case(f"fwd torch:cuda {impl} {tag}", ours, peer_fwd, bare, fl_f))
                    if impl in ("auto", "triton", "blocked"):
                        ours_out = sa.scaled_dot_product_attention(
                            qg, kg, vg, is_causal=causal, implementation=impl
                        )

                        def ours_bwd(out=ours_out, qg=qg, kg=kg, vg=vg, do=do) -> Any:
                            return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

                        out.append(
                            _case(
                                f"bwd autograd torch:cuda {impl} {tag}",
                                ours_bwd,
                                peer_bwd,
                                None,
                                fl_b,
                            )
                        )
                    if impl in ("auto", "native", "triton"):

                        def ours_vjp(q=q, k=k, v=v, do=do, causal=causal, impl=impl) -> Any:
                            return sa.scaled_dot_product_attention_vjp(
                                q, k, v, do, is_causal=causal, implementation=impl
                            )

                        out.append(
                            _case(
                                f"bwd vjp torch:cuda {impl} {tag}", ours_vjp, peer_bwd, None, fl_b
                            )
                        )
                if args.features:
                    out.extend(
                        _feature_cases(tag, (q, k, v, do), causal, peer_fwd, peer_bwd, fl_f, fl_b)
                    )
                del qg, kg, vg, peer_out
                if cupy is None or dtype_name == "bfloat16":
                    continue
                cq, ck, cv = (cupy.from_dlpack(t.detach()) for t in (q, k, v))

                def cupy_bare(cq=cq, ck=ck, cv=cv) -> Any:
                    return (cq @ ck.swapaxes(-1, -2)) @ cv

                for impl in args.cupy_impls:
                    if impl == "materialized" and L > 4096:
                        continue

                    def ours_cupy(cq=cq, ck=ck, cv=cv, causal=causal, impl=impl) -> Any:
                        return sa.scaled_dot_product_attention(
                            cq, ck, cv, is_causal=causal, implementation=impl
                        )

                    out.append(
                        _case(f"fwd cupy {impl} {tag}", ours_cupy, peer_fwd, cupy_bare, fl_f)
                    )
    return out


def _feature_kwargs(q: Any) -> dict[str, dict[str, Any]]:
    """The calls torch has no fused kernel for, each with one feature: sinks (one logit per
    head), softcap, per-sequence lengths (the last sequence 3/4 long; the work counted as
    if full) and dropout with a seed."""
    import torch

    B, H, L, _ = q.shape
    lengths = torch.full((B,), L, dtype=torch.int32, device=q.device)
    lengths[-1] = 3 * L // 4
    return {
        "sinks": {"sinks": torch.zeros(H, device=q.device, dtype=torch.float32)},
        "softcap": {"softcap": 30.0},
        "lengths": {"query_lengths": lengths, "key_lengths": lengths},
        "dropout": {"dropout_p": 0.1, "dropout_seed": 1234},
    }


def _feature_cases(
    tag: str,
    tensors: tuple[Any, ...],
    causal: bool,
    peer_fwd: Callable,
    peer_bwd: Callable,
    fl_f: float,
    fl_b: float,
) -> list[dict[str, Any]]:
    """The feature rows: the Triton kernel with one feature, forward and autograd
    backward, against torch's fused call without it (ratio target 0.6)."""
    import torch

    import sdpa_array as sa

    q, k, v, do = tensors
    out = []
    for feature, kw in _feature_kwargs(q).items():

        def ours(q=q, k=k, v=v, kw=kw) -> Any:
            return sa.scaled_dot_product_attention(
                q, k, v, is_causal=causal, implementation="triton", **kw
            )

        out.append(_case(f"fwd torch:cuda triton+{feature} {tag}", ours, peer_fwd, None, fl_f))
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        res = sa.scaled_dot_product_attention(
            qg, kg, vg, is_causal=causal, implementation="triton", **kw
        )

        def ours_bwd(out=res, qg=qg, kg=kg, vg=vg) -> Any:
            return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

        out.append(
            _case(f"bwd autograd torch:cuda triton+{feature} {tag}", ours_bwd, peer_bwd, None, fl_b)
        )
    return out


def _case(name: str, ours: Callable, peer: Callable, bare: Callable | None, fl: float) -> dict:
    return {"name": name, "ours": ours, "peer": peer, "bare": bare, "flops": fl}


def _run(
    cases: list[dict[str, Any]], rounds: int, reps: int, report: Callable[[list], None]
) -> list[dict[str, Any]]:
    """Time every case; ``report(rows)`` is called after each row (a partial result
    survives a run cut short)."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        report(rows)
        ours_t, peer_t, bare_t = [], [], []
        try:
            for _ in range(rounds):  # interleaved: ours, peer, bare in every round
                ours_t.append(_time(case["ours"], reps))
                peer_t.append(_time(case["peer"], reps))
                if case["bare"] is not None:
                    bare_t.append(_time(case["bare"], reps))
        except Exception as exc:  # report and go on: one failing case must not hide the rest
            print(f"{case['name']:58s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            rows.append({"name": case["name"], "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        ratios = [p / o for p, o in zip(peer_t, ours_t, strict=True)]
        row = {
            "name": case["name"],
            "ms": statistics.median(ours_t) * 1e3,
            "tflops": case["flops"] / statistics.median(ours_t) / 1e12,
            "peer_ms": statistics.median(peer_t) * 1e3,
            "ratio_vs_torch": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
        }
        if bare_t:
            gemm = [b / o for b, o in zip(bare_t, ours_t, strict=True)]
            row["gemm_bound_fraction"] = statistics.median(gemm)
            row["bare_ms"] = statistics.median(bare_t) * 1e3
        rows.append(row)
        gemm_txt = f" gemm-bound {row['gemm_bound_fraction']:.3f}" if bare_t else ""
        print(
            f"{row['name']:58s} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s "
            f"vs torch {row['ratio_vs_torch']:.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            f"{gemm_txt}",
            flush=True,
        )
    return rows


def memory_check() -> dict[str, Any]:
    """Peak GPU memory of a blocked call at L = S = 32768 (1 head, float16, causal)."""
    import torch

    import sdpa_array as sa

    q = torch.randn(1, 1, 32768, 128, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sa.scaled_dot_product_attention(q, q, q, is_causal=True, implementation="blocked")
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(f"peak memory, blocked, 1x1x32768x128 float16 causal: {peak:.1f} MiB", flush=True)
    return {"blocked_32768_causal_peak_mib": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=lambda s: tuple(int(n) for n in s.split("x")),
        help="BxHxLxE shapes (default: all of SHAPES)",
    )
    parser.add_argument(
        "--impls", nargs="+", default=["auto", "native", "triton", "blocked", "materialized"]
    )
    parser.add_argument("--cupy-impls", nargs="+", default=["auto", "triton", "blocked"])
    parser.add_argument("--json", help="write the rows and the machine to this file")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--features",
        action="store_true",
        help="add the Triton kernel with sinks, softcap, lengths or dropout against plain torch",
    )
    parser.add_argument("--sync-each", action="store_true", help="synchronise every call (latency)")
    args = parser.parse_args(argv)
    global SYNC_EACH
    SYNC_EACH = args.sync_each

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    machine = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cupy": cupy_version,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(machine), flush=True)

    def report(rows: list, **extra: Any) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine, "rows": rows, **extra}, f, indent=1)

    extra = {} if args.no_memory else memory_check()
    rows = _run(_cases(args), args.rounds, args.reps, lambda rows: report(rows, **extra))
    report(rows, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
