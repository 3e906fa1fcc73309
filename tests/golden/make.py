#!/usr/bin/env python
"""Write the golden patch shards of tests/golden/ (see tests/golden/README.md).

    python tests/golden/make.py            # writes tests/golden/v<major>/, refuses to overwrite
    python tests/golden/make.py --force    # rewrite (only after a deliberate format change)
    python tests/golden/make.py --signed   # writes tests/golden/documents/signed/ (below)

It lives beside the files it writes: the cases are test data, and scripts/ never
imports from tests/. Each case of tests/golden/cases.py is encoded and its shards written as
``<case>.<i>.shard``; ``expected.json`` records, per case, the encode arguments, each
file's SHA-256 and the decoded content (per tensor: layout, fingerprints and SHA-256 of
the index and delta arrays), plus the compression library versions that produced the
bytes. Files of an older format version are never touched: they are what the
"can read old" test keeps reading.

``--signed`` writes the signed documents instead: a head (``HeadV2``) and the detached
signature of ``documents/v1/manifest-3.json`` (``SignatureV1``), signed by a fixed test key
derived from a public seed (committed beside them as ``TEST-KEY-NOT-SECRET.pem``: it
signs test data only and must never be trusted anywhere), and ``expected.json`` with the
exact messages signed and the signatures expected (Ed25519 is deterministic).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from patcher.encode import encode  # noqa: E402
from patcher.format import FORMAT_MAJOR, FORMAT_MINOR  # noqa: E402
from tests.golden.cases import CASES, build, build_base, library_versions, summarise  # noqa: E402

DOCUMENTS = ROOT / "tests" / "golden" / "documents"
#: The test key's seed: public on purpose, so that anyone can rebuild (and no one trusts) the key.
TEST_KEY_SEED = b"bulletin golden test key: NOT SECRET, never trust it"
TEST_KEY_NAME = "TEST-KEY-NOT-SECRET"


def golden_key() -> Any:
    """The golden files' private key (an ``Ed25519PrivateKey``)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(TEST_KEY_SEED).digest())


def write_signed(out: Path, *, force: bool) -> int:
    """Write the signed golden documents of ``documents/v1/manifest-3.json`` to ``out``."""
    from cryptography.hazmat.primitives import serialization

    if out.exists() and any(out.iterdir()) and not force:
        print(f"{out} already holds golden files; pass --force to rewrite them", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    from bulletin.signing import Signer
    from schemas.signature import manifest_message

    key = golden_key()
    signer = Signer(key)
    manifest = (DOCUMENTS / "v1" / "manifest-3.json").read_bytes()
    digest = hashlib.sha256(manifest).hexdigest()
    signature = signer.sign_manifest(digest)
    head = signer.sign_head("golden-run", 3, digest, datetime(2026, 12, 1, 3, 8, 0, 824474, tzinfo=UTC))
    (out / f"{TEST_KEY_NAME}.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (out / f"{TEST_KEY_NAME}.pub.pem").write_bytes(
        signer.public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (out / "signature.v1.json").write_bytes(signature.model_dump_json().encode())
    (out / "head.v2.json").write_bytes(head.model_dump_json().encode())
    expected = {
        "key_id": signer.key_id,
        "public_key": signer.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex(),
        "manifest": "v1/manifest-3.json",
        "manifest_sha256": digest,
        "manifest_message": manifest_message(signer.key_id, digest).decode("ascii"),
        "manifest_signature": signature.signature.value,
        "head_message": head.message().decode("ascii"),
        "head_signature": head.signature.value,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    print(f"signed documents of key {signer.key_id} in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / f"v{FORMAT_MAJOR}")
    parser.add_argument("--force", action="store_true", help="overwrite existing golden files")
    parser.add_argument("--signed", action="store_true", help="write documents/signed/ instead of shards")
    args = parser.parse_args(argv)
    if args.signed:
        return write_signed(DOCUMENTS / "signed", force=args.force)
    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"{out} already holds golden files; pass --force to rewrite them", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.shard"), *out.glob("*.base.npz")]:
        old.unlink()
    cases: dict[str, Any] = {}
    for case in CASES:
        patch = build(case)
        base = build_base(case)
        shards = encode(patch, codec=case.codec, level=case.level, max_shard_bytes=case.max_shard_bytes, base=base)
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
        if base is not None:  # a context-coded case decodes against these bits
            np.savez(out / f"{case.name}.base.npz", **base)
            data = (out / f"{case.name}.base.npz").read_bytes()
            cases[case.name]["base"] = {"name": f"{case.name}.base.npz", "sha256": hashlib.sha256(data).hexdigest()}
        print(f"{case.name}: {len(shards)} shard(s), {sum(f['size'] for f in files)} bytes")
    expected = {"format": f"{FORMAT_MAJOR}.{FORMAT_MINOR}", "libraries": library_versions(), "cases": cases}
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
