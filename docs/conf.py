"""Sphinx configuration of the sdpa_array documentation.

Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (the nox session
``docs``), with the package installed with its ``docs``, ``plot`` and ``test`` extras.

Intersphinx links to NumPy, PyTorch and the Array API standard need the network at build
time, which CI does not have; they are switched on only when ``SDPA_DOCS_INTERSPHINX=1``.
"""

from __future__ import annotations

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
]
templates_path = ["_templates"]

# -- API reference -----------------------------------------------------------------------
autosummary_generate = True
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

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
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "abort_on_example_error": True,
    "remove_config_comments": True,
    "min_reported_time": 1,
    "image_scrapers": ("matplotlib",),
}

# -- HTML ----------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"sdpa_array {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_static_path: list[str] = []
