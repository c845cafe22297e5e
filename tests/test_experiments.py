"""``python -m sdpa_array experiments`` end to end, and its text helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from sdpa_array import lab
from sdpa_array.lab.cli import experiments
from sdpa_array.testing.backends import BACKENDS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_experiments_writes_one_figure_per_experiment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="figures need matplotlib (the plot extra)")
    out = tmp_path / "figures"
    assert experiments.main(["--out", str(out), "--backend", "numpy"]) == 0
    printed = capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"{e.name}.png" for e in experiments.EXPERIMENTS)
    for exp in experiments.EXPERIMENTS:
        png = out / f"{exp.name}.png"
        assert png.stat().st_size > 10_000
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert exp.title in printed
        assert f"figure: {png}" in printed
    assert "7 published figures are wrong beyond rounding" in printed


def test_experiments_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert experiments.main(["--out", str(tmp_path / "figures")]) == 0
    printed = capsys.readouterr().out
    assert "figures skipped" in printed
    assert not (tmp_path / "figures").exists()
    for exp in experiments.EXPERIMENTS:
        assert exp.title in printed


def test_experiments_unavailable_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = [b for b in BACKENDS if not b.is_available()]
    if not absent:
        pytest.skip("every registered backend is available on this machine")
    assert experiments.main(["--out", str(tmp_path), "--backend", absent[0].id]) == 2
    assert "not available" in capsys.readouterr().err


def test_experiments_rejects_unknown_backend(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        experiments.main(["--out", str(tmp_path), "--backend", "nonesuch"])
    assert info.value.code == 2


def test_format_table_aligns_columns() -> None:
    text = lab.format_table(["name", "value"], [["a", 1.23456], ["long name", 12345]])
    lines = text.splitlines()
    assert lines == ["name       value", "---------  -----", "a          1.235", "long name  12345"]


def test_pattern_text_heads_side_by_side() -> None:
    w = np.array([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [1.0, 0.0]]])
    assert lab.pattern_text(w) == "■ ·   · ■\n■ ■   ■ ·\nheads by identical weights: 0, 1"
    same = np.stack([w[0], w[1], w[0]])
    assert lab.pattern_text(same).endswith("heads by identical weights: 0=2, 1")
