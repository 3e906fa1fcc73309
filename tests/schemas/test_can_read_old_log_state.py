"""A log-layout replica's state stays readable (committed golden files; docs/FORMAT.md 9.1).

``tests/golden/documents/log-layout`` holds the ``state.json`` (spec_version 3) and the
log files of a LogDirTarget taken from version 1 to 3 of tests/targets/contract.py's
versions. They are never regenerated: a reader that stops accepting them, or a writer
that would serialise the same state differently, fails here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from bulletin.errors import FormatError, UnsupportedFormatVersion
from bulletin.replica_log import decode_log
from patcher.fingerprint import format_fingerprint
from schemas.local_state import LocalStateV3, parse_local_state
from tests.targets.contract import FPS, SPECS

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "documents" / "log-layout"


def test_v3_local_state_and_its_log_stay_readable() -> None:
    data = (GOLDEN / "state.json").read_bytes()
    state = parse_local_state(data, source="golden")
    assert type(state) is LocalStateV3 and (state.base_version, state.version) == (1, 3)
    assert state.model_dump_json().encode() == data
    assert state.base_fingerprints == {n: format_fingerprint(f) for n, f in sorted(FPS[1].items())}
    assert state.fingerprints == {n: format_fingerprint(f) for n, f in sorted(FPS[3].items())}
    fps = dict(FPS[1])
    for entry in state.log:
        raw = (GOLDEN / entry.file).read_bytes()
        assert (len(raw), hashlib.sha256(raw).hexdigest()) == (entry.size, entry.sha256)
        patch = decode_log(raw, SPECS, source=entry.file)
        assert {td.spec.name: td.base_fingerprint for td in patch} == fps  # the chain from the base
        fps = {td.spec.name: td.target_fingerprint for td in patch}
        assert fps == FPS[entry.version]
    with pytest.raises(FormatError):  # a log whose versions do not end at or below version
        parse_local_state(data.replace(b'"version":3,', b'"version":2,', 1), source="golden")
    with pytest.raises(UnsupportedFormatVersion):
        parse_local_state(data.replace(b'"spec_version":3', b'"spec_version":4'), source="golden")
