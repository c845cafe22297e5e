"""nox sessions: one test session per backend, lint, docs and benchmarks.

``nox`` alone runs the CPU test sessions (without the tests marked ``slow``), the
integrations' tests, the NumPy and the torch tests at the lowest declared dependency
versions on the oldest supported Python (``tests-min-deps``), ``lint``, ``docs`` and ``build``;
``nox -s tests-slow`` runs the ``slow`` tests on every CPU backend; ``nox -s tests-cupy``,
``nox -s tests-cupy-cuda13``, ``nox -s tests-cuda``, ``nox -s tests-jax-cuda`` and
``nox -s tests-jax-cuda13`` need a CUDA device; ``nox -s bench`` runs the asv suite.
``tests-triton`` ends with the CPU rehearsal of ``python -m sdpa_array gpu-check``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_existing_virtualenvs = True
# Only tests-min-deps names an interpreter (the oldest supported Python): if it is missing,
# the session fails rather than being skipped.
nox.options.error_on_missing_interpreters = True

#: torch is pinned to the CPU build this machine serves from a local file; an unpinned torch
#: would pull several GB of CUDA packages.
TORCH = "torch==2.13.0"

#: The oldest Python pyproject.toml supports (``requires-python = ">=X.Y"``).
MIN_PYTHON = re.search(
    r'requires-python\s*=\s*">=\s*(\d+\.\d+)"', Path("pyproject.toml").read_text()
).group(1)


def _interpreter(version: str) -> str:
    """``version``, or the path of a pyenv-installed Python of that version (pyenv's shims
    refuse a version that is installed but not selected, and nox does not look past them)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"), "versions")
    installed = sorted(root.glob(f"{version}.*/bin/python{version}"))
    return str(installed[-1]) if installed else version


#: session name -> (backend ids for SDPA_BACKENDS, extras, extra pip requirements, default).
#: ``numpy:readonly`` passes NumPy arrays with ``writeable=False``: no path may write to its
#: inputs.
TEST_SESSIONS = {
    "tests-numpy": ("numpy,numpy:readonly", "test,plot", [], True),
    "tests-torch": ("torch", "test", [TORCH], True),
    "tests-strict": ("strict", "test,strict", [], True),
    "tests-jax": ("jax", "test,jax", [], True),
    "tests-dask": ("dask", "test,dask", [], True),
    # The Triton kernels under triton's interpreter, on CPU torch tensors (tests/test_triton.py;
    # TRITON_INTERPRET=1 is set for this session only).
    "tests-triton": ("torch", "test,triton", [TORCH], True),
    # The integrations with other frameworks (their tests, with the frameworks installed).
    "tests-integrations": ("torch", "test,transformers,flax", [TORCH], True),
    # Need an NVIDIA GPU: not run by default (CUDA 12 builds, and CUDA 13 builds where
    # the machine's driver has CUDA 13).
    "tests-cupy": ("cupy", "test,cupy", [], False),
    "tests-cupy-cuda13": ("cupy", "test,cupy-cuda13", [], False),
    "tests-cuda": ("torch:cuda", "test,triton", ["torch"], False),
    "tests-jax-cuda": ("jax:cuda", "test,jax", ["jax[cuda12]"], False),
    "tests-jax-cuda13": ("jax:cuda", "test,jax", ["jax[cuda13]"], False),
}

#: Sessions that need a GPU: their pytest runs without the pytest-benchmark plugin, which
#: GPU machines often have and which aborts a run with workers under ``filterwarnings =
#: error``.
GPU_SESSIONS = frozenset(
    name for name, spec in TEST_SESSIONS.items() if "cuda" in spec[0] or spec[0] == "cupy"
)

#: Commands a session runs after its tests (when it runs its default files): the CPU
#: rehearsal of the GPU check, where torch and triton are installed (its JAX sections say
#: that JAX is not installed there; tests/test_gpu_check.py covers them).
AFTER_TESTS = {
    "tests-triton": ["python", "-m", "sdpa_array", "gpu-check", "--cpu-rehearsal", "--out"],
}


