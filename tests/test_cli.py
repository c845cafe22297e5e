"""The commands ``python -m sdpa_array demo|bench|experiments``.

They refuse a backend they cannot run, alike: an id the registry does not know is a usage
error (argparse: exit status 2, the known ids on stderr); a registered backend whose library
is missing is named on stderr with the extra that installs it, and the command exits with
status 2 before running anything.

``bench`` prints each table row as soon as it is measured, with progress lines on stderr;
its candidates are timed in interleaved rounds.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sdpa_array.lab.cli import bench, demo, experiments
from sdpa_array.testing.backends import Backend

COMMANDS = {
    "demo": (demo.main, ["--backend"]),
    "bench": (bench.main, ["--quick", "--backends"]),
    "experiments": (experiments.main, ["--out", "{tmp}", "--backend"]),
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


#: A bench run that takes seconds: NumPy only, a tiny shape, one timed round per row.
TINY_BENCH = ["--backends", "numpy", "--shape", "1,1,64,16", "--repeat", "1"]


def _table_rows(text: str) -> list[str]:
    """The measured rows of bench's Markdown table (not its header or rule)."""
    return [line for line in text.splitlines() if line.startswith("|   numpy")]


def test_bench_prints_each_row_before_measuring_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows and progress are flushed as they come, even into block-buffered streams."""
    streams = {
        name: io.BufferedWriter(io.BytesIO(), buffer_size=1 << 20) for name in ("out", "err")
    }
    for name, attr in (("out", "stdout"), ("err", "stderr")):
        monkeypatch.setattr(sys, attr, io.TextIOWrapper(streams[name], encoding="utf-8"))

    def written(name: str) -> str:
        raw = streams[name].raw
        assert isinstance(raw, io.BytesIO)
        return raw.getvalue().decode()

    seen: list[tuple[str, str]] = []
    measure = bench._measure

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((written("out"), written("err")))  # what has reached the streams so far
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench, "_measure", spy)
    assert bench.main(TINY_BENCH) == 0
    sys.stdout.flush()
    sys.stderr.flush()
    assert len(seen) == 2
    (out_1, err_1), (out_2, err_2) = seen
    assert "| backend" in out_1  # the header comes before the first measurement
    assert _table_rows(out_1) == []
    assert err_1.splitlines() == [
        "[1/2] measuring numpy float32 non-causal 1x1x64x64x16 (1 rounds) ..."
    ]
    assert len(_table_rows(out_2)) == 1  # the first row is out before the second starts
    assert "|     no |" in out_2
    assert err_2.splitlines()[-1] == (
        "[2/2] measuring numpy float32 causal 1x1x64x64x16 (1 rounds) ..."
    )
    out, err = written("out"), written("err")
    assert len(_table_rows(out)) == 2
    assert "measuring" not in out  # progress goes to stderr only
    assert "|" not in err


def test_bench_streams_through_a_pipe(tmp_path: Path) -> None:
    """Through the interpreter, stdout and stderr on one pipe: progress and rows alternate.

    Python buffers stdout in blocks when it is a pipe (unless ``PYTHONUNBUFFERED`` is set,
    which is removed here), so rows that were not flushed would all come after the progress.
    """
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    run = subprocess.run(
        [sys.executable, "-m", "sdpa_array", "bench", *TINY_BENCH],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stdout
    kinds = []  # in the order the lines reached the pipe
    for line in run.stdout.splitlines():
        if line.startswith("["):
            kinds.append(line.split()[0])  # [i/n]
        elif line.startswith("|   numpy"):
            kinds.append("row")
        elif line.startswith("torch/auto > 1"):
            kinds.append("legend")
    assert kinds == ["[1/2]", "row", "[2/2]", "row", "legend"]


def test_bench_rows_give_median_and_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([*TINY_BENCH[:-1], "3"]) == 0
    out = capsys.readouterr().out
    assert "median (min-max) of 3 interleaved rounds" in out
    rows = _table_rows(out)
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        match = re.fullmatch(r"([0-9.]+) \(([0-9.]+)-([0-9.]+)\)", cells[3])
        assert match, cells[3]
        median, low, high = (float(x) for x in match.groups())
        assert low <= median <= high
    assert re.search(r"is_causal=True takes [0-9.]+x the time of is_causal=False", out)


def test_interleaved_rounds_shuffle_the_candidates() -> None:
    """Each round calls every candidate once; a candidate's predecessor changes between
    rounds; the order repeats from run to run."""
    calls: list[str] = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    times = bench.interleaved_times(candidates, lambda _: None, repeat=8, warmup=1)
    rounds = [calls[i : i + 4] for i in range(0, len(calls), 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    predecessors = {r[r.index("a") - 1] for r in rounds if r.index("a") > 0}
    assert len(predecessors) > 1
    assert {name: len(t) for name, t in times.items()} == dict.fromkeys("abcd", 8)
    again: list[str] = []
    repeat = {name: (lambda name=name: again.append(name)) for name in "abcd"}
    bench.interleaved_times(repeat, lambda _: None, repeat=8, warmup=1)
    assert again == calls


@pytest.mark.parametrize("repeat", ["0", "-1", "x"])
def test_bench_repeat_must_be_positive(repeat: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--backends", "numpy", "--repeat", repeat])
    assert info.value.code == 2
    assert "positive integer" in capsys.readouterr().err
