"""The documentation's promises: every public function shows how it is called, and the
landing page's code runs."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import json
import re
import sys
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


def test_performance_page_code_prints_what_it_says(capsys):
    """The performance page's code (the tiles ``explain`` counts) prints its comment."""
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.+?)\n```", text, flags=re.S)
    assert blocks
    for block in blocks:
        printed = [ln for ln in block.splitlines() if ln.startswith("# ")]
        exec(compile(block, "docs/performance.md", "exec"), {})
        assert capsys.readouterr().out.strip() == "\n".join(ln[2:] for ln in printed)


# --- The pages speak of the library as it is ------------------------------------------------

#: Mentions of the development's bookkeeping: an issue or a stop by number.
BOOKKEEPING = re.compile(r"\bissues?\s*#?\d+|\bstops?[- ]\d+", flags=re.I)

#: A private module's path (``sdpa_array._plan``, ``sdpa_array/_kernels/...``), not a
#: dunder (``sdpa_array.__version__``).
PRIVATE_PATH = re.compile(r"sdpa_array[./]_(?!_)\w")

#: The pages for developers, which name the private modules on purpose.
DEVELOPER_PAGES = ("docs/architecture.md",)


def doc_pages() -> list[Path]:
    """The docs' own pages, the gallery's sources and the README."""
    docs = ROOT / "docs"
    return [
        *sorted(docs.glob("*.md")),
        *sorted((docs / "examples").rglob("*.py")),
        ROOT / "README.md",
    ]


def package_prose() -> list[tuple[str, str]]:
    """``(place, text)`` of every comment and string (docstrings among them) in the package."""
    import io
    import tokenize

    found = []
    for path in sorted((ROOT / "sdpa_array").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type in (tokenize.COMMENT, tokenize.STRING):
                place = f"{path.relative_to(ROOT)}:{token.start[0]}"
                found.append((place, token.string))
    return found


def matches(pattern: re.Pattern[str], places: list[tuple[str, str]]) -> list[str]:
    """``place: match`` for each match of ``pattern`` in the texts of ``places``."""
    return [f"{place}: {m.group()}" for place, text in places for m in pattern.finditer(text)]


def page_texts(skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    pages = [p for p in doc_pages() if str(p.relative_to(ROOT)) not in skip]
    assert len(pages) > 10  # the walk found the docs
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in pages]


def test_no_page_mentions_an_issue_or_a_stop():
    assert matches(BOOKKEEPING, page_texts()) == []


def test_no_comment_or_docstring_mentions_an_issue_or_a_stop():
    prose = package_prose()
    assert len(prose) > 1000  # the walk found the package
    assert matches(BOOKKEEPING, prose) == []


def test_user_pages_and_public_docstrings_name_no_private_module():
    assert matches(PRIVATE_PATH, page_texts(skip=DEVELOPER_PAGES)) == []
    docstrings = [(name, inspect.getdoc(obj) or "") for name, obj in public_callables()]
    assert matches(PRIVATE_PATH, docstrings) == []


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("(issue 28, 2026-11-27)", True),
        ("issues 27 and 25", True),
        ("issue #3", True),
        ("Causal calls (stop 19)", True),
        ("stop-20", True),
        ("the loop stops at the diagonal; 3 issues remain open", False),
    ],
)
def test_bookkeeping_pattern(text, found):
    assert bool(BOOKKEEPING.search(text)) is found


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("`sdpa_array._plan.dispatch`", True),
        ("sdpa_array/_kernels/blocked.py", True),
        ("sdpa_array.__version__", False),
        ("sdpa_array.mods.document", False),
    ],
)
def test_private_path_pattern(text, found):
    assert bool(PRIVATE_PATH.search(text)) is found


# --- The performance page --------------------------------------------------------------------

PERFORMANCE = ROOT / "docs" / "performance.md"


def test_performance_page_is_short_and_undated():
    text = PERFORMANCE.read_text(encoding="utf-8")
    assert len(text.split()) < 1500
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", text) == []
    for label in ("(performance-history)=", "(auto-thresholds)=", "(gpu)=", "(reproduce)="):
        assert label in text


def test_performance_page_thresholds_are_the_codes():
    from sdpa_array._plan.dispatch import AUTO_BLOCKED_BYTES_BY_LIBRARY, AUTO_MAX_SCORE_BYTES

    text = PERFORMANCE.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| ([\w -]+?)(?: \(.*?\))? \| (\d+) MiB", text, flags=re.M))
    names = {
        "numpy": "NumPy",
        "jax": "JAX",
        "torch": "torch",
        "array_api_strict": "array-api-strict",
    }
    assert {names[k]: v for k, v in AUTO_BLOCKED_BYTES_BY_LIBRARY.items()} == {
        name: int(rows[name]) * 2**20 for name in names.values()
    }
    assert f"Above {AUTO_MAX_SCORE_BYTES // 2**20} MiB" in text


def figures_module():

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import performance_figures
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    return performance_figures


def write_result(folder: Path, commit: str, results: dict, requirements: dict | None = None):
    """One asv result file, as ``asv run`` writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "commit_hash": commit,
        "env_name": "existing-py",
        "date": 1795708850000,
        "params": {"machine": folder.name, "python": "3.11"},
        "python": "3.11",
        "requirements": requirements or {},
        "result_columns": ["result", "params", "version", "started_at", "duration"],
        "results": results,
        "version": 2,
    }
    (folder / f"{commit[:8]}-existing-py.json").write_text(json.dumps(data))


def test_performance_figures_draw_the_results_with_machine_versions_and_commit(tmp_path):
    pytest.importorskip("matplotlib")
    figures = figures_module()
    machine = tmp_path / "results" / "box-2cpu"
    machine.mkdir(parents=True)
    (machine / "machine.json").write_text(json.dumps({"cpu": "Some CPU", "num_cpu": "2"}))
    lengths = ["256", "512"]
    scaling = [["'cpu-float32'", "'cuda-float16'"], lengths]
    write_result(
        machine,
        "a" * 40,
        {
            "scaling.TorchScaling.track_forward_ratio": [[1.25, 0.75, None, None], scaling, "v", 2],
            "scaling.TorchScaling.track_backward_ratio": [[2.5, 1.5, None, None], scaling, "v", 2],
            "scaling.DocumentSparsity.track_mask_mod_ratio": [[1.0, 0.625], [["1", "2"]], "v", 2],
            "documents.PackedDocuments.track_packed_over_batched": [
                [1.125, 1.5, 1.0625, 1.25],
                [["'8x512'"], ["'forward'", "'vjp'"], ["'mask_mod'", "'varlen'"]],
                "v",
                2,
            ],
            "scaling.Versions.track_version": [[20406, 21300], [["'numpy'", "'torch'"]], "v", 2],
            "small_shapes.SmallShapes.track_over_torch": [
                [1.25, 1.5],
                [["'1x8x128x64'", "'1x8x512x64'"]],
                "v",
                2,
            ],
            "small_shapes.SmallShapes.track_planning_share": [
                [0.0125, 0.0025],
                [["'1x8x128x64'", "'1x8x512x64'"]],
                "v",
                2,
            ],
            "accuracy.AccuracyVersusTorch.track_error_ratio": [
                [0.875, None],
                [["'numpy'"], ["'float32'", "'bfloat16'"], ["'blocked'"], ["'E64-unit'"]],
                "v",
                2,
            ],
        },
    )
    generated = tmp_path / "generated"
    figures.write(tmp_path / "results", generated)
    snippets = {
        name: (generated / "snippets" / f"performance_{name}.md").read_text()
        for name in ("scaling", "accuracy", "documents", "packed", "small")
    }
    for name, text in snippets.items():
        assert (generated / "performance" / f"{name}.png").stat().st_size > 1000
        assert f"/generated/performance/{name}.png" in text
        assert "`box-2cpu` (Some CPU, 2 CPUs)" in text
        assert "commit `aaaaaaaa`" in text
    assert "numpy 2.4.6, torch 2.13.0" in snippets["scaling"]
    assert "| 1.25 | 0.75 |" in snippets["scaling"]  # forward
    assert "| 2.50 | 1.50 |" in snippets["scaling"]  # backward
    assert "cuda-float16" not in snippets["scaling"]  # no GPU results: no GPU lines
    assert "| 1.00 | 0.62 |" in snippets["documents"]  # mask_mod
    assert "| 1.00 | 0.50 |" in snippets["documents"]  # the ideal, 1 / documents
    assert "0.88" in snippets["accuracy"]
    assert "bfloat16" not in snippets["accuracy"]  # skipped everywhere: no row
    assert "| forward | `mask_mod` | 1.12 |" in snippets["packed"]
    assert "| vjp | `varlen` | 1.25 |" in snippets["packed"]
    assert "| `box-2cpu` | ours / torch | 1.25 | 1.50 |" in snippets["small"]
    assert "| `box-2cpu` | planning / call | 1.2% | 0.2% |" in snippets["small"]


def test_performance_figures_without_results_say_so(tmp_path):
    figures = figures_module()
    figures.write(tmp_path / "results", tmp_path / "generated")
    for name in ("scaling", "accuracy", "documents", "packed", "small"):
        text = (tmp_path / "generated" / "snippets" / f"performance_{name}.md").read_text()
        assert text.startswith("*No results")


def test_committed_results_draw_every_performance_figure():
    figures = figures_module()
    found = figures.read(ROOT / "asv_benchmarks" / "results")
    for name in (
        figures.SCALING.format("forward"),
        figures.SCALING.format("backward"),
        figures.ACCURACY,
        figures.DOCUMENTS.format("mask_mod"),
        figures.DOCUMENTS.format("segment_ids"),
        figures.PACKED,
        figures.SMALL.format("over_torch"),
    ):
        (cpu,) = [m for m in found.get(name, []) if m.run.machine == "amd-epyc-2cpu-avx512"]
        assert any(v is not None for v in cpu.values.values()), name


def test_performance_history_lists_each_machines_latest_figures(tmp_path):
    """The history page's snippet names every machine (CPU, flags, cores) and gives each
    figure's value at its latest commit; the figure grid is drawn."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import performance_history
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    results = tmp_path / "results"
    for name, flags, values in [
        ("wide-2cpu", "avx512f", (0.84, 0.9)),
        ("narrow-2cpu-emulated", "avx2", (1.33, 1.01)),
    ]:
        folder = results / name
        folder.mkdir(parents=True)
        (folder / "machine.json").write_text(json.dumps({"cpu": f"A CPU ({flags})", "num_cpu": 2}))
        for commit, value in zip(("a" * 40, "b" * 40), values, strict=True):
            figure = "history.Ratios.track_plain_numpy_limit"
            write_result(folder, commit, {figure: [[value], [], "v", 2]})
            data = json.loads((folder / f"{commit[:8]}-existing-py.json").read_text())
            data["date"] += 1000 if commit[0] == "b" else 0
            (folder / f"{commit[:8]}-existing-py.json").write_text(json.dumps(data))
    performance_history.write(results, tmp_path / "generated")
    text = (tmp_path / "generated" / "snippets" / "history_machines.md").read_text()
    assert (tmp_path / "generated" / "history" / "ratios.png").stat().st_size > 1000
    assert "| `wide-2cpu` | A CPU (avx512f) | 2 | 2 |" in text
    assert "`narrow-2cpu-emulated` at `bbbbbbbb`" in text
    assert "| forward / a plain NumPy loop | 1.01 | 0.90 |" in text
