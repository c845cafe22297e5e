"""``python -m sdpa_array experiments``: run :mod:`sdpa_array.lab`, print tables, draw figures.

Each experiment of :mod:`sdpa_array.lab` has a ``table_*`` function (plain text with aligned
columns, :mod:`sdpa_array.lab.tables`) and a ``draw_*`` function that fills a given
matplotlib figure (:mod:`sdpa_array.lab.figures`). This command runs them all on one backend,
prints the tables and saves one PNG per experiment; the documentation's gallery calls the
same functions, so the pictures cannot drift apart. Matplotlib (the ``plot`` extra) is
imported only when a figure is drawn.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import lab
from ...testing.backends import BACKENDS, Backend, get_backend
from .backend_choice import report_unavailable

__all__ = ["EXPERIMENTS", "Experiment", "main"]


@dataclass(frozen=True)
class Experiment:
    """One experiment of the ``experiments`` command.

    Attributes
    ----------
    name : str
        File stem of its figure.
    title : str
        Heading printed above its table.
    run : callable
        ``run(backend) -> result``, a function of :mod:`sdpa_array.lab`.
    table : callable
        ``table(result) -> str``.
    draw : callable
        ``draw(result, figure)``.
    """

    name: str
    title: str
    run: Callable[[Backend], Any]
    table: Callable[[Any], str]
    draw: Callable[[Any, Any], None]


EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        "variance",
        "1. Var(q·k) = d_k, and 1 after dividing by sqrt(d_k)",
        lambda b: lab.dot_product_variance(backend=b),
        lab.table_variance,
        lab.draw_variance,
    ),
    Experiment(
        "saturation",
        "2. Softmax saturation and its vanishing Jacobian",
        lambda b: lab.softmax_saturation(backend=b),
        lab.table_saturation,
        lab.draw_saturation,
    ),
    Experiment(
        "gradient_flow",
        "3. The gradient reaching Q, for scales 1, 1/sqrt(E), 1/E",
        lambda b: lab.gradient_flow(backend=b),
        lab.table_gradient_flow,
        lab.draw_gradient_flow,
    ),
    Experiment(
        "dot_vs_additive",
        "4. Dot-product versus additive attention",
        lambda b: lab.attention_cost(backend=b),
        lab.table_cost,
        lab.draw_cost,
    ),
    Experiment(
        "query_key_asymmetry",
        "5. Q and K are not interchangeable",
        lambda b: lab.query_key_asymmetry(backend=b),
        lab.table_asymmetry,
        lab.draw_asymmetry,
    ),
    Experiment(
        "worked_example",
        "6. The worked example",
        lambda b: lab.worked_example(backend=b),
        lab.table_worked_example,
        lab.draw_worked_example,
    ),
    Experiment(
        "attention_patterns",
        "Attention weights under causal, alignment, window, GQA, padding",
        lambda b: lab.attention_patterns(backend=b),
        lab.table_patterns,
        lab.draw_patterns,
    ),
)


def _save(exp: Experiment, result: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(layout="constrained")
    FigureCanvasAgg(fig)
    exp.draw(result, fig)
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sdpa_array experiments",
        description="Run the experiments of sdpa_array.lab (the claims about attention "
        "derived on the documentation's Theory page) on one backend, print their tables and "
        "save one PNG figure per experiment.",
    )
    parser.add_argument("--out", required=True, type=Path, help="directory for the PNG figures")
    parser.add_argument(
        "--backend",
        default="numpy",
        choices=[b.id for b in BACKENDS],
        help="array backend to run on (default: numpy)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m sdpa_array experiments --out DIR [--backend ID]``.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``experiments``; default ``sys.argv[1:]``.

    Returns
    -------
    int
        0 on success, 2 if the backend is not available here.
    """
    args = _parser().parse_args(argv)
    backend = get_backend(args.backend)
    if not report_unavailable([backend]):
        return 2
    backend.configure()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plotting = False
        print(
            "matplotlib is not installed (pip install sdpa_array[plot]): "
            "printing tables only, figures skipped\n"
        )
    else:
        plotting = True
        args.out.mkdir(parents=True, exist_ok=True)
    print(f"backend: {backend.id} ({backend.module} on {backend.device})\n")
    for exp in EXPERIMENTS:
        start = time.perf_counter()
        result = exp.run(backend)
        elapsed = time.perf_counter() - start
        print(f"== {exp.title}  ({elapsed:.2f} s) ==")
        print(exp.table(result))
        if plotting:
            path = args.out / f"{exp.name}.png"
            _save(exp, result, path)
            print(f"figure: {path}")
        print()
    return 0
