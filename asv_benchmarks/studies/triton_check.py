"""GPU validation of sdpa_array's Triton kernels against torch's fused SDPA.

Run from the repository root on a CUDA machine (PYTHONPATH=$PWD, array-api-compat installed):

    python3 asv_benchmarks/studies/triton_check.py            # correctness, CuPy, timing
    python3 asv_benchmarks/studies/triton_check.py --quick    # correctness and CuPy only
    python3 asv_benchmarks/studies/triton_check.py --timing-only

1. Correctness at B x H x L x E = 2 x 4 x 1024 x 64, float16 and bfloat16, full and causal:
   the Triton kernels' out / dq / dk / dv and torch's SDPA (flash) against a float64
   reference on the GPU; prints both errors (ours should be about torch's).
2. CuPy: the same call on CuPy arrays (float16) on a non-default stream, against torch's.
3. Timing at 4 x 16 x 4096 x 128, float16 and bfloat16, full and causal, forward and backward,
   ours and torch.nn.functional.scaled_dot_product_attention, with triton.testing.do_bench;
   TFLOP/s count 4 * B * H * L * S * E per forward (halved when causal), 2.5x for backward.
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from sdpa_array._kernels.result import finish_gradients
from sdpa_array._kernels.triton import plan_triton, triton_attention, triton_vjp
from sdpa_array._kernels.triton.attention import run_backward, run_forward
from sdpa_array._kernels.triton.configs import tuning_configs
from sdpa_array._problem.options import Options
from sdpa_array._problem.outputs import Outputs
from sdpa_array._problem.problem import Inputs, validate

DEV = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False


def problem(q, k, v, causal):
    p = validate(q, k, v, Options(is_causal=causal))
    x = Inputs(q, k, v)
    plan_triton(p, x)
    return p, x


def ours_forward(p, x):
    r = triton_attention(p, x, Outputs(lse=True))
    return r.out, r.lse


def ours_backward(p, x, do, out, lse):
    return finish_gradients(p, x, triton_vjp(p, x, do, out=out, lse=lse))


def reference(q, k, v, do, causal):
    """float64 attention and its gradients (autograd), on the GPU."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=DEV).triu(1), -math.inf)
    out = torch.softmax(s, -1) @ v
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad


def torch_sdpa(q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _warm_one(item):
    """Compile one autotuning configuration into triton's disk cache (a worker process)."""
    dtype, causal, L, E, kind, index = item
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v, do = (
        torch.randn(2, 2, L, E, device=DEV, dtype=getattr(torch, dtype), generator=g)
        for _ in range(4)
    )
    p, x = problem(q, k, v, causal)
    configs = {kind_: tuning_configs(p, kind_) for kind_ in ("forward", "queries", "keys")}
    b = configs[kind][index]
    if kind == "forward":
        run_forward(p, x, blocks=b)
        return item
    r = run_forward(p, x, blocks=configs["forward"][0])
    if kind == "queries":
        run_backward(p, x, do, out=r.out, lse=r.lse, blocks=b, key_blocks=configs["keys"][0])
    else:
        run_backward(p, x, do, out=r.out, lse=r.lse, blocks=configs["queries"][0], key_blocks=b)
    torch.cuda.synchronize()
    return item


def warm_caches(shapes) -> None:
    """Compile every autotuning configuration of these ``(L, E)`` shapes in parallel
    processes first, so that the autotuner finds them in triton's disk cache."""
    import concurrent.futures
    import multiprocessing

    items = []
    for L, E in shapes:
        q = torch.empty(1, 1, L, E, device=DEV, dtype=torch.float16)
        p, _ = problem(q, q, q, False)
        for dtype in ("float16", "bfloat16"):
            for causal in (False, True):
                for kind in ("forward", "queries", "keys"):
                    for i in range(len(tuning_configs(p, kind))):
                        items.append((dtype, causal, L, E, kind, i))
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=15, mp_context=ctx) as pool:
        done = list(pool.map(_warm_one, items))
    print(f"== compiled {len(done)} configurations in parallel in {time.time() - t0:.1f}s")


