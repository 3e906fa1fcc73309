"""Fixtures of the signing tests: key pairs on disk, and a fresh store of each real kind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from bulletin.signing import Signer, TrustPolicy, generate_key_files


@dataclass(frozen=True)
class KeyPair:
    """A key pair as ``bulletin keygen`` writes it."""

    private: Path
    public: Path
    key_id: str

    def signer(self) -> Signer:
        return Signer.from_file(self.private)


def make_key(folder: Path, name: str) -> KeyPair:
    private, public = folder / name, folder / f"{name}.pub"
    key_id = generate_key_files(private, public)
    return KeyPair(private, public, key_id)


@pytest.fixture
def trainer_key(tmp_path: Path) -> KeyPair:
    """The trainer's key: the one the nodes trust."""
    return make_key(tmp_path, "trainer")


@pytest.fixture
def attacker_key(tmp_path: Path) -> KeyPair:
    """A key nobody trusts (an attacker's own, or a trainer's that was never distributed)."""
    return make_key(tmp_path, "attacker")


@pytest.fixture
def trust(trainer_key: KeyPair) -> TrustPolicy:
    return TrustPolicy.from_files([trainer_key.public])


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store: a local directory, and a LocalStack bucket (skipped without one)."""
    if request.param == "s3":
        url: str = request.getfixturevalue("s3_url")
        return url
    return str(tmp_path / "bucket")
