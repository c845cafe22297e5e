"""Matplotlib figures of the experiments' results, as ``python -m sdpa_array experiments``
saves them.

Each experiment has a ``draw_*`` function that fills the :class:`matplotlib.figure.Figure` it
is given (and sets its size); the documentation's gallery draws the same figures. This module
imports matplotlib (the ``plot`` extra) only inside the functions that need it, so importing
:mod:`sdpa_array.lab` does not require it.

Examples
--------
>>> from matplotlib.figure import Figure
>>> from sdpa_array import lab
>>> fig = Figure(layout="constrained")
>>> lab.draw_worked_example(lab.worked_example(), fig)
>>> len(fig.axes)
8
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
    "draw_asymmetry",
    "draw_cost",
    "draw_gradient_flow",
    "draw_patterns",
    "draw_saturation",
    "draw_variance",
    "draw_worked_example",
]


def draw_variance(r: DotProductVariance, fig: Any) -> None:
    """Variance of ``q·k`` (log-log, against ``E``), scaled variance and means with intervals.

    Parameters
    ----------
    r : DotProductVariance
        A result of :func:`dot_product_variance`.
    fig : matplotlib.figure.Figure
        The figure to fill; its size is set here.
    """
    fig.set_size_inches(13, 4.2)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    d = r.d_k
    lo, hi = r.variance_interval()
    ax1.fill_between(d, lo, hi, color="C0", alpha=0.25, label=f"{r.confidence:.1%} interval")
    ax1.plot(d, d, "k--", lw=1, label="theory: E")
    ax1.plot(d, r.variance, "o", color="C0", label="sample variance of q·k")
    ax1.plot(d, r.scaled_variance, "s", color="C1", label="sample variance of q·k / sqrt(E)")
    ax1.set(
        xscale="log", yscale="log", xlabel="E", ylabel="variance", title="Var(q·k) grows like E"
    )
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=8)
    slo, shi = r.variance_interval(scaled=True)
    ax2.fill_between(d, slo, shi, color="C1", alpha=0.25, label=f"{r.confidence:.1%} interval")
    ax2.axhline(1.0, color="k", ls="--", lw=1, label="theory: 1")
    ax2.plot(d, r.scaled_variance, "s-", color="C1", label="sample")
    ax2.set(
        xlabel="E",
        ylabel="variance of q·k / sqrt(E)",
        title=f"after scaling: 1 (N = {r.n_samples})",
    )
    ax2.set_xscale("log", base=2)
    ax2.margins(y=0.3)
    ax2.legend(fontsize=7, loc="upper right", ncol=3)
    mlo, mhi = r.mean_interval(scaled=True)
    ax3.fill_between(d, mlo, mhi, color="C2", alpha=0.25, label=f"{r.confidence:.1%} interval")
    ax3.axhline(0.0, color="k", ls="--", lw=1, label="theory: 0")
    ax3.plot(d, r.scaled_mean, "^-", color="C2", label="sample mean of q·k / sqrt(E)")
    ax3.set(xlabel="E", ylabel="mean", title="mean stays 0")
    ax3.set_xscale("log", base=2)
    ax3.margins(y=0.3)
    ax3.legend(fontsize=7, loc="upper right", ncol=3)


def draw_saturation(r: SoftmaxSaturation, fig: Any) -> None:
    """One softmax row per variance, then peak/entropy and the Jacobian norm against variance.

    Parameters
    ----------
    r : SoftmaxSaturation
        A result of :func:`softmax_saturation`.
    fig : matplotlib.figure.Figure
        The figure to fill; its size is set here.
    """
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


def draw_gradient_flow(r: GradientFlow, fig: Any) -> None:
    """Median row norm of ``dL/dQ`` (band: 10%-90%, dotted: RMS) and peak weight against E.

    Parameters
    ----------
    r : GradientFlow
        A result of :func:`gradient_flow`.
    fig : matplotlib.figure.Figure
        The figure to fill; its size is set here.
    """
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
        xlabel="E",
        ylabel="||dL/dQ_i|| over query rows",
        title="gradient reaching Q (band: 10%-90% of rows)",
    )
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=7, ncol=2)
    ax2.set(
        xlabel="E",
        ylabel="mean largest attention weight",
        ylim=(0, 1),
        title="saturation of the weights",
    )
    ax2.set_xscale("log", base=2)
    ax2.legend(fontsize=8)


def draw_cost(r: AttentionCost, fig: Any) -> None:
    """Measured time, counted flops, and the measured against the counted ratio, against ``d``.

    Parameters
    ----------
    r : AttentionCost
        A result of :func:`attention_cost`.
    fig : matplotlib.figure.Figure
        The figure to fill; its size is set here.
    """
    fig.set_size_inches(15, 4.5)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    ax1.plot(r.dims, r.dot_seconds * 1e3, "o-", label="dot-product (sdpa_array)")
    ax1.plot(r.dims, r.additive_seconds * 1e3, "s-", label="additive, projected once")
    ax1.set(
        yscale="log",
        xlabel="d = E = d_a",
        ylabel="time per call (ms)",
        title=f"measured on {r.backend}, n = {r.n}",
    )
    ax2.plot(r.dims, r.dot_flops, "o-", label="dot-product: O(n² d)")
    ax2.plot(r.dims, r.additive_flops, "s-", label="additive, projected once: O(n d² + n² d)")
    ax2.plot(r.dims, r.additive_naive_flops, "^--", label="additive, per pair: O(n² d²)")
    ax2.set(yscale="log", xlabel="d = E = d_a", ylabel="flops", title="counted flops")
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
        xlabel="d = E = d_a",
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


def draw_asymmetry(r: QueryKeyAsymmetry, fig: Any) -> None:
    """The two softmaxes, ``dS`` and its sums, and the summed gradients to ``Q`` and ``K``.

    Parameters
    ----------
    r : QueryKeyAsymmetry
        A result of :func:`query_key_asymmetry`.
    fig : matplotlib.figure.Figure
        The figure to fill; its size is set here.
    """
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


def draw_worked_example(r: WorkedExample, fig: Any) -> None:
    """The four matrices, annotated; red where the published figure is wrong.

    Parameters
    ----------
    r : WorkedExample
        A result of :func:`worked_example`.
    fig : matplotlib.figure.Figure
        The figure to fill; its size is set here.
    """
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
        "The worked example: exact values rounded like the hand-computed figures "
        "(hand-computed in parentheses; red: wrong beyond its rounding)"
    )


def draw_patterns(panels: Sequence[WeightsPanel], fig: Any) -> None:
    """Heatmaps of the weights of each panel; excluded keys in grey.

    A panel with 3-D weights gets one heatmap per query head.

    Parameters
    ----------
    panels : sequence of WeightsPanel
        Panels such as those of :func:`attention_patterns`.
    fig : matplotlib.figure.Figure
        The figure to fill; its size is set here.
    """
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
