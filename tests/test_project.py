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
