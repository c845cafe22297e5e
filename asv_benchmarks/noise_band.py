"""The noise band of the history selection, for the regression gate's factor.

Measures every figure of ``benchmarks/history.py`` ``N`` times on this checkout, one after
the other in one process, and prints each figure's values and max / min: ``nox -s
bench-compare``'s factor (``GATE_FACTOR`` in ``noxfile.py``) must be at least the widest.
Usage (from the repository root)::

    python asv_benchmarks/noise_band.py 3
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.history import Ratios


def main(argv: list[str]) -> int:
    repeats = int(argv[0]) if argv else 3
    runs = [Ratios().setup_cache() for _ in range(repeats)]
    widest = 1.0
    print(f"{'figure':<28} {'values':<40} max/min")
    for name in runs[0]:
        values = [run[name] for run in runs]
        if any(v != v for v in values):
            continue
        band = max(values) / min(values)
        widest = max(widest, band)
        print(f"{name:<28} {' '.join(f'{v:.3f}' for v in values):<40} {band:.3f}")
    print(f"widest band: {widest:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
