#!/usr/bin/env python
"""Write the golden patch shards of tests/golden/ (see tests/golden/README.md).

    python tests/golden/make.py            # writes tests/golden/v<major>/, refuses to overwrite
    python tests/golden/make.py --force    # rewrite (only after a deliberate format change)

It lives beside the files it writes: the cases are test data, and scripts/ never
imports from tests/. Each case of tests/golden/cases.py is encoded and its shards written as
``<case>.<i>.shard``; ``expected.json`` records, per case, the encode arguments, each
file's SHA-256 and the decoded content (per tensor: layout, fingerprints and SHA-256 of
the index and delta arrays), plus the compression library versions that produced the
bytes. Files of an older format version are never touched: they are what the
"can read old" test keeps reading.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from patcher.encode import encode  # noqa: E402
from patcher.format import FORMAT_MAJOR, FORMAT_MINOR  # noqa: E402
from tests.golden.cases import CASES, build, library_versions, summarise  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / f"v{FORMAT_MAJOR}")
    parser.add_argument("--force", action="store_true", help="overwrite existing golden files")
    args = parser.parse_args(argv)
    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"{out} already holds golden files; pass --force to rewrite them", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.shard"):
        old.unlink()
    cases: dict[str, Any] = {}
    for case in CASES:
        patch = build(case)
        shards = encode(patch, codec=case.codec, level=case.level, max_shard_bytes=case.max_shard_bytes)
        files: list[dict[str, Any]] = []
        for i, data in enumerate(shards):
            name = f"{case.name}.{i}.shard"
            (out / name).write_bytes(data)
            files.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        cases[case.name] = {
            "codec": case.codec,
            "level": case.level,
            "max_shard_bytes": case.max_shard_bytes,
            "files": files,
            "patch": summarise(patch),
        }
        print(f"{case.name}: {len(shards)} shard(s), {sum(f['size'] for f in files)} bytes")
    expected = {"format": f"{FORMAT_MAJOR}.{FORMAT_MINOR}", "libraries": library_versions(), "cases": cases}
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
