"""The command line: ``python -m sdpa_array [demo|bench|experiments|gpu-check] ...``
(``demo`` by default).

``explain`` is not a command: :func:`sdpa_array.explain` describes the plan of one call, and
the command that ran the Theory page's experiments under that name is ``experiments``.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": (f"{__name__}.demo", "compare every installed backend and dtype with the oracle"),
    "bench": (f"{__name__}.bench", "time our implementations against torch's native kernel"),
    "experiments": (
        f"{__name__}.experiments",
        "run the 'why it works' experiments of the Theory page and draw figures",
    ),
    "gpu-check": (
        f"{__name__}.gpu_check",
        "verify and measure every GPU path (--cpu-rehearsal: the same on the CPU)",
    ),
}

#: Names that are not commands, and what the caller may have meant.
NOT_COMMANDS = {
    "explain": (
        "'explain' is not a command: sdpa_array.explain(query, key, value, **options) "
        "returns the plan of one call (print it to read it), and the Theory page's "
        "experiments run with 'python -m sdpa_array experiments --out DIR'"
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a sub-command's ``main``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m sdpa_array [command] [options]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<11} {text}")
        return 0
    command = args.pop(0) if args and not args[0].startswith("-") else "demo"
    if command in NOT_COMMANDS:
        print(NOT_COMMANDS[command], file=sys.stderr)
        return 2
    if command not in COMMANDS:
        print(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(args))
