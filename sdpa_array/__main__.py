"""``python -m sdpa_array``: see :mod:`sdpa_array._cli`."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
