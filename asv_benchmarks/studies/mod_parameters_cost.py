"""What the gradients of a bias or score function's parameters cost in the backward pass.

:func:`~sdpa_array.scaled_dot_product_attention_vjp` with ``bias_mod=mods.alibi(slopes)``,
``mods.relative_position_bias(table, num_buckets=32, max_distance=128)`` or
``score_mod=mods.temperature(values)``, with and without ``return_mod_gradients=True``: the
difference is the tiles' parameter cotangents (ALiBi: one product and a sum per head; T5:
the buckets' one-hot product; temperature: a copy of the scaled scores, one product and a
sum per head). NumPy, float32,
the blocked implementation, ``(B, H, L, E) = (1, 8, L, 64)`` (``--length``, default 2048),
causal. Rounds interleave the cases (:func:`sdpa_array.lab.cli.bench.interleaved_times`);
each row gives the median, its min-max and the ratio to the call without the gradients::

    python asv_benchmarks/studies/mod_parameters_cost.py --rounds 5
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


def _groups(length: int) -> dict[str, dict[str, Callable[[], Any]]]:
    rng = np.random.default_rng(0)
    shape = (1, 8, length, 64)
    q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    tables = {
        "alibi": {"bias_mod": mods.alibi(mods.alibi_slopes(8).astype(np.float32))},
        "t5": {
            "bias_mod": mods.relative_position_bias(
                rng.standard_normal((8, 32), dtype=np.float32), num_buckets=32, max_distance=128
            )
        },
        "temperature": {"score_mod": mods.temperature(np.linspace(0.5, 2.0, 8, dtype=np.float32))},
    }
    groups: dict[str, dict[str, Callable[[], Any]]] = {}
    for name, trained in tables.items():
        run = {**trained, "is_causal": True, "implementation": "blocked"}

        def vjp(with_gradients: bool, run: dict[str, Any] = run) -> Callable[[], Any]:
            def call() -> Any:
                return sdpa_array.scaled_dot_product_attention_vjp(
                    q, k, v, g, return_mod_gradients=with_gradients, **run
                )

            return call

        groups[name] = {"without": vjp(False), "with gradients": vjp(True)}
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--length", type=int, default=2048)
    args = ap.parse_args()
    print(
        f"NumPy {np.__version__}, float32, blocked, causal, (B, H, L, E) = "
        f"(1, 8, {args.length}, 64), {args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    report_groups(_groups(args.length), args.rounds, (6, 15))


if __name__ == "__main__":
    main()
