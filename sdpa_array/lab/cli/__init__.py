"""The command line: ``python -m sdpa_array [demo|bench|explain] ...`` (``demo`` by default)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": (f"{__name__}.demo", "compare every installed backend and dtype with the oracle"),
    "bench": (f"{__name__}.bench", "time our implementations against torch's native kernel"),
    "explain": (f"{__name__}.explain", "run the 'why it works' experiments and draw figures"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a sub-command's ``main``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m sdpa_array [command] [options]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<8} {text}")
        return 0
    command = args.pop(0) if args and not args[0].startswith("-") else "demo"
    if command not in COMMANDS:
        print(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(args))