def correctness() -> bool:
    print("== correctness 2x4x1024x64 (max abs error vs float64; ours / torch)", flush=True)
    ok = True
    B, H, L, E = 2, 4, 1024, 64
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            g = torch.Generator(device=DEV).manual_seed(0)
            q, k, v, do = (
                torch.randn(B, H, L, E, device=DEV, dtype=dtype, generator=g) for _ in range(4)
            )
            t0 = time.time()
            p, x = problem(q, k, v, causal)
            out, lse = ours_forward(p, x)
            grads = ours_backward(p, x, do, out, lse)
            torch.cuda.synchronize()
            first = time.time() - t0
            ref = reference(q, k, v, do, causal)
            theirs = torch_sdpa(q, k, v, do, causal)
            ours = (out, *grads)
            line = []
            for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref, strict=True):
                ea = (a.double() - r).abs().max().item()
                eb = (b.double() - r).abs().max().item()
                bad = not math.isfinite(ea) or ea > 4 * eb + 1e-3
                ok &= not bad
                line.append(f"{name} {ea:.2e}/{eb:.2e}{' !!' if bad else ''}")
            print(
                f"{str(dtype)[6:]:9s} causal={causal!s:5s} first call {first:6.1f}s  "
                + "  ".join(line),
                flush=True,
            )
    return ok


def cupy_check() -> bool:
    try:
        import cupy
    except ImportError as exc:
        print("no cupy:", exc)
        return True
    print("== CuPy (float16, 1x2x300x64 causal, non-default stream) vs torch", flush=True)
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v, do = (
        torch.randn(1, 2, 300, 64, device=DEV, dtype=torch.float16, generator=g) for _ in range(4)
    )
    qc, kc, vc, doc = (cupy.asarray(t) for t in (q, k, v, do))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        p, x = problem(qc, kc, vc, True)
        out, lse = ours_forward(p, x)
        grads = ours_backward(p, x, doc, out, lse)
    stream.synchronize()
    theirs = torch_sdpa(q, k, v, do, True)
    ok = True
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), theirs, strict=True):
        err = (torch.as_tensor(a, device=DEV).double() - b.double()).abs().max().item()
        ok &= err < 2e-2
        print(f"  {name}: type {type(a).__module__}, max |ours - torch| {err:.2e}")
    return ok


def timing() -> None:
    B, H, L, E = 4, 16, 4096, 128
    print(f"== timing {B}x{H}x{L}x{E} (ms, TFLOP/s); first calls autotune", flush=True)
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            g = torch.Generator(device=DEV).manual_seed(2)
            q, k, v, do = (
                torch.randn(B, H, L, E, device=DEV, dtype=dtype, generator=g) for _ in range(4)
            )
            flops = 4 * B * H * L * L * E * (0.5 if causal else 1.0)
            p, x = problem(q, k, v, causal)
            t0 = time.time()
            out, lse = ours_forward(p, x)
            ours_backward(p, x, do, out, lse)
            torch.cuda.synchronize()
            tune = time.time() - t0
            f_ours = do_bench(lambda: ours_forward(p, x))  # noqa: B023
            b_ours = do_bench(lambda: ours_backward(p, x, do, out, lse))  # noqa: B023
            qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
            f_torch = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))  # noqa: B023
            o_t = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            b_torch = do_bench(
                lambda: torch.autograd.grad(o_t, (qt, kt, vt), do, retain_graph=True)  # noqa: B023
            )
            from sdpa_array._kernels.triton import launch

            best = [
                getattr(launch._tuned(kern, tuning_configs(p, kind)), "best_config", None)
                for kern, kind in (
                    (launch.forward_kernel, "forward"),
                    (launch.dkdv_kernel, "keys"),
                    (launch.dq_kernel, "queries"),
                )
            ]
            print("   best configs (forward, dK/dV, dQ):", *best, flush=True)
            print(
                f"{str(dtype)[6:]:9s} causal={causal!s:5s} (tuning {tune:5.1f}s) "
                f"fwd ours {f_ours:7.3f} ms {flops / f_ours * 1e-9:6.1f} TF | torch {f_torch:7.3f} "
                f"ms {flops / f_torch * 1e-9:6.1f} TF || bwd ours {b_ours:7.3f} ms "
                f"{2.5 * flops / b_ours * 1e-9:6.1f} TF | torch {b_torch:7.3f} ms "
                f"{2.5 * flops / b_torch * 1e-9:6.1f} TF",
                flush=True,
            )


def main() -> int:
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    ok = True
    shapes = [] if "--timing-only" in sys.argv else [(1024, 64)]
    if "--quick" not in sys.argv:
        shapes.append((4096, 128))
    if "--no-warm" not in sys.argv:
        warm_caches(shapes)
    if "--timing-only" not in sys.argv:
        ok = correctness()
        ok &= cupy_check()
    if "--quick" not in sys.argv:
        timing()
    print("OK" if ok else "ERRORS ABOVE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
