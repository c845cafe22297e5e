"""Running the sections of ``gpu-check``: budgeted subprocesses, versions, pytest runs."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .setup import DISTRIBUTIONS, ROOT, PytestRun, Setup


@dataclasses.dataclass
class Section:
    """One section's end: ``status`` is pass, fail, skip or cut."""

    name: str
    status: str
    seconds: float
    detail: str = ""


class Report:
    """What the run prints, kept for ``log.txt`` as well."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def say(self, text: str = "") -> None:
        with self.lock:
            self.lines.append(text)
            print(text, flush=True)


def run_budgeted(
    command: list[str], env: dict[str, str], budget: float, log: Path, report: Report, tail: int
) -> tuple[int | None, float]:
    """Run ``command`` in a session of its own for at most ``budget`` seconds, its output to
    ``log`` (the last ``tail`` lines also printed); ``(exit status, seconds)``, the status
    ``None`` when the budget ran out and the process group was stopped."""
    start = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            status: int | None = process.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            status = None
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                try:
                    process.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    seconds = time.perf_counter() - start
    lines = log.read_text(errors="replace").splitlines()
    for line in [x for x in lines if not x.startswith("USDT:")][-tail:]:  # profiler noise
        report.say(f"    | {line}")
    return status, seconds


def child_environment(**changes: str) -> dict[str, str]:
    """The environment of a section's subprocess: the checkout first on ``PYTHONPATH``,
    unbuffered output, JAX allocating GPU memory as it needs it (not three quarters of the
    device at start, which would starve torch and the other test workers), ``changes``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    env.pop("TRITON_INTERPRET", None)
    return {**env, **changes}


def load_module(name: str) -> Any:
    """The module ``name``, imported where it is needed (torch, JAX and this package's
    public functions are used here through their documented names only)."""
    import importlib

    return importlib.import_module(name)


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def versions(setup: Setup) -> dict[str, Any]:
    """The device, driver, CUDA runtimes and library versions (without starting a GPU
    context in this process: ``nvidia-smi`` and the packages' metadata)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        query = "--query-gpu=name,driver_version,memory.total"
        try:
            out = subprocess.run(
                [smi, query, "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.strip()
            name, driver, memory = (s.strip() for s in out.splitlines()[0].split(","))
            info.update(device=name, driver=driver, memory=memory)
        except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
            info["device"] = f"nvidia-smi failed: {exc}"
    else:
        info["device"] = "cpu (no nvidia-smi)" if setup.rehearsal else "no nvidia-smi"
    if _has_module("torch"):
        torch = load_module("torch")

        info["torch CUDA"] = torch.version.cuda
    info["libraries"] = {d: v for d in DISTRIBUTIONS if (v := _installed(d)) is not None}
    from .... import __version__

    info["libraries"]["sdpa_array"] = __version__
    return info


def machine_name(info: dict[str, Any], rehearsal: bool) -> str:
    """``nvidia-h200`` for an "NVIDIA H200" (lower case, dashes); ``cpu-rehearsal``."""
    if rehearsal:
        return "cpu-rehearsal"
    name = str(info.get("device", "gpu")).lower()
    return "-".join("".join(c if c.isalnum() else " " for c in name).split()) or "gpu"


def run_pytest(selection: PytestRun, setup: Setup, work: Path, report: Report) -> Section:
    """Run one test selection as a pytest subprocess within its budget."""
    from ....testing.backends import get_backend

    name = selection.name
    if not (ROOT / "tests" / "conftest.py").exists():
        return Section(name, "skip", 0.0, f"no tests/ folder in {ROOT} (run from a checkout)")
    backends = [b for b in selection.backends if get_backend(b).is_available()]
    if not backends:
        missing = ", ".join(selection.backends)
        return Section(name, "skip", 0.0, f"{missing}: not installed or no device here")
    if (selection.interpret_triton or "triton" in name) and not _has_module("triton"):
        return Section(name, "skip", 0.0, "triton is not installed")
    files = [f for f in selection.files if (ROOT / f).exists()]
    junit = work / f"junit-{name}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    if _installed("pytest-benchmark") is not None:
        command += ["-p", "no:benchmark"]
    if setup.workers and _has_module("xdist"):
        command += ["-n", str(setup.workers)]
    command += [f"--junitxml={junit}", *selection.extra, *files]
    env = child_environment(SDPA_BACKENDS=",".join(backends), HYPOTHESIS_PROFILE="ci")
    if selection.interpret_triton:
        env["TRITON_INTERPRET"] = "1"
    report.say(f"  SDPA_BACKENDS={env['SDPA_BACKENDS']} {' '.join(command[2:])}")
    status, seconds = run_budgeted(
        command, env, selection.budget, work / f"{name}.log", report, tail=4
    )
    counts = junit_counts(junit)
    detail = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no junit results"
    if status is None:
        return Section(name, "cut", seconds, f"budget {selection.budget:.0f} s ran out")
    return Section(name, "pass" if status == 0 else "fail", seconds, detail)


def junit_counts(path: Path) -> dict[str, int]:
    """passed, failed, errors, skipped of a junit XML file (empty when there is none)."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in total:
            total[key] += int(suite.get(key, 0))
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


def child_section(kind: str, setup: Setup, work: Path, budget: float, report: Report) -> Section:
    """Run the figures or the profile in a child process of this command (so that a budget
    can stop it); it writes one JSON line per result to ``work/<kind>.jsonl``."""
    command = [sys.executable, "-m", "sdpa_array", "gpu-check", "--child", kind]
    command += ["--out", str(work)] + (["--cpu-rehearsal"] if setup.rehearsal else [])
    env = child_environment()
    if setup.rehearsal and _has_module("triton"):
        env["TRITON_INTERPRET"] = "1"
    status, seconds = run_budgeted(command, env, budget, work / f"{kind}.log", report, tail=200)
    rows = read_jsonl(work / f"{kind}.jsonl")
    errors = [r for r in rows if r.get("status") == "error"]
    if status is None:
        return Section(kind, "cut", seconds, f"budget {budget:.0f} s ran out")
    if status != 0 or errors:
        return Section(kind, "fail", seconds, f"exit {status}, {len(errors)} errors")
    return Section(kind, "pass", seconds, f"{len(rows)} rows")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
