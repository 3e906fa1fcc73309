"""``python -m bulletin.sidecar``: the same as ``bulletin serve``."""

from __future__ import annotations

import sys

from bulletin.cli import cli, main
from bulletin.sidecar.cli import serve

if __name__ == "__main__":
    cli.add_command(serve)  # the same command object `bulletin serve` registers
    sys.exit(main(["serve", *sys.argv[1:]]))
