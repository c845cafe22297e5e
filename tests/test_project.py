"""The project's own promises: README's commands are what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = readme_commands()[:2]
    assert "python -m sdpa_array demo" in demo
    assert "nox" in tests


def test_ci_runs_readme_test_command():
    test_command = readme_commands()[1].strip()
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_demo_prints_a_passing_table(capsys):
    from sdpa_array.__main__ import main

    assert main(["demo", "--backend", "numpy"]) == 0
    text = capsys.readouterr().out
    assert "worked example" in text
    assert "6 checks, 0 outside the error bound" in text
    for dtype in ("float16", "float32", "float64"):
        assert f"numpy    cpu     {dtype}" in text


def test_cli_rejects_unknown_commands(capsys):
    from sdpa_array.__main__ import main

    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


#: What the shipped text may not cite: the notes and the shared folder the project was
#: started from, which users of the package do not have. Built from pieces so that this
#: file does not match itself.
UNSHIPPED_SOURCES = re.compile(
    "|".join(
        [
            "design" + r"[\s_-]+notes?",
            r"\.\./" + "shared",
            r"\bshared/" + "(?:gpu|design|hooks|STYLE)",
        ]
    ),
    flags=re.IGNORECASE,
)

#: Generated folders under docs/, not shipped text of their own.
GENERATED_DOCS = ("_build", "generated", "auto_examples")


def _shipped_text() -> list[Path]:
    """The package, the tests, the docs' sources and README: what a user of a checkout or
    of the sdist reads."""
    files = [ROOT / "README.md"]
    for folder, patterns in (
        ("sdpa_array", ("*.py",)),
        ("tests", ("*.py",)),
        ("docs", ("*.md", "*.rst", "*.py", "*.txt", "*.html")),
    ):
        for pattern in patterns:
            files += [
                path
                for path in (ROOT / folder).rglob(pattern)
                if not set(path.relative_to(ROOT).parts) & set(GENERATED_DOCS)
            ]
    return files


def test_shipped_text_cites_no_unshipped_notes():
    files = _shipped_text()
    assert any(path.name == "multi_head.py" for path in files)  # the walk found the package
    cited = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if UNSHIPPED_SOURCES.search(line)
    ]
    assert cited == []


def test_unshipped_sources_pattern_matches_what_it_forbids():
    cited = [
        "(design" + " note 004)",
        "the design" + "-notes folder",
        "../" + "shared/" + "gpu/x.py",
    ]
    for text in cited:
        assert UNSHIPPED_SOURCES.search(text), text
    assert not UNSHIPPED_SOURCES.search("shared memory between threads")


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.+?)\n```", text, flags=re.S)


def test_readme_use_snippet_runs_as_a_script_and_prints():
    import subprocess
    import sys

    snippet = readme_python_blocks()[0]
    done = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.strip() == "(2, 8, 128, 32) (2, 8, 128)"


def test_readme_development_tree_names_modules_that_exist():
    text = (ROOT / "README.md").read_text()
    tree = text[text.index("```\nsdpa_array/") :].split("```", 2)[1]
    named = set(re.findall(r"\b([a-z_]+\.py)\b", tree))
    folders = set(re.findall(r"^ +([a-z_]+)/", tree, flags=re.M))
    present = {path.name for path in (ROOT / "sdpa_array").rglob("*.py")}
    present_folders = {path.name for path in (ROOT / "sdpa_array").rglob("*") if path.is_dir()}
    assert named
    assert folders
    assert named - present == set()
    assert folders - present_folders == set()
    for dotted in re.findall(r"`(_[a-z_]+)\.[A-Z_]+`", text):  # e.g. `_module.NAME`
        assert dotted in present_folders | {name[:-3] for name in present}, dotted


def _resolve(dotted: str) -> object:
    """The object a dotted name (a module, then attributes) names."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_architecture_page_names_what_exists():
    """The architecture page's way of one call, and every module it names, exist (its
    picture is drawn from the same list and the import contract)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split(":name: call-path", 1)[1].split("```", 1)[0]
    steps = [line.strip() for line in block.splitlines() if line.strip()]
    assert len(steps) >= 10
    assert len(steps) <= 25  # the way of one call stays short
    named = set(re.findall(r"`(sdpa_array(?:\.\w+)+)`", text))
    assert named
    for dotted in [*steps, *sorted(named)]:
        assert _resolve(dotted) is not None, dotted
