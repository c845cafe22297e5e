"""The documentation's promises: every public function shows how it is called, and the
landing page's code runs."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The public namespaces whose callables (functions and classes) the API reference lists.
PUBLIC_MODULES = ("sdpa_array", "sdpa_array.mods", "sdpa_array.reference", "sdpa_array.testing")

#: The integrations import their framework (torch, transformers, flax), which the sessions
#: without it lack: their functions' docstrings are read from the source instead.
INTEGRATION_FILES = ("sdpa_array/integrations/transformers.py", "sdpa_array/integrations/flax.py")

#: A numpydoc "Examples" section holding at least one doctest line.
EXAMPLES = re.compile(r"^Examples\n-{8,}\n(?:.*\n)*?>>> ", flags=re.M)


def has_examples(doc: str | None) -> bool:
    """Whether a docstring (``inspect.getdoc``'s dedented text) has an Examples section with
    a doctest in it."""
    return bool(EXAMPLES.search((doc or "") + "\n"))


def public_callables() -> list[tuple[str, object]]:
    """``(qualified name, object)`` of every function and class in the public ``__all__``."""
    found = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not inspect.ismodule(obj):
                found.append((f"{module_name}.{name}", obj))
    return found


def integration_docstrings() -> list[tuple[str, str | None]]:
    """``(qualified name, docstring)`` of the functions in each integration's ``__all__``."""
    found = []
    for path in INTEGRATION_FILES:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        exported: list[str] = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exported = list(ast.literal_eval(node.value))
        functions = {
            node.name: ast.get_docstring(node)
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        }
        module = path.removesuffix(".py").replace("/", ".")
        found += [(f"{module}.{name}", functions[name]) for name in exported if name in functions]
    return found


def test_every_public_callable_has_examples():
    names = [name for name, _ in public_callables()]
    assert "sdpa_array.create_block_mask" in names  # the walk found the API
    missing = [name for name, obj in public_callables() if not has_examples(inspect.getdoc(obj))]
    assert missing == []


def test_every_integration_function_has_examples():
    found = integration_docstrings()
    assert {name.rsplit(".", 1)[1] for name, _ in found} >= {
        "register",
        "attention_forward",
        "attention_fn",
    }
    assert [name for name, doc in found if not has_examples(doc)] == []


def test_examples_pattern_needs_the_heading_and_a_doctest():
    assert has_examples("Summary.\n\nExamples\n--------\n>>> f(1)\n2")
    assert has_examples("Summary.\n\nExamples\n--------\nSome words first:\n\n>>> f(1)")
    assert not has_examples("Summary.\n\nExamples\n--------\nNone yet.")
    assert not has_examples("Summary.\n\n>>> f(1)\n2")  # a doctest, but no section
    assert not has_examples(None)


#: Libraries whose examples the docstrings mark ``# doctest: +SKIP`` (the NumPy session,
#: which runs the doctests, does not have them): an example that imports one starts its
#: group, which runs here where the library is installed.
SKIPPED_LIBRARIES = ("torch", "jax")


def skipped_examples(obj: object, library: str) -> doctest.DocTest:
    """The doctest of ``obj``'s docstring with its NumPy examples and those marked
    ``+SKIP`` after ``import library``, the marks taken off."""
    test = doctest.DocTestFinder(recurse=False).find(obj)[0]
    kept, group = [], None
    for example in test.examples:
        skipped = example.options.get(doctest.SKIP, False)
        if skipped and example.source.startswith("import "):
            group = example.source.split()[1]
        elif not skipped:
            group = None
        if not skipped or group == library:
            example.options = {}
            kept.append(example)
    test.examples = kept
    return test


@pytest.mark.parametrize("library", SKIPPED_LIBRARIES)
def test_skipped_examples_run_with_their_library(library):
    pytest.importorskip(library)
    from sdpa_array import scaled_dot_product_attention

    test = skipped_examples(scaled_dot_product_attention, library)
    assert any(f"import {library}" in e.source for e in test.examples)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test)
    assert (result.failed, result.attempted) == (0, len(test.examples))


def landing_page_blocks() -> list[str]:
    """The Python code blocks of the docs' landing page."""
    text = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.+?)\n```", text, flags=re.S)


def printed_comment(block: str) -> str:
    """What a block says it prints: the comment after its ``print(...)`` line."""
    (line,) = [ln for ln in block.splitlines() if ln.startswith("print(")]
    return line.split("  # ", 1)[1]


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_landing_page_code_runs_and_prints_what_it_says(library, capsys):
    pytest.importorskip(library)
    (block,) = [b for b in landing_page_blocks() if f"import {library}" in b.splitlines()[0]]
    assert len([ln for ln in block.splitlines() if ln.strip()]) == 5
    exec(compile(block, f"docs/index.md ({library})", "exec"), {})
    assert capsys.readouterr().out.strip() == printed_comment(block)