#: Sessions that run only some test files (by default), and those files.
SESSION_FILES = {
    "tests-integrations": [
        "--doctest-modules",
        "sdpa_array/integrations",
        "tests/test_integrations_transformers.py",
        "tests/test_integrations_flax.py",
    ],
    "tests-triton": [
        "tests/test_triton.py",
        "tests/test_triton_dispatch.py",
        "tests/test_triton_decode.py",
        "tests/test_dispatch_gpu.py",
    ],
}

#: Sessions that run triton's interpreter (``TRITON_INTERPRET=1``).
INTERPRETED_SESSIONS = frozenset({"tests-triton"})

#: Least line coverage (%) of the package by the NumPy session's tests (77 % measured in
#: that session when the floor was set; the other libraries' and the GPU's paths are
#: covered by their own sessions, which do not measure it).
COVERAGE_FLOOR = 75

#: The session that also runs the docstrings' examples: they use NumPy, and the example of
#: ``sdpa_array.lab.figures`` matplotlib, which the ``plot`` extra installs.
DOCTEST_SESSION = "tests-numpy"

#: The tests marked ``slow`` (pyproject.toml; ``@pytest.mark.slow_on(library)`` marks a
#: test's cases on one library's backends): the sessions above deselect them, this one runs
#: just them, on every CPU backend at once (backends, extras, extra pip requirements), on
#: ``SLOW_WORKERS`` pytest-xdist workers.
SLOW_SESSION = (
    "numpy,numpy:readonly,torch,strict,jax,dask",
    "test,plot,strict,jax,dask",
    [TORCH],
)

#: Worker processes of the slow session (the CI machine's 2 cores; most of its time is JAX
#: compiling each case's shapes, one core each).
SLOW_WORKERS = 2


def _define_test_session(
    name: str, backends: str, extras: str, reqs: list[str], default: bool, marks: str | None
):
    targets = ["--doctest-modules", "sdpa_array", "tests"] if name == DOCTEST_SESSION else []
    if name == DOCTEST_SESSION:  # line coverage of the package by the NumPy tests, floored
        targets += [
            "--cov=sdpa_array",
            "--cov-report=term:skip-covered",
            f"--cov-fail-under={COVERAGE_FLOOR}",
        ]
    select = ["-m", marks] if marks else []
    workers = ["-n", str(SLOW_WORKERS)] if name == "tests-slow" else []
    plugins = ["-p", "no:benchmark"] if name in GPU_SESSIONS else []

    def run_tests(session: nox.Session) -> None:
        if reqs:
            session.install(*reqs)
        session.install("-e", f".[{extras}]")
        env = {"SDPA_BACKENDS": backends, "HYPOTHESIS_PROFILE": "ci"}
        if name in INTERPRETED_SESSIONS:
            env["TRITON_INTERPRET"] = "1"
        session.run(
            "pytest",
            "--durations=10",
            *plugins,
            *workers,
            *select,
            *targets,
            *(SESSION_FILES.get(name, []) if not session.posargs else []),
            *session.posargs,
            env=env,
        )
        if name in AFTER_TESTS and not session.posargs:
            session.run(*AFTER_TESTS[name], session.create_tmp())

    which = f"the tests marked {marks!r}" if marks else "every test"
    run_tests.__doc__ = f"Run {which} with SDPA_BACKENDS={backends}" + (
        ", and the doctests." if targets else "."
    )
    nox.session(name=name, default=default)(run_tests)


# The default sessions leave the slow tests to tests-slow; the GPU sessions run every test.
for _name, _spec in TEST_SESSIONS.items():
    _define_test_session(_name, *_spec, marks="not slow" if _spec[-1] else None)
_define_test_session("tests-slow", *SLOW_SESSION, default=False, marks="slow")


def _lowest(requirements: list[str]) -> list[str]:
    """``name>=x`` as ``name==x``: each requirement at the lowest version the project
    declares."""
    return [r.replace(">=", "==") for r in requirements]


