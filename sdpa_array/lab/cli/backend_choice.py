"""How the commands turn ``--backend`` ids into registered backends that can run here.

An id the registry does not know is a usage error (``parser.error``: exit status 2, the
known ids on stderr); a known backend whose library or device is missing is reported on
stderr with what would make it available, and the command exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from ...testing.backends import BACKENDS, Backend, get_backend

__all__ = ["parse_backends", "report_unavailable", "unavailable_reason"]


def parse_backends(parser: argparse.ArgumentParser, text: str) -> list[Backend]:
    """The backends named in the comma-separated ``text``; unknown ids end in ``parser.error``."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        parser.error("no backend named; known backends: " + ", ".join(b.id for b in BACKENDS))
    chosen = []
    for name in names:
        try:
            chosen.append(get_backend(name))
        except ValueError as exc:
            parser.error(str(exc))
    return chosen


def unavailable_reason(backend: Backend) -> str:
    """Why ``backend`` cannot run here, and what to install (empty if it can run)."""
    if backend.is_available():
        return ""
    if not backend.is_installed():
        extra = f"pip install sdpa_array[{backend.extra}]" if backend.extra else "reinstall it"
        return f"{backend.library} is not installed ({extra})"
    if backend.needs_gpu:
        return f"it needs a CUDA GPU, and {backend.library} finds none here"
    return f"{backend.library} finds no {backend.device} device here"


def report_unavailable(backends: list[Backend]) -> bool:
    """Print a line on stderr for each backend that cannot run here; whether all can."""
    ok = True
    for backend in backends:
        reason = unavailable_reason(backend)
        if reason:
            print(
                f"backend {backend.id!r} is not available on this machine: {reason}",
                file=sys.stderr,
            )
            ok = False
    return ok
