"""What a ``score_mod`` costs against the built-in term that computes the same scores.

``score_mod=mods.tanh_softcap(c)`` gives the scores of ``softcap=c`` through the generic
score-function path (the function called on each tile through the checks of
:func:`~sdpa_array._problem.mod_calls.call_mod`, its derivative a second call in the
backward), so the ratio of the two is that path's overhead. NumPy, float32, the blocked
implementation, ``(B, H, L, E) = (1, 8, L, 64)`` (``--length``, default 2048); the forward
and :func:`~sdpa_array.scaled_dot_product_attention_vjp`, and on torch (CPU) autograd with
a score function without a derivative (torch's forward-mode autodiff gives it) against
the same function with its derivative. Rounds interleave the cases
(:func:`sdpa_array.lab.cli.bench.interleaved_times`); each row gives the median, its
min-max and the ratio to the group's peer::

    python asv_benchmarks/studies/score_mod_cost.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import numpy as np

import sdpa_array
from sdpa_array import mods
from sdpa_array.lab.cli.bench import report_groups

CAP = 5.0


def _tanh_cap(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
    import torch

    return torch.tanh(s / CAP) * CAP


def _groups(length: int) -> dict[str, dict[str, Callable[[], Any]]]:
    rng = np.random.default_rng(0)
    shape = (1, 8, length, 64)
    q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    run = {"implementation": "blocked"}
    capped = {"softcap": CAP, **run}
    modded = {"score_mod": mods.tanh_softcap(CAP), **run}
    groups: dict[str, dict[str, Callable[[], Any]]] = {
        "forward": {
            "softcap": lambda: sdpa_array.scaled_dot_product_attention(q, k, v, **capped),
            "score_mod": lambda: sdpa_array.scaled_dot_product_attention(q, k, v, **modded),
        },
        "vjp": {
            "softcap": lambda: sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **capped),
            "score_mod": lambda: sdpa_array.scaled_dot_product_attention_vjp(q, k, v, g, **modded),
        },
    }
    try:
        import torch
    except ImportError:
        return groups
    tq, tk, tv, tg = (torch.from_numpy(a) for a in (q, k, v, g))

    def autograd(score_mod: Any) -> Callable[[], Any]:
        def call() -> Any:
            xs = [x.clone().requires_grad_(True) for x in (tq, tk, tv)]
            out = sdpa_array.scaled_dot_product_attention(*xs, score_mod=score_mod, **run)
            return torch.autograd.grad(out, xs, tg)

        return call

    groups["torch autograd"] = {
        "with derivative": autograd(mods.tanh_softcap(CAP)),
        "autodiff (jvp)": autograd(_tanh_cap),
    }
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--length", type=int, default=2048)
    args = ap.parse_args()
    print(
        f"NumPy {np.__version__}, float32, blocked, (B, H, L, E) = (1, 8, {args.length}, 64), "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    report_groups(_groups(args.length), args.rounds, (15, 16))


if __name__ == "__main__":
    main()
