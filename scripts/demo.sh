#!/usr/bin/env bash
# The main job on the embedded default: `bulletin demo` on a local directory bucket.
# Creates .venv (Python 3.11+) with Bulletin's core dependencies on first use.
# Extra arguments go to `bulletin demo` (see `bulletin demo --help`).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "scripts/demo.sh: needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
    "$python" -m venv .venv
fi
# The compiled codec (patcher/_speedups.c) is built by the install: its source is in the stamp.
stamp=".venv/.bulletin-core-$(cat pyproject.toml setup.py patcher/_speedups.c | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e .
    touch "$stamp"
fi
exec .venv/bin/bulletin demo "$@"
