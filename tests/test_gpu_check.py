"""``python -m sdpa_array gpu-check``: its pieces, quickly (the whole CPU rehearsal runs at
the end of ``nox -s tests-triton``).

The measurements return interleaved rounds of ours and the peer; a section that outlives
its budget is stopped with its process group; the asv results are asv's format; the
command refuses to run its GPU sections without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from sdpa_array.lab.cli import COMMANDS, gpu_check
from sdpa_array.lab.cli.gpu_check import figures, results, sections
from sdpa_array.lab.cli.gpu_check.setup import CPU_SETUP

SETUP = dataclasses.replace(CPU_SETUP, rounds=2, reps=1)


def test_gpu_check_is_a_command():
    assert COMMANDS["gpu-check"][0] == gpu_check.__name__


def test_paired_ratios_are_the_ratio_of_medians_and_the_per_round_range():
    ratio, low, high = figures.paired_ratios([2.0, 4.0, 3.0], [1.0, 1.0, 2.0])
    assert ratio == pytest.approx(3.0 / 1.0)
    assert (low, high) == (1.5, 4.0)


@pytest.mark.parametrize("figure", ["forward", "autograd", "vjp_given", "blocked", "accuracy"])
def test_torch_figures_time_ours_against_the_peer(torch_cpu_backend, figure):
    row = figures.measure(SETUP, figure, torch_cpu_backend.id, "float32", "1x2x32x8-causal")
    rounds = 1 if figure == "accuracy" else SETUP.rounds
    assert len(row["ours"]) == len(row["peer"]) == rounds
    assert all(t > 0 for t in row["ours"] + row["peer"])
    if figure == "vjp_given":
        assert len(row["plain"]) == rounds
    values = results.asv_values(
        {**row, "figure": figure, "backend": "torch", "dtype": "float32", "shape": "s"}
    )
    assert values
    assert all(v > 0 for _, v in values.values())


def test_decode_figure_runs(torch_cpu_backend):
    row = figures.measure(SETUP, "decode", torch_cpu_backend.id, "float32", "1x4x2x64x8")
    assert len(row["ours"]) == len(row["peer"]) == SETUP.rounds


def test_jax_figure_runs(jax_backend):
    row = figures.measure(SETUP, "jax", jax_backend.id, "float32", "1x2x32x8-causal")
    assert len(row["ours"]) == len(row["peer"]) == SETUP.rounds


def test_a_section_past_its_budget_is_stopped(tmp_path):
    report = sections.Report()
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    start = time.perf_counter()
    status, _ = sections.run_budgeted(command, {}, 2.0, tmp_path / "log", report, tail=5)
    assert status is None
    assert time.perf_counter() - start < 20
    assert "started" in (tmp_path / "log").read_text()


def test_junit_counts(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    counts = sections.junit_counts(xml)
    assert counts == {"passed": 2, "failed": 1, "errors": 0, "skipped": 2}
    assert sections.junit_counts(tmp_path / "missing.xml") == {}


def test_asv_results_have_asvs_format(tmp_path):
    rows = [
        {
            "figure": "forward",
            "backend": "torch:cuda",
            "dtype": d,
            "shape": "4x16x4096x128-causal",
            "status": "ok",
            "ours": [1.0, 1.2],
            "peer": [1.1, 1.1],
            "flops": 1e12,
        }
        for d in ("float16", "bfloat16")
    ]
    rows.append({**rows[0], "status": "skip", "reason": "no GPU"})
    info = {"device": "NVIDIA H200", "libraries": {"numpy": "2.5", "torch": "2.11"}}
    machine = sections.machine_name(info, rehearsal=False)
    assert machine == "nvidia-h200"
    path = results.write_asv_results(rows, tmp_path, machine, info, "a" * 40)
    assert path.parent == tmp_path / "nvidia-h200"
    assert json.loads((path.parent / "machine.json").read_text())["machine"] == "nvidia-h200"
    document = json.loads(path.read_text())
    assert document["version"] == 2
    assert document["commit_hash"] == "a" * 40
    result, params, version = document["results"]["gpu.GPUForward.track_ratio_vs_torch_sdpa"][:3]
    assert params == [
        ["'torch:cuda'"],
        ["'auto'"],
        ["'float16'", "'bfloat16'"],
        [repr(rows[0]["shape"])],
    ]
    assert result == [pytest.approx(1.1 / 1.1)] * 2
    assert version is None
    asv_results = pytest.importorskip("asv.results")
    loaded = asv_results.Results.load(str(path))
    name = "gpu.GPUForward.track_tflops"
    assert (
        loaded.get_result_value(name, loaded.get_result_params(name))
        == [
            pytest.approx(1.0 / 1.1)  # 1e12 flops in the median 1.1 s
        ]
        * 2
    )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_a_gpu_the_command_asks_for_the_rehearsal(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "--cpu-rehearsal" in capsys.readouterr().err
    assert not any(Path(tmp_path).iterdir())
