"""``python -m bulletin.sidecar``: the same as ``bulletin serve``."""

from __future__ import annotations

import sys

from bulletin.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
