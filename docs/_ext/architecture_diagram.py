"""The architecture page's picture, drawn at build time from the code.

The layers come from the import contract in ``pyproject.toml`` (the ``layers`` contract
that ``lint-imports`` checks), the way of one call from the list on ``architecture.md``
(the code block named ``call-path``); the picture shows each layer as a band with its
modules, and each step of the call as a numbered mark on its module's band.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def layers() -> list[list[str]]:
    """The layers of the ``layers`` import contract, top first: each a list of modules."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c.get("type") == "layers"]
    return [[m.strip() for m in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def call_path(page: Path) -> list[str]:
    """The dotted names of the page's ``call-path`` code block, in order."""
    text = page.read_text()
    block = text.split(":name: call-path", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def _layer_of(name: str, bands: list[list[str]]) -> tuple[int, str] | None:
    """The band and module of the longest module of ``bands`` that ``name`` lies in."""
    best = None
    for i, band in enumerate(bands):
        for module in band:
            if (name == module or name.startswith(module + ".")) and (
                best is None or len(module) > len(best[1])
            ):
                best = (i, module)
    return best


def draw(out: Path, page: Path) -> None:
    """Draw the layers and the call path into ``out`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = layers()
    steps = call_path(page)
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(bands) + 0.9))
    height = len(bands)
    for i, band in enumerate(bands):
        y = height - 1 - i
        ax.add_patch(plt.Rectangle((0, y + 0.08), 14.6, 0.84, color="#e8eef7", ec="#7a8fb0"))
        label = " | ".join(m.removeprefix("sdpa_array.") for m in band)
        ax.text(0.1, y + 0.5, label, va="center", fontsize=7.5, family="monospace", wrap=True)
    placed: dict[int, int] = {}
    points = []
    for number, step in enumerate(steps, 1):
        found = _layer_of(step, bands)
        if found is None:
            continue
        i = found[0]
        placed[i] = placed.get(i, 0) + 1
        x, y = 11.0 + 0.5 * placed[i], height - 1 - i + 0.5
        points.append((x, y))
        ax.text(x, y, str(number), ha="center", va="center", fontsize=7, color="white",
                bbox={"boxstyle": "circle,pad=0.25", "fc": "#c0392b", "ec": "none"})  # fmt: skip
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], color="#c0392b", lw=0.8,
                alpha=0.5, zorder=0)  # fmt: skip
    ax.set_xlim(0, 14.8)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.set_title("Layers (top imports below) and the way of one forward call (numbered)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
