"""Plain-text tables of the experiments' results, as ``python -m sdpa_array experiments``
prints them.

Each experiment has a ``table_*`` function that turns its result into aligned columns and a
note on how to read them; :func:`format_table` and :func:`pattern_text` are the building
blocks. The documentation's gallery prints the same tables.

Examples
--------
>>> from sdpa_array import lab
>>> print(lab.table_patterns(lab.attention_patterns()[:1]))  # doctest: +NORMALIZE_WHITESPACE
causal, L = S = 8   [is_causal=True]
■ · · · · · · ·
■ ■ · · · · · ·
■ ■ ■ · · · · ·
■ ■ ■ ■ · · · ·
■ ■ ■ ■ ■ · · ·
■ ■ ■ ■ ■ ■ · ·
■ ■ ■ ■ ■ ■ ■ ·
■ ■ ■ ■ ■ ■ ■ ■
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .asymmetry import QueryKeyAsymmetry
from .cost import AttentionCost
from .numerical_example import WorkedExample
from .patterns import WeightsPanel
from .scaling import DotProductVariance, GradientFlow, SoftmaxSaturation

__all__ = [
    "format_table",
    "pattern_text",
    "table_asymmetry",
    "table_cost",
    "table_gradient_flow",
    "table_patterns",
    "table_saturation",
    "table_variance",
    "table_worked_example",
]


def _cell(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return f"{float(value):.4g}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned.

    Floats are printed with 4 significant digits, strings as they are.

    Parameters
    ----------
    headers : sequence of str
        Column titles.
    rows : sequence of sequence
        The rows, each with one cell per header: a string (printed as it is), an integer
        (printed in full) or another number (printed with 4 significant digits).

    Returns
    -------
    str
        The header line, a line of dashes under each column, then one line per row, with
        two spaces between columns and no trailing newline.

    Examples
    --------
    >>> print(format_table(["d_k", "var"], [[4, 3.99512], [1024, 1019.3]]))
    d_k     var
    ----  -----
    4     3.995
    1024   1019
    """
    cells = [list(map(str, headers))] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    return "\n".join(
        [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
    )


def table_variance(r: DotProductVariance) -> str:
    """Sample moments of ``q·k`` and ``q·k / sqrt(E)`` against theory and interval.

    Parameters
    ----------
    r : DotProductVariance
        A result of :func:`dot_product_variance`.

    Returns
    -------
    str
        One row per key width, then a note giving ``N`` and the intervals' half-width in
        standard errors.
    """
    lo, hi = r.variance_interval()
    slo, shi = r.variance_interval(scaled=True)
    rows = [
        [
            int(d),
            r.mean[i],
            r.variance[i],
            f"[{lo[i]:.4g}, {hi[i]:.4g}]",
            r.scaled_mean[i],
            r.scaled_variance[i],
            f"[{slo[i]:.4f}, {shi[i]:.4f}]",
        ]
        for i, d in enumerate(r.d_k)
    ]
    head = [
        "E",
        "mean q·k",
        "var q·k",
        f"{r.confidence:.1%} interval (theory E)",
        "mean scaled",
        "var scaled",
        f"{r.confidence:.1%} interval (theory 1)",
    ]
    note = f"N = {r.n_samples} pairs per width E; interval = theory ± {r.z:.2f} standard errors"
    return format_table(head, rows) + "\n" + note


def table_saturation(r: SoftmaxSaturation) -> str:
    """Mean over rows of the peak probability, entropy and Jacobian norm, per variance.

    Parameters
    ----------
    r : SoftmaxSaturation
        A result of :func:`softmax_saturation`.

    Returns
    -------
    str
        One row per variance (with the median Jacobian norm and the mean bound too),
        then a note giving the uniform and one-hot values.
    """
    rows = [
        [
            f"{v:g}",
            r.max_probability[i].mean(),
            r.entropy[i].mean(),
            r.jacobian_norm[i].mean(),
            np.median(r.jacobian_norm[i]),
            r.jacobian_bound[i].mean(),
        ]
        for i, v in enumerate(r.variances)
    ]
    head = ["logit var", "max p", "entropy (nats)", "mean ||J||_F", "median ||J||_F", "bound"]
    n = r.n_positions
    note = (
        f"{r.probabilities.shape[1]} rows of {n} logits per variance; uniform: entropy "
        f"log {n} = {math.log(n):.3f}, ||J||_F = sqrt({n - 1})/{n} = {math.sqrt(n - 1) / n:.4f}; "
        "one-hot: 0. bound = 2 (1 - Σ p²)"
    )
    return format_table(head, rows) + "\n" + note


def table_gradient_flow(r: GradientFlow) -> str:
    """Median (10%-90%) row norm of ``dL/dQ`` per scale, and the mean peak weight.

    Parameters
    ----------
    r : GradientFlow
        A result of :func:`gradient_flow`.

    Returns
    -------
    str
        One row per key width, two columns per scale, then a note giving the
        root-mean-square row norms at the largest width.
    """
    q10, q50, q90 = r.quantile(0.1), r.median, r.quantile(0.9)
    head = ["E"]
    for name in r.scales:
        head += [f"median |dQ_i| ({name})", "max w"]
    rows = []
    for j, d in enumerate(r.d_k):
        row: list[Any] = [int(d)]
        for i in range(len(r.scales)):
            row += [f"{q50[i, j]:.3g} ({q10[i, j]:.2g}-{q90[i, j]:.2g})", r.max_weight[i, j]]
        rows.append(row)
    rms = ", ".join(f"{name}: {r.rms[i, -1]:.3g}" for i, name in enumerate(r.scales))
    note = (
        f"in parentheses: 10% and 90% quantiles over {r.grad_query_norms.shape[-1]} query rows; "
        f"max w: mean largest weight. RMS row norm at d_k = {r.d_k[-1]}: {rms}"
    )
    return format_table(head, rows) + "\n" + note


def table_cost(r: AttentionCost) -> str:
    """Measured times and counted flops of dot-product and additive attention.

    Parameters
    ----------
    r : AttentionCost
        A result of :func:`attention_cost`.

    Returns
    -------
    str
        One row per width (times in milliseconds, their ratio, the three flop counts),
        then a note giving ``n`` and the backend.
    """
    rows = [
        [
            int(d),
            r.dot_seconds[i] * 1e3,
            r.additive_seconds[i] * 1e3,
            r.additive_seconds[i] / r.dot_seconds[i],
            f"{r.dot_flops[i]:.3g}",
            f"{r.additive_flops[i]:.3g}",
            f"{r.additive_naive_flops[i]:.3g}",
        ]
        for i, d in enumerate(r.dims)
    ]
    head = [
        "d",
        "dot ms",
        "additive ms",
        "time ratio",
        "dot flops",
        "additive flops",
        "additive flops, per-pair projections",
    ]
    note = (
        f"n = {r.n} queries and keys, E = E_v = d_a = d, backend {r.backend}, best of "
        "the timed calls. Projecting once leaves O(n d²) projections + O(n² d_a) tanh terms."
    )
    return format_table(head, rows) + "\n" + note


def table_asymmetry(r: QueryKeyAsymmetry) -> str:
    """Row and column sums of both softmaxes and of ``dS``; sums of the gradients.

    Parameters
    ----------
    r : QueryKeyAsymmetry
        A result of :func:`query_key_asymmetry`.

    Returns
    -------
    str
        One row per matrix, then ``max |softmax(S) - softmax(Sᵀ)ᵀ|`` and the norms of
        ``Σ_i dL/dQ_i`` and ``Σ_j dL/dK_j``.
    """
    ds = r.grad_scores
    rows = [
        [
            "softmax(S)",
            r.weights.sum(1).min(),
            r.weights.sum(1).max(),
            r.received.min(),
            r.received.max(),
        ],
        [
            "softmax(Sᵀ)ᵀ",
            r.swapped_weights.T.sum(1).min(),
            r.swapped_weights.T.sum(1).max(),
            r.swapped_weights.T.sum(0).min(),
            r.swapped_weights.T.sum(0).max(),
        ],
        ["dS", ds.sum(1).min(), ds.sum(1).max(), ds.sum(0).min(), ds.sum(0).max()],
    ]
    table = format_table(
        ["matrix", "row sum min", "row sum max", "col sum min", "col sum max"], rows
    )
    note = (
        f"max |softmax(S) - softmax(Sᵀ)ᵀ| = {r.max_swap_difference:.3g}\n"
        f"||Σ_i dL/dQ_i|| = {np.linalg.norm(r.grad_query_sum):.3g}   "
        f"||Σ_j dL/dK_j|| = {np.linalg.norm(r.grad_key_sum):.3g}  (rows of dS sum to 0)"
    )
    return table + "\n" + note


def _matrix_text(name: str, m: np.ndarray) -> str:
    body = "\n".join("  [" + ", ".join(f"{x:.6g}" for x in row) + "]" for row in m)
    return f"{name} =\n{body}"


def table_worked_example(r: WorkedExample) -> str:
    """Every intermediate matrix, then each published figure against the exact value.

    Parameters
    ----------
    r : WorkedExample
        A result of :func:`worked_example`.

    Returns
    -------
    str
        The four matrices, a table with one row per published figure and its verdict
        (``ok`` or ``WRONG``), then the number of wrong figures.
    """
    parts = [
        _matrix_text("Q Kᵀ", r.scores),
        _matrix_text("Q Kᵀ / sqrt(2)", r.scaled),
        _matrix_text("weights = softmax(scaled)", r.weights),
        _matrix_text("output = weights V", r.output),
    ]
    rows = [
        [
            f"{f.matrix}[{f.index[0]}, {f.index[1]}]",
            f.published,
            f"{f.exact:.6g}",
            f.correctly_rounded,
            "ok" if f.consistent else "WRONG",
        ]
        for f in r.published
    ]
    table = format_table(["figure", "published", "exact", "correctly rounded", "verdict"], rows)
    wrong = len(r.discrepancies)
    check = (
        "Each hand-computed (published, rounded) figure of the example against the exact "
        "value: 'ok' if it is the exact value rounded to its own last digit, 'WRONG' if not."
    )
    return "\n".join([*parts, check, table, f"{wrong} published figures are wrong beyond rounding"])


def pattern_text(weights: np.ndarray) -> str:
    """Picture of which keys each query attends: ``■`` where the weight is nonzero, ``·`` not.

    A 3-D ``(H, L, S)`` array is drawn head by head, side by side, followed by the groups of
    heads whose weights are identical (``0=1`` when heads 0 and 1 agree exactly).

    Parameters
    ----------
    weights : numpy.ndarray, shape (L, S) or (H, L, S)
        Attention weights; exact zeros are the keys a query does not attend.

    Returns
    -------
    str
        One line per query with one symbol per key (heads side by side), then, for 3-D
        ``weights``, the line of head groups.

    Examples
    --------
    >>> print(pattern_text(np.array([[1.0, 0.0], [0.5, 0.5]])))
    ■ ·
    ■ ■
    """
    stack = weights if weights.ndim == 3 else weights[None]
    blocks = [[" ".join("■" if w > 0 else "·" for w in row) for row in head] for head in stack]
    text = "\n".join("   ".join(rows) for rows in zip(*blocks, strict=True))
    if weights.ndim == 2:
        return text
    groups: list[list[int]] = []
    for h, head in enumerate(stack):
        match = next((g for g in groups if np.array_equal(stack[g[0]], head)), None)
        if match is None:
            groups.append([h])
        else:
            match.append(h)
    return (
        text + "\nheads by identical weights: " + ", ".join("=".join(map(str, g)) for g in groups)
    )


def table_patterns(panels: Sequence[WeightsPanel]) -> str:
    """The pattern of every panel (rows: queries, columns: keys).

    Parameters
    ----------
    panels : sequence of WeightsPanel
        Panels such as those of :func:`attention_patterns`.

    Returns
    -------
    str
        For each panel its title and call on one line, then its :func:`pattern_text`;
        panels are separated by a blank line.
    """
    return "\n\n".join(f"{p.title}   [{p.call}]\n{pattern_text(p.weights)}" for p in panels)
