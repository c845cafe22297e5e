"""Forward accuracy against torch's default CPU kernel, as a ratio of errors.

``track_error_ratio`` is our relative RMS error divided by that of
``torch.nn.functional.scaled_dot_product_attention`` (its default kernel), both measured
against the float64 oracle (:mod:`sdpa_array.reference`) on the same inputs rounded once to
the dtype, pooled over :data:`SEEDS` draws. At most 1 means we are as accurate as torch
(``tests/test_accuracy_vs_torch.py`` asserts it, with its tolerances). Shapes: unit logits
and logits ~1e3 (``q`` and ``k`` entries of magnitude 31.6), with a power-of-two scale
(E=64) and an inexact one (E=48). Our inputs are torch tensors on the CPU for ``torch`` and
NumPy arrays for ``numpy``; anything absent raises ``NotImplementedError`` (skipped).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from sdpa_array import reference, scaled_dot_product_attention

from .common import backend_for

SEEDS = 4
#: ``name: (B, H, L, S, E, magnitude of q and k entries)``.
CASES = {
    "E64-unit": (1, 4, 256, 256, 64, 1.0),
    "E64-logits1e3": (1, 4, 256, 256, 64, 31.6),
    "E48-logits1e3": (1, 4, 256, 256, 48, 31.6),
}


def _rounded(torch: Any, case: tuple[int, ...], dtype: str, seed: int) -> list[Any]:
    B, H, L, S, E, magnitude = case
    rng = np.random.default_rng(seed)
    return [
        torch.from_numpy(rng.standard_normal(shape) * m).to(getattr(torch, dtype))
        for shape, m in (((B, H, L, E), magnitude), ((B, H, S, E), magnitude), ((B, H, S, E), 1))
    ]


def _squared_error(x: Any, oracle: Any) -> float:
    """``‖x - oracle‖² / ‖oracle‖²``; pooled over draws, its root is the relative RMS error."""
    return float(np.sum((np.asarray(x, np.float64) - oracle) ** 2) / np.sum(oracle**2))


class AccuracyVersusTorch:
    """Our forward error over torch's default kernel's, on the same rounded inputs."""

    param_names: ClassVar = ["backend", "dtype", "implementation", "case"]
    params: ClassVar = [
        ["numpy", "torch"],
        ["float32", "float16", "bfloat16"],
        ["blocked", "materialized"],
        list(CASES),
    ]
    timeout = 300

    def setup(self, backend_id: str, dtype: str, implementation: str, case: str) -> None:
        try:
            import torch
        except ImportError as exc:
            raise NotImplementedError("torch is not installed") from exc
        backend_for(backend_id, dtype)  # installed, has the dtype, precision pinned
        if backend_id == "numpy" and dtype == "bfloat16":
            raise NotImplementedError("NumPy has no bfloat16")
        self.torch = torch

    def track_error_ratio(
        self, backend_id: str, dtype: str, implementation: str, case: str
    ) -> float:
        torch = self.torch
        ours_sq = torch_sq = 0.0
        for seed in range(SEEDS):
            q, k, v = _rounded(torch, CASES[case], dtype, seed)
            oracle = reference.scaled_dot_product_attention(
                *(t.to(torch.float64).numpy() for t in (q, k, v))
            )
            args = (q, k, v) if backend_id == "torch" else tuple(t.numpy() for t in (q, k, v))
            ours = scaled_dot_product_attention(*args, implementation=implementation)
            if backend_id == "torch":
                ours = ours.to(torch.float64).numpy()
            theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            ours_sq += _squared_error(ours, oracle)
            torch_sq += _squared_error(theirs.to(torch.float64).numpy(), oracle)
        return float((ours_sq / torch_sq) ** 0.5)

    track_error_ratio.unit = "ratio"
