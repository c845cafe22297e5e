"""``python -m sdpa_array explain``: run :mod:`sdpa_array.lab`, print tables, draw figures.

Each experiment of :mod:`sdpa_array.lab` has here a ``table_*`` function (plain text with
aligned columns) and a ``draw_*`` function that fills a given matplotlib figure. The command
line runs them all on one backend and saves one PNG per experiment; the documentation's
gallery calls the same functions, so the pictures cannot drift apart. Matplotlib (the
``plot`` extra) is imported only when a figure is drawn.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import lab
from .backends import BACKENDS, Backend, get_backend

__all__ = ["EXPERIMENTS", "Experiment", "format_table", "main", "pattern_text"]


# --------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return f"{float(value):.4g}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned.

    Floats are printed with 4 significant digits, strings as they are.

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


def table_variance(r: lab.DotProductVariance) -> str:
    """Sample moments of ``q·k`` and ``q·k / sqrt(d_k)`` against theory and interval."""
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
        "d_k",
        "mean q·k",
        "var q·k",
        f"{r.confidence:.1%} interval (theory d_k)",
        "mean scaled",
        "var scaled",
        f"{r.confidence:.1%} interval (theory 1)",
    ]
    note = f"N = {r.n_samples} pairs per d_k; interval = theory ± {r.z:.2f} standard errors"
    return format_table(head, rows) + "\n" + note


def table_saturation(r: lab.SoftmaxSaturation) -> str:
    """Mean over rows of the peak probability, entropy and Jacobian norm, per variance."""
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


def table_gradient_flow(r: lab.GradientFlow) -> str:
    """Median (10%-90%) row norm of ``dL/dQ`` per scale, and the mean peak weight."""
    q10, q50, q90 = r.quantile(0.1), r.median, r.quantile(0.9)
    head = ["d_k"]
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


def table_cost(r: lab.AttentionCost) -> str:
    """Measured times and counted flops of dot-product and additive attention."""
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
        f"n = {r.n} queries and keys, d_k = d_v = d_a = d, backend {r.backend}, best of "
        "the timed calls. Projecting once leaves O(n d²) projections + O(n² d_a) tanh terms."
    )
    return format_table(head, rows) + "\n" + note


def table_asymmetry(r: lab.QueryKeyAsymmetry) -> str:
    """Row and column sums of both softmaxes and of ``dS``; sums of the gradients."""
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


def table_worked_example(r: lab.WorkedExample) -> str:
    """Every intermediate matrix, then each published figure against the exact value."""
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
    return (
        "\n".join(parts) + "\n" + table + f"\n{wrong} published figures are wrong beyond rounding"
    )


def pattern_text(weights: np.ndarray) -> str:
    """Picture of which keys each query attends: ``■`` where the weight is nonzero, ``·`` not.

    A 3-D ``(H, L, S)`` array is drawn head by head, side by side, followed by the groups of
    heads whose weights are identical (``0=1`` when heads 0 and 1 agree exactly).

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


def table_patterns(panels: Sequence[lab.WeightsPanel]) -> str:
    """The pattern of every panel (rows: queries, columns: keys)."""
    return "\n\n".join(f"{p.title}   [{p.call}]\n{pattern_text(p.weights)}" for p in panels)


# --------------------------------------------------------------------------------------
# figures (each draw_* fills the figure it is given and sets its size)
# --------------------------------------------------------------------------------------


