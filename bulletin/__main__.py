"""``python -m bulletin``."""

import sys

from bulletin.cli import main

if __name__ == "__main__":
    sys.exit(main())
