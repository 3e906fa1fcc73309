"""Where a run's objects live inside a bucket (FORMAT.md, "Key layout").

::

    <run>/head.json                                    the only mutable object
    <run>/manifests/<version:020d>.json                 one per committed version
    <run>/patches/<version:020d>/<sha256>.bpatch        shards of the transition version-1 -> version
    <run>/keyframes/<version:020d>-<writer>/<file>      safetensors files (+ HF index) of a keyframe
    <run>/files/<version:020d>/<sha256>                 a model file (config, tokenizer, ...) first
                                                       published with that version; later ones name it too
    <run>/signatures/<manifest sha256>.json             detached signature of one manifest's exact bytes

Versions are zero-padded so that a lexicographic listing is a numeric one. Patch
shards are named by their content digest and keyframes by their writer, so two
trainers racing for the same version never write the same key with different
bytes: the loser's objects are orphans that ``gc`` removes. Model files are named by
their content digest under the version that first uploaded them, and versions whose
files did not change name the same objects: a file is uploaded once, and since a
publisher reuses only its parent's objects (never one that ``gc`` could be removing as
unreferenced), a collection never races a commit that names an old object.
"""

from __future__ import annotations

import re
from typing import Final

from bulletin.errors import ConfigError, FormatError
from schemas.common import RUN_NAME_PATTERN

__all__ = [
    "HEAD",
    "MANIFESTS",
    "check_run_name",
    "file_key",
    "keyframe_prefix",
    "manifest_key",
    "parse_manifest_key",
    "patch_shard_key",
    "run_root",
    "signature_key",
    "version_of_data_key",
]

HEAD: Final = "head.json"
MANIFESTS: Final = "manifests/"
PATCHES: Final = "patches/"
KEYFRAMES: Final = "keyframes/"
SIGNATURES: Final = "signatures/"
FILES: Final = "files/"
_RUN_RE: Final = re.compile(RUN_NAME_PATTERN)
_MANIFEST_RE: Final = re.compile(r"^manifests/(\d{20})\.json$")
_DATA_RE: Final = re.compile(r"^(?:patches|keyframes|files)/(\d{20})(?:-[0-9a-f]+){0,2}/")


def check_run_name(run: str) -> str:
    """Run names are one path segment: letters, digits, ``.``, ``_``, ``-``; 1-128 long."""
    if not isinstance(run, str) or not _RUN_RE.match(run):
        raise ConfigError(
            f"invalid run name {run!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return run


def run_root(run: str) -> str:
    return f"{check_run_name(run)}/"


def manifest_key(version: int) -> str:
    return f"{MANIFESTS}{version:020d}.json"


def parse_manifest_key(relative_key: str) -> int:
    match = _MANIFEST_RE.match(relative_key)
    if match is None:
        raise FormatError(f"not a manifest key: {relative_key!r}")
    return int(match.group(1))


def patch_shard_key(version: int, sha256: str) -> str:
    return f"{PATCHES}{version:020d}/{sha256}.bpatch"


def keyframe_prefix(version: int, writer: str, attempt: str | None = None) -> str:
    """A keyframe's folder: its version and writer, and the writer's ``attempt`` token
    where given (a publish that failed half-way and runs again with other bits then
    never meets the files it left)."""
    return f"{KEYFRAMES}{version:020d}-{writer}" + (f"-{attempt}" if attempt else "")


def file_key(version: int, sha256: str) -> str:
    """A model file's object: its bytes' digest, under the version that first uploaded them."""
    return f"{FILES}{version:020d}/{sha256}"


def signature_key(manifest_digest: str) -> str:
    """A manifest's detached signature, named by the digest of the bytes it signs: writers
    racing for one version never write one key with different bytes."""
    return f"{SIGNATURES}{manifest_digest}.json"


def version_of_data_key(relative_key: str) -> int | None:
    """The version a patch, keyframe or file object was written with, or None for other keys."""
    match = _DATA_RE.match(relative_key)
    return int(match.group(1)) if match else None
