"""Sphinx configuration of the sdpa_array documentation.

Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (the nox session
``docs``), with the package installed with its ``docs``, ``plot`` and ``test`` extras.

The built site needs no network: MathJax is served from ``_static/mathjax/`` (copied from the
``sphinx-mathjax-offline`` package of the ``docs`` extra), not from a CDN, and sphinx-gallery
does not write its computation-times pages, which load jQuery and DataTables from CDNs.
Intersphinx links to NumPy, PyTorch and the Array API standard need the network at build
time, which CI does not have; they are switched on only when ``SDPA_DOCS_INTERSPHINX=1``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import sdpa_array

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "sdpa_array"
author = "the sdpa_array developers"
copyright = "2025, the sdpa_array developers"
release = sdpa_array.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
    "sdpa_docs",  # docs/_ext/sdpa_docs.py: pages generated from the code at build time
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "generated/snippets",  # included by other pages, not pages themselves
    "examples",  # sphinx-gallery's sources; auto_examples/ holds the pages
    "performance.md",  # included into implementations.md by sdpa_docs
    "sg_execution_times.rst",
    "auto_examples/sg_execution_times.rst",  # left over by older builds (see below)
]
templates_path = ["_templates"]

# -- API reference -----------------------------------------------------------------------
autosummary_generate = True
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# Every documented function, method and class (the public API, the lab, the oracle and the
# testing helpers) describes each of its parameters and returns, with numpydoc's type
# spellings (a warning, so an error under `-W`, otherwise). The records the library makes
# (BlockMask, Explanation, CacheExplanation) are left out: they document their fields as
# Attributes. The lab's result records and testing's Backend document theirs as Parameters
# instead.
numpydoc_validation_checks = {"PR01", "PR02", "PR03", "PR06", "PR07", "RT01", "RT03"}
numpydoc_validation_exclude = {
    r"\.BlockMask$",
    r"\.Explanation$",
    r"\.CacheExplanation$",
}

# -- maths: MathJax 3, bundled ------------------------------------------------------------


def _mathjax_offline_static() -> Path:
    """The ``static`` folder of ``sphinx-mathjax-offline``, which holds ``mathjax/``.

    The package is used for its files only: listed as an extension, it would copy them itself
    but, not declaring itself parallel-safe, would make ``sphinx-build -j N -W`` fail.
    """
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the docs need the sphinx-mathjax-offline package: pip install -e '.[docs]'"
        )
    static = Path(spec.origin).parent / "static"
    if not (static / "mathjax" / "tex-chtml.js").is_file():
        raise RuntimeError(f"sphinx-mathjax-offline: no mathjax/tex-chtml.js under {static}")
    return static


mathjax_path = "mathjax/tex-chtml.js"  # relative to _static/

# -- MyST ----------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# -- intersphinx (network at build time: opt-in) ---------------------------------------------
if os.environ.get("SDPA_DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "numpy": ("https://numpy.org/doc/stable/", None),
        "torch": ("https://docs.pytorch.org/docs/stable/", None),
        "array-api": ("https://data-apis.org/array-api/latest/", None),
    }

# -- gallery -------------------------------------------------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    # Two sections on one "Examples" page: the recipes first, then the theory, executed.
    "subsection_order": ["examples/recipes", "examples/theory"],
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "abort_on_example_error": True,
    "remove_config_comments": True,
    "min_reported_time": 1,
    "image_scrapers": ("matplotlib",),
    # The sg_execution_times pages load jQuery, Bootstrap and DataTables from CDNs.
    "write_computation_times": False,
}

# -- HTML ----------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"sdpa_array {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    # One header row at 1280 px: the first five pages of the root toctree (Getting started,
    # Examples, API reference, Semantics, Theory), then "More"; links start next to the
    # title, and search is an icon (Ctrl+K) rather than a wide field that wrapped below.
    "header_links_before_dropdown": 5,
    "navbar_align": "left",
    "navbar_persistent": ["search-button"],
}
# Pages with no subpages would show an empty "Section Navigation" column: drop it there.
html_sidebars = {
    page: []
    for page in (
        "index",
        "getting-started",
        "semantics",
        "backends",
        "implementations",
        "distributed",
        "integrations",
        "theory",
    )
}
html_static_path = ["_static", str(_mathjax_offline_static())]
html_css_files = ["sdpa.css"]  # wide tables, long names and signatures: see the file
html_js_files = [("sdpa.js", {"defer": "defer"})]  # break long dotted names after "." / "_"