def draw_variance(r: lab.DotProductVariance, fig: Any) -> None:
    """Variance of ``q·k`` (log-log, against ``d_k``), scaled variance and means with intervals."""
    fig.set_size_inches(13, 4.2)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    d = r.d_k
    lo, hi = r.variance_interval()
    ax1.fill_between(d, lo, hi, color="C0", alpha=0.25, label=f"{r.confidence:.1%} interval")
    ax1.plot(d, d, "k--", lw=1, label="theory: d_k")
    ax1.plot(d, r.variance, "o", color="C0", label="sample variance of q·k")
    ax1.plot(d, r.scaled_variance, "s", color="C1", label="sample variance of q·k / sqrt(d_k)")
    ax1.set(
        xscale="log", yscale="log", xlabel="d_k", ylabel="variance", title="Var(q·k) grows like d_k"
    )
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=8)
    slo, shi = r.variance_interval(scaled=True)
    ax2.fill_between(d, slo, shi, color="C1", alpha=0.25, label=f"{r.confidence:.1%} interval")
    ax2.axhline(1.0, color="k", ls="--", lw=1, label="theory: 1")
    ax2.plot(d, r.scaled_variance, "s-", color="C1", label="sample")
    ax2.set(
        xlabel="d_k",
        ylabel="variance of q·k / sqrt(d_k)",
        title=f"after scaling: 1 (N = {r.n_samples})",
    )
    ax2.set_xscale("log", base=2)
    ax2.margins(y=0.3)
    ax2.legend(fontsize=7, loc="upper right", ncol=3)
    mlo, mhi = r.mean_interval(scaled=True)
    ax3.fill_between(d, mlo, mhi, color="C2", alpha=0.25, label=f"{r.confidence:.1%} interval")
    ax3.axhline(0.0, color="k", ls="--", lw=1, label="theory: 0")
    ax3.plot(d, r.scaled_mean, "^-", color="C2", label="sample mean of q·k / sqrt(d_k)")
    ax3.set(xlabel="d_k", ylabel="mean", title="mean stays 0")
    ax3.set_xscale("log", base=2)
    ax3.margins(y=0.3)
    ax3.legend(fontsize=7, loc="upper right", ncol=3)


def draw_saturation(r: lab.SoftmaxSaturation, fig: Any) -> None:
    """One softmax row per variance, then peak/entropy and the Jacobian norm against variance."""
    fig.set_size_inches(15, 7.5)
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1.25])
    bars = top.subplots(1, len(r.variances), sharey=True)
    positions = np.arange(r.n_positions)
    for ax, v, p in zip(bars, r.variances, r.probabilities[:, 0, :], strict=True):
        ax.bar(positions, p, width=1.0, color="C0")
        ax.set_title(f"var {v:g}: max p = {p.max():.2f}", fontsize=9)
        ax.set_xlabel("position")
    bars[0].set_ylabel("probability")
    top.suptitle(f"softmax of one row of {r.n_positions} logits, rescaled to each variance")
    ax1, ax2, ax3 = bottom.subplots(1, 3)
    v = r.variances
    ax1.plot(v, r.max_probability.mean(1), "o-", label="mean max p")
    ax1.set(xlabel="logit variance", ylabel="max probability", title="the peak grows ...")
    ax1b = ax1.twinx()
    ax1b.plot(v, r.entropy.mean(1), "s-", color="C1", label="mean entropy")
    ax1b.set_ylabel("entropy (nats)", color="C1")
    ax1.legend(loc="center right", fontsize=8)
    ax1b.legend(loc="lower right", fontsize=8)
    q10, q50, q90 = np.quantile(r.jacobian_norm, [0.1, 0.5, 0.9], axis=1)
    ax2.fill_between(v, q10, q90, alpha=0.25, color="C3", label="10%-90% of rows")
    ax2.plot(v, r.jacobian_norm.mean(1), "o-", color="C3", label="mean ||diag(p) - p pᵀ||_F")
    ax2.plot(v, q50, "--", color="C3", lw=1, label="median")
    ax2.axhline(
        math.sqrt(r.n_positions - 1) / r.n_positions, color="k", ls=":", lw=1, label="uniform p"
    )
    ax2.set(
        xlabel="logit variance",
        ylabel="Frobenius norm of the Jacobian",
        title="... and the Jacobian shrinks once the mass concentrates",
    )
    ax2.legend(fontsize=8)
    gap = np.maximum(1.0 - r.max_probability, 1e-300).ravel()
    sc = ax3.scatter(
        gap,
        r.jacobian_norm.ravel(),
        c=np.repeat(v, r.jacobian_norm.shape[1]),
        s=6,
        cmap="viridis",
        norm="log",
    )
    grid = np.geomspace(max(gap.min(), 1e-12), 1.0, 50)
    ax3.plot(grid, 4 * grid, "k--", lw=1, label="bound 4 (1 - max p)")
    ax3.set(
        xscale="log",
        yscale="log",
        xlabel="1 - max p",
        ylabel="||J||_F",
        title="one-hot rows: Jacobian -> 0",
    )
    ax3.legend(fontsize=8)
    bottom.colorbar(sc, ax=ax3, label="logit variance")