@nox.session(name="tests-min-deps", python=_interpreter(MIN_PYTHON))
def tests_min_deps(session: nox.Session) -> None:
    """Run the NumPy and torch tests (not slow) on the oldest supported Python, with every
    dependency, the test extra and torch at the lowest version pyproject.toml declares.

    On Python 3.10 torch comes as PyPI's CUDA build (about 2 minutes and 5 GB to install);
    it runs on the CPU here."""
    import tomllib

    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    session.install(*_lowest(project["dependencies"] + extras["test"] + extras["torch"]))
    session.install("--no-deps", "-e", ".")
    session.run(
        "pytest",
        "-n",
        "2",
        "-m",
        "not slow",
        "tests",
        env={"SDPA_BACKENDS": "numpy,torch", "HYPOTHESIS_PROFILE": "ci"},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format), mypy and the import contracts (import-linter)."""
    session.install("-e", ".[lint]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("lint-imports")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx site with warnings as errors (torch for the page of
    ``sdpa_array.MultiheadAttention``, a torch module; dask and transformers for the
    recipes of the gallery, which run at build time), after ``asv publish`` of the
    committed results, whose pages the site serves under ``asv/``."""
    session.install(TORCH)
    session.install("-e", ".[docs,plot,test,transformers,dask,bench]")
    if any(Path("asv_benchmarks/results").glob("*/machine.json")):  # asv's pages, for the site
        session.run("asv", "publish", "--config", "asv_benchmarks/asv.conf.json")
    session.run(
        "sphinx-build",
        "-W",
        "--keep-going",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )


#: The instruction-set extensions that decide which BLAS and torch kernels run, named in
#: the asv machine's CPU description (a figure from another family is another machine's).
CPU_FLAGS = (
    "sse4_2",
    "avx2",
    "fma",
    "avx512f",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
)

#: The history selection of the asv suite: the tracked ratios (asv_benchmarks/benchmarks/
#: history.py), about two minutes a commit on 2 cores.
HISTORY = "^history\\."

#: The regression gate's factor: a tracked ratio that grows by more than this between main
#: and HEAD fails ``bench-compare``. Repeating the history selection on one commit
#: (``nox -s bench-noise``) measured its band; the factor is at least the widest band.
GATE_FACTOR = 1.4


#: ``SDPA_BENCH_FAMILY=avx2`` holds NumPy (2.4's dispatch names), OpenBLAS and torch to
#: their AVX2 kernels on an AVX-512 machine, for the figures of a second CPU family: an
#: emulated family, named as such in the asv machine's name and CPU description.
AVX2_KERNELS = {
    "OPENBLAS_CORETYPE": "Haswell",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL",
    "ATEN_CPU_CAPABILITY": "avx2",
}


def _asv_machine(session: nox.Session) -> str:
    """Register this machine with asv under a name made of its CPU model, cores and the
    widest vector extension it has, with the model and flags as its CPU description;
    return the name. With ``SDPA_BENCH_FAMILY=avx2`` on an AVX-512 machine the libraries
    take their AVX2 kernels (:data:`AVX2_KERNELS`) and the machine is named
    ``...-avx2-emulated``."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cores = os.cpu_count() or 1
    widest = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    emulated = os.environ.get("SDPA_BENCH_FAMILY") == "avx2" and widest == "avx512"
    if emulated:
        session.env.update(AVX2_KERNELS)
        widest, flags = "avx2 emulated", {f for f in flags if not f.startswith("avx512")}
    present = [f for f in CPU_FLAGS if f in flags]
    name = os.environ.get(
        "SDPA_ASV_MACHINE",
        re.sub(r"[^a-z0-9]+", "-", f"{model} {cores}cpu {widest}".lower()).strip("-"),
    )
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{round(kib / 2**20)}GB"
    except (OSError, ValueError, IndexError):
        pass
    session.run(
        "asv", "machine", "--yes", "--machine", name, "--os", platform.platform(),
        "--arch", platform.machine(),
        "--cpu", f"{model}; flags: {' '.join(present)}" + (
            "; AVX2 emulated: " + ", ".join(f"{k}={v!r}" for k, v in AVX2_KERNELS.items())
            if emulated else ""
        ),
        "--num_cpu", str(cores), "--ram", memory,
    )  # fmt: skip
    return name


def _bench_session(session: nox.Session) -> str:
    """Install asv, change to the suite's folder, name the machine; return its name."""
    session.install(TORCH)
    session.install("-e", ".[bench,torch,perf]")
    session.chdir("asv_benchmarks")
    return _asv_machine(session)


