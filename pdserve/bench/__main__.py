"""`python -m pdserve.bench ...`: the same command as `pdserve bench ...`."""

from __future__ import annotations

import sys

from pdserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