def draw_gradient_flow(r: lab.GradientFlow, fig: Any) -> None:
    """Median row norm of ``dL/dQ`` (band: 10%-90%, dotted: RMS) and peak weight against d_k."""
    fig.set_size_inches(12, 4.5)
    ax1, ax2 = fig.subplots(1, 2)
    q10, q50, q90, rms = r.quantile(0.1), r.median, r.quantile(0.9), r.rms
    for i, name in enumerate(r.scales):
        color = f"C{i}"
        ax1.fill_between(r.d_k, q10[i], q90[i], color=color, alpha=0.2)
        ax1.plot(r.d_k, q50[i], "o-", color=color, label=f"scale {name}: median")
        ax1.plot(r.d_k, rms[i], ":", color=color, label=f"scale {name}: RMS")
        ax2.plot(r.d_k, r.max_weight[i], "o-", color=color, label=f"scale {name}")
    ax1.set(
        yscale="log",
        xlabel="d_k",
        ylabel="||dL/dQ_i|| over query rows",
        title="gradient reaching Q (band: 10%-90% of rows)",
    )
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=7, ncol=2)
    ax2.set(
        xlabel="d_k",
        ylabel="mean largest attention weight",
        ylim=(0, 1),
        title="saturation of the weights",
    )
    ax2.set_xscale("log", base=2)
    ax2.legend(fontsize=8)


def draw_cost(r: lab.AttentionCost, fig: Any) -> None:
    """Measured time, counted flops, and the measured against the counted ratio, against ``d``."""
    fig.set_size_inches(15, 4.5)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    ax1.plot(r.dims, r.dot_seconds * 1e3, "o-", label="dot-product (sdpa_array)")
    ax1.plot(r.dims, r.additive_seconds * 1e3, "s-", label="additive, projected once")
    ax1.set(
        yscale="log",
        xlabel="d = d_k = d_a",
        ylabel="time per call (ms)",
        title=f"measured on {r.backend}, n = {r.n}",
    )
    ax2.plot(r.dims, r.dot_flops, "o-", label="dot-product: O(n² d)")
    ax2.plot(r.dims, r.additive_flops, "s-", label="additive, projected once: O(n d² + n² d)")
    ax2.plot(r.dims, r.additive_naive_flops, "^--", label="additive, per pair: O(n² d²)")
    ax2.set(yscale="log", xlabel="d = d_k = d_a", ylabel="flops", title="counted flops")
    ax3.plot(
        r.dims, r.additive_seconds / r.dot_seconds, "o-", color="C3", label="measured time ratio"
    )
    ax3.plot(
        r.dims,
        r.additive_flops / r.dot_flops,
        "s--",
        color="C1",
        label="flop ratio (projected once)",
    )
    ax3.set(
        yscale="log",
        xlabel="d = d_k = d_a",
        ylabel="additive / dot-product",
        title="measured time ratio against flop ratio",
    )
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)


def _heatmap(ax: Any, m: np.ndarray, title: str, *, diverging: bool = False) -> Any:
    if diverging:
        lim = float(np.max(np.abs(m))) or 1.0
        im = ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim)
    else:
        im = ax.imshow(m, cmap="viridis", vmin=0.0)
    ax.set_title(title, fontsize=9)
    return im