def _git(session: nox.Session, *args: str) -> str:
    return str(session.run("git", *args, external=True, silent=True)).strip()


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Run the whole asv suite (quick profile) against this checkout and publish the HTML.

    ``SDPA_BENCH_PROFILE=full`` (passed through from the environment) adds L = S = 4096,
    float16 and L = S = 32768.
    """
    machine = _bench_session(session)
    head = _git(session, "rev-parse", "HEAD")
    session.run(
        "asv",
        "run",
        "--python=same",
        "--quick",
        "--show-stderr",
        f"--machine={machine}",
        f"--set-commit-hash={head}",
        *session.posargs,
        env={"SDPA_BENCH_PROFILE": os.environ.get("SDPA_BENCH_PROFILE", "quick")},
    )
    session.run("asv", "publish")


@nox.session(name="bench-history", default=False)
def bench_history(session: nox.Session) -> None:
    """Run the history selection over the commits of ``asv_benchmarks/history_commits.txt``
    and HEAD, each installed in asv's pinned environment, skipping the commits this machine
    has results for; the results (JSON under ``asv_benchmarks/results/``) are committed."""
    machine = _bench_session(session)
    listed = Path("history_commits.txt").read_text().split("\n")
    commits = [line.split()[0] for line in listed if line.strip() and not line.startswith("#")]
    commits.append(_git(session, "rev-parse", "HEAD"))
    Path(session.create_tmp(), "commits.txt").write_text("\n".join(commits) + "\n")
    session.run(
        "asv", "run", "--bench", HISTORY, "--skip-existing", "--show-stderr",
        f"--machine={machine}", f"HASHFILE:{Path(session.create_tmp(), 'commits.txt')}",
        *session.posargs,
    )  # fmt: skip


@nox.session(name="bench-compare", default=False)
def bench_compare(session: nox.Session) -> None:
    """The regression gate: the history selection on main's tip and on HEAD (each installed
    in asv's pinned environment), failing where a tracked ratio grew by more than
    :data:`GATE_FACTOR` (``asv continuous``). Commit the change first: asv measures
    commits, not the working tree."""
    machine = _bench_session(session)
    base = session.posargs[0] if session.posargs else "main"
    session.run(
        "asv", "continuous", "--bench", HISTORY, "--factor", str(GATE_FACTOR),
        "--show-stderr", f"--machine={machine}", "--split", base, "HEAD",
    )  # fmt: skip


@nox.session(name="bench-noise", default=False)
def bench_noise(session: nox.Session) -> None:
    """The noise band of the history selection: its figures measured ``N`` times (default
    3) on this checkout in one environment, each figure's max / min printed: the
    regression gate's :data:`GATE_FACTOR` must be at least the widest."""
    session.install(TORCH)
    session.install("-e", ".[bench,torch,perf]")
    repeats = session.posargs[0] if session.posargs else "3"
    session.run("python", "asv_benchmarks/noise_band.py", repeats)


@nox.session(name="bench-publish", default=False)
def bench_publish(session: nox.Session) -> None:
    """The HTML pages of the committed results (``asv_benchmarks/html/``, not committed),
    which the docs' performance page links to."""
    session.install("-e", ".[bench]")
    session.chdir("asv_benchmarks")
    session.run("asv", "publish")


@nox.session
def build(session: nox.Session) -> None:
    """Build the sdist and wheel, check them with twine, then install the wheel in a fresh venv.

    The installed package runs its demo and imports its public subpackages from outside the
    source tree, so a module or data file missing from the wheel fails here.
    """
    session.install("build", "twine")
    tmp = Path(session.create_tmp()).resolve()
    dist = tmp / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist))
    built = sorted(str(p) for p in dist.iterdir())
    session.run("twine", "check", "--strict", *built)

    (wheel,) = dist.glob("*.whl")
    venv = tmp / "wheel-venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    python = str(venv / ("Scripts" if sys.platform == "win32" else "bin") / "python")
    session.run(python, "-m", "pip", "install", str(wheel), external=True)
    session.chdir(tmp)
    session.run(python, "-m", "sdpa_array", "demo", "--backend", "numpy", external=True)
    session.run(
        python,
        "-c",
        "import sdpa_array, sdpa_array.testing, sdpa_array.lab; print(sdpa_array.__version__)",
        external=True,
    )
