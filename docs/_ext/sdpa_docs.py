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
* ``generated/performance/*.png`` and ``generated/snippets/performance_*.md``: the
  performance page's figures (time against sequence length, accuracy against torch,
  document masks against sparsity) with their numbers, machines and versions, drawn from
  the committed asv results (:mod:`performance_figures`).
* API pages (``generated/``): the secondary sidebar ("On this page") lists the object's
  Parameters, Returns and Examples sections (numpydoc renders them as a field list and a
  rubric, which are not headings), and the main entry points (:data:`EXAMPLES_FIRST`)
  show their Examples right after the summary, before the parameters.
* ``implementations``: the line ``% performance.md`` is replaced by an include of
  ``docs/performance.md`` when that file exists, and by a sentence saying it is missing when
  it does not.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
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
        install = f'`pip install -e ".[{b.extra}]"`' if b.extra else "(always)"
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
    import architecture_diagram
    import performance_figures
    import performance_history

    performance_history.write(ASV / "results", Path(app.srcdir) / "generated")
    performance_figures.write(ASV / "results", Path(app.srcdir) / "generated")
    generated = Path(app.srcdir) / "generated" / "architecture" / "layers.png"
    architecture_diagram.draw(generated, Path(app.srcdir) / "architecture.md")


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


#: The main entry points: their pages show the Examples before the Parameters (numpydoc
#: renders the sections in a fixed order, Examples last).
EXAMPLES_FIRST = frozenset(
    {
        "sdpa_array.scaled_dot_product_attention",
        "sdpa_array.scaled_dot_product_attention_vjp",
        "sdpa_array.scaled_dot_product_attention_varlen",
        "sdpa_array.attention_with_kv_cache",
        "sdpa_array.multi_head_attention",
        "sdpa_array.create_block_mask",
    }
)

#: The numpydoc sections an API page's "On this page" column links to, in their order.
TOC_SECTIONS = ("Parameters", "Attributes", "Returns", "Examples")


def _examples_first(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Move numpydoc's rendered Examples rubric of a main entry point before its field
    lists (runs after numpydoc's own handler)."""
    if name not in EXAMPLES_FIRST or ".. rubric:: Examples" not in lines:
        return
    start = lines.index(".. rubric:: Examples")
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if lines[i].startswith((".. rubric::", ".. only::", ".. !! processed"))
        ),
        len(lines),
    )
    fields = next((i for i, line in enumerate(lines) if line.startswith(":Parameters:")), None)
    if fields is None or fields > start:
        return
    block = lines[start:end]
    del lines[start:end]
    lines[fields:fields] = [*block, ""]


def _sections(content: nodes.Element) -> list[tuple[str, nodes.Element]]:
    """The :data:`TOC_SECTIONS` of an object's description, in its order, with their
    nodes: numpydoc's fields (``:Parameters:``, ``:Returns:``, consecutive ones in one
    field list) and rubrics (``Examples``)."""
    found = []
    for child in content.children:
        if isinstance(child, nodes.rubric):
            found.append((child.astext(), child))
        elif isinstance(child, nodes.field_list):
            found += [(field.children[0].astext(), field) for field in child.children]
    return [(title, node) for title, node in found if title in TOC_SECTIONS]


def _api_page_toc(app: Sphinx, doctree: nodes.document) -> None:
    """Anchor the sections of an API page's object and list them, in the page's order, in
    its local toc after the object's own entry."""
    docname = app.env.docname
    toc = app.env.tocs.get(docname)
    if not docname.startswith("generated/") or toc is None:
        return
    top = [
        d for d in doctree.findall(addnodes.desc) if not isinstance(d.parent, addnodes.desc_content)
    ]
    inner = next((b for b in toc.findall(nodes.bullet_list) if b is not toc), None)
    if len(top) != 1 or inner is None:
        return
    content = next(c for c in top[0].children if isinstance(c, addnodes.desc_content))
    found: dict[str, str] = {}
    for title, node in _sections(content):
        if title not in found:
            found[title] = f"section-{title.lower()}"
            node["ids"].append(found[title])
    for title, anchor in found.items():
        reference = nodes.reference(
            "", title, internal=True, refuri=docname, anchorname=f"#{anchor}"
        )
        inner += nodes.list_item("", addnodes.compact_paragraph("", "", reference))


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
    app.connect("autodoc-process-docstring", _examples_first, priority=600)
    app.connect("doctree-read", _api_page_toc, priority=900)
    app.connect("build-finished", _copy_asv_pages)
    app.add_node(
        autosummary_table, override=True, html=(_visit_autosummary_table, autosummary_noop)
    )
    return {"parallel_read_safe": True, "parallel_write_safe": True}