def draw_asymmetry(r: lab.QueryKeyAsymmetry, fig: Any) -> None:
    """The two softmaxes, ``dS`` and its sums, and the summed gradients to ``Q`` and ``K``."""
    fig.set_size_inches(14, 8)
    axes = fig.subplots(2, 3)
    n = r.weights.shape[0]
    for ax, m, title in (
        (axes[0, 0], r.weights, "softmax(S): rows sum to 1"),
        (axes[0, 1], r.swapped_weights.T, "softmax(Sᵀ)ᵀ: columns sum to 1"),
    ):
        im = _heatmap(ax, m, title)
        ax.set(xlabel="key j", ylabel="query i")
        fig.colorbar(im, ax=ax, label="weight")
    idx = np.arange(n)
    axes[0, 2].bar(idx, r.received, color="C0")
    axes[0, 2].axhline(1.0, color="k", ls="--", lw=1)
    axes[0, 2].set(
        xlabel="key j",
        ylabel="Σ_i softmax(S)_ij",
        title="attention each key receives (not normalized)",
    )
    im = _heatmap(axes[1, 0], r.grad_scores, "dS = P ∘ (dP - rowsum(dP ∘ P))", diverging=True)
    axes[1, 0].set(xlabel="key j", ylabel="query i")
    fig.colorbar(im, ax=axes[1, 0], label="dL/dS")
    row_sums = r.grad_scores.sum(1)
    _paired_bars(
        axes[1, 1],
        (row_sums, "row sums (queries)"),
        (r.grad_scores.sum(0), "column sums (keys)"),
        note=f"max |row sum| = {np.abs(row_sums).max():.1e}",
    )
    axes[1, 1].set(xlabel="index", ylabel="sum of dS", title="rows of dS sum to 0, columns do not")
    _paired_bars(
        axes[1, 2],
        (r.grad_query_sum, "Σ_i dL/dQ_i = scale · 1ᵀ dS K"),
        (r.grad_key_sum, "Σ_j dL/dK_j = scale · 1ᵀ dSᵀ Q"),
        note=f"||Σ_j dL/dK_j|| = {np.linalg.norm(r.grad_key_sum):.1e}",
    )
    axes[1, 2].set(
        xlabel="component",
        ylabel="summed gradient",
        title="summed over rows: key gradients cancel,\nquery gradients do not",
    )


def _paired_bars(
    ax: Any, left: tuple[np.ndarray, str], right: tuple[np.ndarray, str], *, note: str
) -> None:
    """Two bar series side by side, with a note in the lower left corner."""
    x = np.arange(len(left[0]))
    ax.bar(x - 0.2, left[0], width=0.4, label=left[1])
    ax.bar(x + 0.2, right[0], width=0.4, label=right[1])
    ax.text(0.02, 0.02, note, transform=ax.transAxes, fontsize=8)
    ax.legend(fontsize=7, loc="upper left")


def draw_worked_example(r: lab.WorkedExample, fig: Any) -> None:
    """The four matrices, annotated; red where the published figure is wrong."""
    fig.set_size_inches(15, 3.8)
    axes = fig.subplots(1, 4)
    published = {(f.matrix, f.index): f for f in r.published}
    for ax, name, m, title in (
        (axes[0], "scores", r.scores, "Q Kᵀ"),
        (axes[1], "scaled", r.scaled, "Q Kᵀ / sqrt(2)"),
        (axes[2], "weights", r.weights, "weights (published)"),
        (axes[3], "output", r.output, "output (published)"),
    ):
        im = ax.imshow(m, cmap="Blues")
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set(
            title=title,
            xlabel="column",
            ylabel="row",
            xticks=range(m.shape[1]),
            yticks=range(m.shape[0]),
        )
        for (i, j), x in np.ndenumerate(m):
            f = published.get((name, (i, j)))
            text = f"{x:.4g}" if f is None else f"{f.correctly_rounded}\n({f.published})"
            color = "red" if f is not None and not f.consistent else "black"
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=8,
                color=color,
                bbox={"facecolor": "white", "alpha": 0.7, "lw": 0},
            )
    fig.suptitle(
        "Design note 001's example: exact values rounded like the published figures "
        "(published in parentheses; red: wrong beyond its rounding)"
    )


