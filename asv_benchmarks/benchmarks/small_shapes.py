"""Small and medium shapes: our NumPy call against torch's CPU kernel, and what planning costs.

NumPy float32, 8 heads, E = 64, L = S from 128 to 1024. Each figure is measured in one run,
interleaved (:func:`~benchmarks.history._interleaved`): the same work on torch's kernel
(``torch.nn.functional.scaled_dot_product_attention`` on tensors sharing the NumPy arrays'
memory, torch at :data:`~benchmarks.history.THREADS` threads like ours) is the peer, so the
ratio holds on any CPU where both run their own best kernels. Lower is better: good is at
or below 1.6 at L = S = 512 and 1024.

The planning share is the time :func:`sdpa_array._plan.plan.plan_forward` takes for the
call, as each call runs it (validation, and the plan cache's lookup of a signature it has
seen), over the whole call's time: how much of a small call is not attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

import sdpa_array
from sdpa_array._plan.plan import plan_forward
from sdpa_array._problem.options import Options
from sdpa_array._problem.outputs import Outputs

from .history import _interleaved, _ratio, _threads

try:
    import torch
except ImportError:  # the torch figures are then not measured
    torch = None

#: Rounds per figure (each candidate once per round, in a new order), after a warm-up.
ROUNDS = 9

#: (batch, heads, length, features): the issue's named shapes and the smallest one.
SHAPES = {
    "1x8x128x64": (1, 8, 128, 64),
    "1x8x512x64": (1, 8, 512, 64),
    "8x8x512x64": (8, 8, 512, 64),
    "1x8x1024x64": (1, 8, 1024, 64),
}

#: Calls per candidate per round: a round of about 10 ms or more at every shape.
REPEATS = {"1x8x128x64": 40, "1x8x512x64": 6, "8x8x512x64": 1, "1x8x1024x64": 2}


def _repeated(call: Callable[[], Any], n: int) -> Callable[[], Any]:
    return lambda: [call() for _ in range(n)]


def _arrays(shape: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(SHAPES[shape], dtype=np.float32) for _ in range(3))
    return q, k, v


class SmallShapes:
    """Ours / torch's kernel, and the planning share, per shape."""

    params: ClassVar = [list(SHAPES)]
    param_names: ClassVar = ["shape"]
    timeout = 300

    def setup(self, shape: str) -> None:
        _threads()
        self.q, self.k, self.v = _arrays(shape)
        self.n = REPEATS[shape]

    def track_over_torch(self, shape: str) -> float:
        """Our NumPy call's time / torch's kernel's on the same memory (lower is better)."""
        if torch is None:
            raise NotImplementedError("torch is not installed")
        q, k, v = self.q, self.k, self.v
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        f = sdpa_array.scaled_dot_product_attention
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls = {
            "ours": _repeated(lambda: f(q, k, v), self.n),
            "torch": _repeated(lambda: sdpa(tq, tk, tv), self.n),
        }
        return _ratio(_interleaved(calls, ROUNDS), "ours", "torch")

    track_over_torch.unit = "ratio"  # type: ignore[attr-defined]

    def track_planning_share(self, shape: str) -> float:
        """The planning's time / the whole call's (lower is better)."""
        q, k, v = self.q, self.k, self.v
        f = sdpa_array.scaled_dot_product_attention

        def plan() -> Any:
            options = Options.of({}, where="scaled_dot_product_attention")
            return plan_forward(q, k, v, options, Outputs(), "auto", (None, None))

        n = self.n
        calls = {"plan": _repeated(plan, n), "call": _repeated(lambda: f(q, k, v), n)}
        return _ratio(_interleaved(calls, ROUNDS), "plan", "call")

    track_planning_share.unit = "ratio"  # type: ignore[attr-defined]
