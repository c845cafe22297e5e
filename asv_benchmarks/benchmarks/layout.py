"""What ``layout="BLHE"`` costs beside the caller's own transpose.

float32 ``(B, L, H, E) = (2, 1024, 8, 64)`` data, on NumPy, torch and JAX (two threads): the
forward with ``layout="BLHE"`` against the default layout given the same data transposed by
the caller within the timed call (a view on NumPy and torch; JAX makes a new array),
interleaved (:data:`ROUNDS` pairs, each in alternating order after a
warm-up). The figure is BLHE / the view, the median of the pairs' ratios: lower is better,
good is at or below 1.05 (the layout is views and a swap of the output's axes, no copy).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

import sdpa_array

#: Interleaved pairs per figure.
ROUNDS = 21
SHAPE = (2, 1024, 8, 64)


def _calls(library: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    rng = np.random.default_rng(0)
    arrays: list[Any] = [rng.standard_normal(SHAPE, dtype=np.float32) for _ in range(3)]
    done: Callable[[Any], Any] = lambda x: x  # noqa: E731
    if library == "torch":
        try:
            import torch
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        torch.set_num_threads(2)
        arrays = [torch.from_numpy(a) for a in arrays]
        swap: Callable[[Any], Any] = lambda a: a.transpose(1, 2)  # noqa: E731
    elif library == "jax":
        try:
            import jax.numpy as jnp
        except ImportError:
            raise NotImplementedError("jax is not installed") from None
        arrays = [jnp.asarray(a) for a in arrays]
        swap = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
        done = lambda x: x.block_until_ready()  # noqa: E731
    else:
        swap = lambda a: np.swapaxes(a, 1, 2)  # noqa: E731
    f = sdpa_array.scaled_dot_product_attention
    return (lambda: done(f(*arrays, layout="BLHE"))), (lambda: done(f(*map(swap, arrays))))


class LayoutCost:
    """``layout="BLHE"`` / the default layout on the caller's own transpose."""

    params: ClassVar = (["numpy", "torch", "jax"],)
    param_names: ClassVar = ["library"]
    timeout = 300

    def setup(self, library: str) -> None:
        sdpa_array.set_num_threads(2)
        self.blhe, self.view = _calls(library)
        for call in (self.blhe, self.view, self.blhe, self.view):
            call()

    def track_blhe_over_transposed_view(self, library: str) -> float:
        """BLHE's time / the transposed call's, median of interleaved pairs; lower is
        better, good is <= 1.05."""
        ratios = []
        for round_ in range(ROUNDS):
            order = ("blhe", "view") if round_ % 2 else ("view", "blhe")
            took = {}
            for name in order:
                start = time.perf_counter()
                (self.blhe if name == "blhe" else self.view)()
                took[name] = time.perf_counter() - start
            ratios.append(took["blhe"] / took["view"])
        return statistics.median(ratios)

    track_blhe_over_transposed_view.unit = "ratio"  # type: ignore[attr-defined]