def draw_patterns(panels: Sequence[lab.WeightsPanel], fig: Any) -> None:
    """Heatmaps of the weights of each panel; excluded keys in grey."""
    import matplotlib as mpl

    maps = [(p.title, p.weights) for p in panels if p.weights.ndim == 2]
    for p in panels:
        if p.weights.ndim == 3:
            maps += [(f"{p.title}\nquery head {h}", w) for h, w in enumerate(p.weights)]
    cols = math.ceil(len(maps) / 2)
    fig.set_size_inches(3.2 * cols, 7)
    axes = fig.subplots(2, cols).ravel()
    cmap = mpl.colormaps["viridis"].with_extremes(bad="0.85")
    im = None
    for ax, (title, w) in zip(axes, maps, strict=False):
        im = ax.imshow(np.ma.masked_equal(w, 0.0), cmap=cmap, vmin=0.0, vmax=1.0)
        ax.set_title(title, fontsize=8)
        ax.set(xlabel="key", ylabel="query", xticks=range(w.shape[1]), yticks=range(w.shape[0]))
        ax.tick_params(labelsize=6)
    for ax in axes[len(maps) :]:
        ax.set_axis_off()
    fig.colorbar(im, ax=axes.tolist(), label="attention weight (grey: excluded)", shrink=0.6)
    fig.suptitle("scaled_dot_product_attention(..., return_weights=True)")


# --------------------------------------------------------------------------------------
# registry and command line
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Experiment:
    """One experiment of the ``explain`` command.

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
        table_variance,
        draw_variance,
    ),
    Experiment(
        "saturation",
        "2. Softmax saturation and its vanishing Jacobian",
        lambda b: lab.softmax_saturation(backend=b),
        table_saturation,
        draw_saturation,
    ),
    Experiment(
        "gradient_flow",
        "3. The gradient reaching Q, for scales 1, 1/sqrt(d_k), 1/d_k",
        lambda b: lab.gradient_flow(backend=b),
        table_gradient_flow,
        draw_gradient_flow,
    ),
    Experiment(
        "dot_vs_additive",
        "4. Dot-product versus additive attention",
        lambda b: lab.attention_cost(backend=b),
        table_cost,
        draw_cost,
    ),
    Experiment(
        "query_key_asymmetry",
        "5. Q and K are not interchangeable",
        lambda b: lab.query_key_asymmetry(backend=b),
        table_asymmetry,
        draw_asymmetry,
    ),
    Experiment(
        "worked_example",
        "6. The worked example of design note 001",
        lambda b: lab.worked_example(backend=b),
        table_worked_example,
        draw_worked_example,
    ),
    Experiment(
        "attention_patterns",
        "Attention weights under causal, alignment, window, GQA, padding",
        lambda b: lab.attention_patterns(backend=b),
        table_patterns,
        draw_patterns,
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
        prog="python -m sdpa_array explain",
        description="Run the experiments of sdpa_array.lab (the design notes' claims about "
        "attention) on one backend, print their tables and save one PNG figure per experiment.",
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
    """Entry point of ``python -m sdpa_array explain --out DIR [--backend ID]``.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``explain``; default ``sys.argv[1:]``.

    Returns
    -------
    int
        0 on success, 2 if the backend is not available here.
    """
    args = _parser().parse_args(argv)
    backend = get_backend(args.backend)
    if not backend.is_available():
        extra = f" (pip install sdpa_array[{backend.extra}])" if backend.extra else ""
        print(f"backend {backend.id!r} is not available on this machine{extra}", file=sys.stderr)
        return 2
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
