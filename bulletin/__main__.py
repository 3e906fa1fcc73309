"""``python -m bulletin``."""

import sys

from bulletin.cli import main

sys.exit(main())
