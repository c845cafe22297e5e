"""``python -m sdpa_array``: see :mod:`sdpa_array.lab.cli`."""

import sys

from .lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
