"""The package's layout keeps its promises: no import circle, small modules, no reaching
into another module's private names, no optional library loaded by ``import sdpa_array``.

These read the source with :mod:`ast` and import nothing of the package, except those that
ask what ``import sdpa_array`` loads (in a child process) and what ``dir()`` lists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sdpa_array"

#: A module longer than this is split (the architecture's rule of thumb).
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, list[str]]]:
    """``(module, imported names)`` for each ``import``/``from`` of the package in ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            if target in MODULES:
                submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
                found.extend((m, []) for m in submodules)
                found.append((target, [n for n in names if f"{target}.{n}" not in MODULES]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names if a.name in MODULES)
    return found


def test_no_import_circle():
    graph = {name: {m for m, _ in _imports(name) if m != name} for name in MODULES}
    # a package's own __init__ is imported on the way to its submodules: not an edge back
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in MODULES:
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES})"


def test_no_private_names_across_modules():
    """A module imports another's public names (or a private module's public names)."""
    offences = [
        f"{name} imports {target}.{n}"
        for name in MODULES
        for target, names in _imports(name)
        for n in names
        if n.startswith("_") and n != "__version__"
    ]
    assert not offences, "\n".join(offences)


def test_importing_the_package_loads_no_optional_library():
    """``import sdpa_array`` loads none of the optional array libraries or Triton: a NumPy
    user pays for none of them, and ``TRITON_INTERPRET`` may still be set afterwards."""
    import subprocess
    import sys

    optional = ("triton", "torch", "jax", "cupy", "dask")
    code = f"import sys, sdpa_array; print([m for m in {optional!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dir_lists_the_public_names_only():
    """``dir()`` (tab completion) shows what a user may call: every exported name, the
    torch layer and the subpackages, and none of the modules the package imports for
    itself."""
    import sdpa_array

    listed = dir(sdpa_array)
    assert set(sdpa_array.__all__) <= set(listed)
    assert {"MultiheadAttention", "reference", "testing", "__version__"} <= set(listed)
    assert not {"sys", "types", "version", "PackageNotFoundError"} & set(listed)
    assert all(not name.startswith("_") or name == "__version__" for name in listed)
    assert dir(sdpa_array.nn) == ["MultiheadAttention"]
    for name in listed:  # each listed name is there
        if name != "MultiheadAttention":  # imports torch, which this session may lack
            getattr(sdpa_array, name)


#: The public functions, which keep their keywords one by one (the oracle's and the
#: library's), and the records the options are gathered into (the validated ``Problem``
#: takes them by name, once).
TAKE_OPTIONS = {
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "scaled_dot_product_attention_varlen",
    "scaled_dot_product_attention_varlen_vjp",
    "intermediates",
}
RECORDS = {"Problem"}


def _option_names(module: str, record: str) -> set[str]:
    """The fields of the options record ``record`` in ``module`` (a path under the package)."""
    tree = ast.parse((PACKAGE / module).read_text())
    (options,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == record]
    return {n.target.id for n in options.body if isinstance(n, ast.AnnAssign)}


def test_options_are_gathered_once():
    """No function takes ten or more of the options one by one and no call passes ten or
    more option keywords, but the public functions (their keywords) and the validated
    record: the public functions gather them (``Options.gather``, ``OracleOptions.gather``)
    and hand on the record. The oracle's options are its own record."""
    library = _option_names("_problem/options.py", "Options")
    oracle = _option_names("reference/_options.py", "OracleOptions")
    assert len(library) >= 10
    assert len(oracle) >= 10
    crowded = []
    for path in PACKAGE.rglob("*.py"):
        names = oracle if "reference" in path.parts else library
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name not in TAKE_OPTIONS:
                a = node.args
                taken = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)} & names
                if len(taken) >= 10:
                    crowded.append(f"{path.name}:{node.lineno} def {node.name}")
            if (
                isinstance(node, ast.Call)
                and len({k.arg for k in node.keywords} & names) >= 10
                and ast.unparse(node.func) not in RECORDS
            ):
                crowded.append(f"{path.name}:{node.lineno} call {ast.unparse(node.func)}")
    assert crowded == []


#: The most lines of code (the docstring aside) of a public entry point, which reads as: check
#: and gather the arguments, plan, run, shape the result.
MAX_ENTRY_LINES = 40


def _public_names() -> set[str]:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            return set(ast.literal_eval(node.value))
    raise AssertionError("sdpa_array/__init__.py has no __all__")


def test_entry_points_are_short():
    """Each public function of the face, and the torch module's ``forward``, has at most
    :data:`MAX_ENTRY_LINES` lines of code; the argument handling they share lives in
    ``_api/call.py`` and ``_api/kv_cache/call.py``."""
    public = _public_names() | {"forward"}
    lengths = {}
    for path in (PACKAGE / "_api").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in public:
                body = node.body
                documented = isinstance(body[0], ast.Expr) and isinstance(
                    body[0].value, ast.Constant
                )
                first = body[1] if documented and len(body) > 1 else body[0]
                lengths[f"{path.name}:{node.name}"] = (node.end_lineno or 0) - first.lineno + 1
    assert "forward.py:scaled_dot_product_attention" in lengths
    assert "api.py:attention_with_kv_cache" in lengths
    assert {k: n for k, n in lengths.items() if n > MAX_ENTRY_LINES} == {}
