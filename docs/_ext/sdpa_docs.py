"""Pages generated from the code at build time, so that the docs cannot disagree with it.

* ``generated/snippets/backend_table.md``: the backend support table, one row per entry of
  :data:`sdpa_array.testing.backends.BACKENDS`.
* ``generated/snippets/attention_patterns.md``: which keys each query attends under
  ``is_causal``, both alignments, windows, a padding mask and GQA, computed by
  :func:`sdpa_array.lab.attention_patterns` with the library itself.
* ``generated/snippets/implementations.md``: one row per entry of the implementation
  table ``sdpa_array._plan.dispatch.IMPLEMENTATIONS`` (the one private name the docs read),
  described by the docstring of the row's forward kernel and by what the row declares
  (block sizes, a backward kernel for the VJP).
* ``objects.inv`` and cross-references know the public names only: a class that the package
  re-exports from a private module (``sdpa_array.CannotDelegateError``, defined in
  ``sdpa_array._errors``) is not also registered under its private path, which
  autodoc adds as its "canonical" name.
* autosummary tables keep ordinary spaces in their signatures, ``name(query, key, ...)``:
  autosummary's HTML writer makes them non-breaking, which kept the first column on one line
  and pushed the summaries out of the page's column (``docs/_static/sdpa.css`` lays the
  tables out).
* ``generated/history/ratios.png`` and ``generated/snippets/history_machines.md``: the
  performance history drawn from the committed asv results (:mod:`performance_history`);
  the HTML pages ``asv publish`` made (``asv_benchmarks/html``, where present) are copied
  to ``asv/`` in the built site.
* ``implementations``: the line ``% performance.md`` is replaced by an include of
  ``docs/performance.md`` when that file exists, and by a sentence saying it is missing when
  it does not.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.ext.autosummary import autosummary_noop, autosummary_table

PERFORMANCE_MARKER = "% performance.md"

#: The repository's asv folder: the committed results and the published pages.
ASV = Path(__file__).resolve().parents[2] / "asv_benchmarks"


def backend_table() -> str:
    """The support table of the backend registry, as a MyST pipe table."""
    from sdpa_array.testing.backends import BACKENDS

    head = "| id | array library | device | dtypes | install | nox session |"
    rows = [head, "| --- | --- | --- | --- | --- | --- |"]
    for b in BACKENDS:
        install = f"`pip install sdpa_array[{b.extra}]`" if b.extra else "(always)"
        device = f"{b.device} (needs a CUDA GPU)" if b.needs_gpu else b.device
        dtypes = ", ".join(b.dtypes)
        rows.append(
            f"| `{b.id}` | `{b.module}` | {device} | {dtypes} | {install} | `{b.nox_session}` |"
        )
    return "\n".join(rows) + "\n"


def implementations_table() -> str:
    """The ``implementation=`` choices: each row's forward-kernel summary and what it takes."""
    from sdpa_array._plan.dispatch import IMPLEMENTATIONS

    rows = [
        "| `implementation=` | what it does | `block_q`, `block_k` | in the VJP |",
        "| --- | --- | --- | --- |",
        '| `"auto"` (default) | chooses one of the implementations below for the inputs '
        "| if given, `blocked` runs | chooses among those with a backward kernel |",
    ]
    for name, row in IMPLEMENTATIONS.items():
        summary = (inspect.getdoc(row.forward) or "").split("\n")[0]
        blocks = "yes" if row.takes_blocks else "no"
        vjp = "its own backward kernel" if row.backward is not None else "not available"
        rows.append(f'| `"{name}"` | {summary} | {blocks} | {vjp} |')
    return "\n".join(rows) + "\n"


def attention_patterns() -> str:
    """One code block per panel of :func:`sdpa_array.lab.attention_patterns`."""
    from sdpa_array import lab

    parts = []
    for panel in lab.attention_patterns():
        picture = lab.pattern_text(panel.weights)
        parts.append(f"**{panel.title}**: `{panel.call}`\n\n```text\n{picture}\n```\n")
    return "\n".join(parts)


def _write_snippets(app: Sphinx) -> None:
    out = Path(app.srcdir) / "generated" / "snippets"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("backend_table.md", backend_table()),
        ("attention_patterns.md", attention_patterns()),
        ("implementations.md", implementations_table()),
    ):
        path = out / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    import performance_history

    performance_history.write(ASV / "results", Path(app.srcdir) / "generated")


def _copy_asv_pages(app: Sphinx, exception: Exception | None) -> None:
    """The pages of ``asv publish``, where they were made, under ``asv/`` in the site."""
    pages = ASV / "html"
    if exception is None and app.builder.format == "html" and (pages / "index.html").exists():
        shutil.copytree(pages, Path(app.outdir) / "asv", dirs_exist_ok=True)


def _include_performance(app: Sphinx, docname: str, source: list[str]) -> None:
    if docname != "implementations":
        return
    if (Path(app.srcdir) / "performance.md").exists():
        block = "```{include} performance.md\n:heading-offset: 1\n```"
    else:
        block = "*The performance report (`docs/performance.md`) has not been written yet.*"
    source[0] = source[0].replace(PERFORMANCE_MARKER, block)


def _visit_autosummary_table(translator: Any, node: Any) -> None:
    """Write the table as it is (autosummary's own visitor makes its spaces non-breaking)."""


def _is_private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _drop_private_aliases(app: Sphinx, env: BuildEnvironment) -> list[str]:
    """Forget the private-path aliases (``:canonical:``) of documented public objects."""
    objects = env.get_domain("py").objects  # type: ignore[attr-defined]
    for name in [n for n, entry in objects.items() if entry.aliased and _is_private(n)]:
        del objects[name]
    return []


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", _write_snippets)
    app.connect("source-read", _include_performance)
    app.connect("env-updated", _drop_private_aliases)
    app.connect("build-finished", _copy_asv_pages)
    app.add_node(
        autosummary_table, override=True, html=(_visit_autosummary_table, autosummary_noop)
    )
    return {"parallel_read_safe": True, "parallel_write_safe": True}
