"""``python -m sdpa_array demo|bench|explain`` refuse a backend they cannot run, alike.

An id the registry does not know is a usage error (argparse: exit status 2, the known ids on
stderr); a registered backend whose library is missing is named on stderr with the extra
that installs it, and the command exits with status 2 before running anything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sdpa_array._cli import bench, demo, explain
from sdpa_array.testing.backends import Backend

COMMANDS = {
    "demo": (demo.main, ["--backend"]),
    "bench": (bench.main, ["--quick", "--backends"]),
    "explain": (explain.main, ["--out", "{tmp}", "--backend"]),
}


def _argv(command: str, backend: str, tmp_path: Path) -> list[str]:
    return [a.format(tmp=tmp_path) for a in COMMANDS[command][1]] + [backend]


@pytest.fixture
def without_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the registry believe that JAX is not installed."""
    real = Backend.is_installed
    monkeypatch.setattr(Backend, "is_installed", lambda self: self.library != "jax" and real(self))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unknown_backend_is_a_usage_error(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main = COMMANDS[command][0]
    with pytest.raises(SystemExit) as info:
        main(_argv(command, "nosuch", tmp_path))
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "nosuch" in captured.err
    assert "numpy" in captured.err  # the known ids (or choices) are listed
    assert "checks" not in captured.out


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.usefixtures("without_jax")
def test_uninstalled_backend_names_what_to_install(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main = COMMANDS[command][0]
    assert main(_argv(command, "jax", tmp_path)) == 2
    captured = capsys.readouterr()
    assert "backend 'jax' is not available" in captured.err
    assert "pip install sdpa_array[jax]" in captured.err
    assert captured.out == ""  # nothing ran
    assert not any(tmp_path.iterdir())


@pytest.mark.usefixtures("without_jax")
def test_one_missing_backend_in_a_list_stops_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--backend", "numpy,jax"]) == 2
    captured = capsys.readouterr()
    assert "'jax'" in captured.err
    assert "checks" not in captured.out


def test_gpu_backend_without_gpu_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Backend, "is_installed", lambda self: True)
    monkeypatch.setattr(Backend, "is_available", lambda self: not self.needs_gpu)
    assert demo.main(["--backend", "cupy"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_python_dash_m_exit_status(tmp_path: Path) -> None:
    """Through the interpreter: stderr names the backend, the exit status is 2."""
    run = subprocess.run(
        [sys.executable, "-m", "sdpa_array", "demo", "--backend", "nosuch"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert run.returncode == 2
    assert "unknown backend 'nosuch'" in run.stderr
    assert "checks" not in run.stdout
