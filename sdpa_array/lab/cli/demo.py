"""``python -m sdpa_array demo``: run every installed backend and dtype against the oracle."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import reference
from ..._api.forward import scaled_dot_product_attention
from ...testing.backends import BACKENDS, Backend
from ...testing.bounds import lse_bound, output_bound, score_error
from .backend_choice import parse_backends, report_unavailable

WORKED_Q = [[1.0, 2.0], [3.0, 4.0]]
WORKED_K = [[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]
WORKED_V = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]


def _cases(rng: np.random.Generator) -> list[tuple[str, dict[str, Any]]]:
    """The worked example of the Theory page and a random batched, masked case."""
    B, H, L, S, E = 2, 4, 48, 64, 32
    padding = np.ones((B, 1, 1, S), dtype=bool)
    padding[1, ..., 50:] = False  # the second sequence is 50 keys long
    return [
        (
            "worked example",
            {"q": np.array(WORKED_Q), "k": np.array(WORKED_K), "v": np.array(WORKED_V)},
        ),
        (
            "B2 H4 L48 S64 E32 pad+bias+causal(bottom_right)",
            {
                "q": rng.standard_normal((B, H, L, E)),
                "k": rng.standard_normal((B, H, S, E)),
                "v": rng.standard_normal((B, H, S, E)),
                "mask": padding,
                "bias": rng.standard_normal((H, L, S)) * 0.5,
                "is_causal": True,
                "alignment": "bottom_right",
            },
        ),
    ]


def _median_seconds(run: Callable[[], Any], sync: Callable[[Any], None], repeats: int) -> float:
    sync(run())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(
    backend: Backend, dtype: str, case: dict[str, Any], repeats: int = 5
) -> dict[str, Any]:
    """Run one case on one backend/dtype; return its errors, bounds and median time."""
    arrays: dict[str, Any] = {}
    rounded: dict[str, np.ndarray] = {}
    for name in ("q", "k", "v", "bias"):
        if name in case:
            arrays[name] = backend.asarray(case[name], dtype)
            rounded[name] = reference.to_numpy(arrays[name]).astype(np.float64)
    options = {k: v for k, v in case.items() if k not in ("q", "k", "v", "bias", "mask")}
    mask = case.get("mask")
    if mask is not None:
        arrays["mask"] = backend.asarray(mask)

    def run() -> Any:
        return scaled_dot_product_attention(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            mask=arrays.get("mask"),
            bias=arrays.get("bias"),
            return_lse=True,
            **options,
        )

    out, lse = run()
    ref_out, ref_lse = reference.scaled_dot_product_attention(
        rounded["q"],
        rounded["k"],
        rounded["v"],
        mask=mask,
        bias=rounded.get("bias"),
        return_lse=True,
        **options,
    )
    q64, k64, v64 = rounded["q"], rounded["k"], rounded["v"]
    ds = score_error(dtype, q64, k64, 1.0 / np.sqrt(q64.shape[-1]), rounded.get("bias"))
    S = k64.shape[-2]
    got = reference.to_numpy(out).astype(np.float64)
    finite = np.isfinite(ref_lse)
    got_lse = reference.to_numpy(lse).astype(np.float64)
    return {
        "error": float(np.max(np.abs(got - ref_out))),
        "bound": output_bound(
            dtype,
            S=S,
            ds=ds,
            v_max=float(np.abs(v64).max()),
            out_max=float(np.abs(ref_out).max()),
        ),
        "lse_error": float(np.max(np.abs(got_lse[finite] - ref_lse[finite]))),
        "lse_bound": lse_bound(dtype, S=S, ds=ds, lse_max=float(np.abs(ref_lse[finite]).max())),
        "seconds": _median_seconds(lambda: run()[0], backend.synchronize, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    """Print a table of every installed backend and dtype against the oracle.

    Returns the exit status: 0 if every check is within its error bound, 1 if one is not,
    2 if a backend named with ``--backend`` is not available here (unknown ids exit with 2
    through argparse).
    """
    parser = argparse.ArgumentParser(
        prog="python -m sdpa_array demo",
        description="Run the worked example and a random masked batch on every installed "
        "backend and dtype, and compare with the float64 oracle.",
    )
    parser.add_argument(
        "--backend",
        help="comma-separated backend ids, each of which must be available here "
        f"({', '.join(b.id for b in BACKENDS)}); default: every installed one",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    wanted = None
    if args.backend:
        named = parse_backends(parser, args.backend)
        if not report_unavailable(named):
            return 2
        wanted = {b.id for b in named}
    rng = np.random.default_rng(args.seed)
    cases = _cases(rng)

    header = ("backend", "device", "dtype", "case", "max error", "bound", "ok", "time")
    rows: list[tuple[str, ...]] = []
    missing = []
    failures = 0
    for backend in BACKENDS:
        if wanted is not None and backend.id not in wanted:
            continue
        if not backend.is_available():
            missing.append(backend.id)
            continue
        backend.configure()
        for dtype in backend.dtypes:
            for name, case in cases:
                r = run_case(backend, dtype, case)
                ok = r["error"] <= r["bound"] and r["lse_error"] <= r["lse_bound"]
                failures += not ok
                rows.append(
                    (
                        backend.id,
                        backend.device,
                        dtype,
                        name,
                        f"{r['error']:.2e}",
                        f"{r['bound']:.2e}",
                        "yes" if ok else "NO",
                        f"{r['seconds'] * 1e3:.2f} ms",
                    )
                )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))
    if missing:
        print(f"\nnot available here (library or device missing): {', '.join(missing)}")
    print(f"\n{len(rows)} checks, {failures} outside the error bound")
    return 1 if failures else 0
