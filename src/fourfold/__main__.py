"""`python -m fourfold ...`: the same command as `fourfold ...` (the launcher starts ranks
this way)."""

import sys

from fourfold.cli import main

if __name__ == "__main__":
    sys.exit(main())
