"""Keys: every encoding read, ids derived from the public key, the environment, and bad keys refused."""

from __future__ import annotations

import hashlib
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from bulletin.cli.options import MAX_HEAD_AGE_ENV, SIGNING_KEY_FILE_ENV, TRUSTED_KEYS_ENV
from bulletin.errors import ConfigError, HeadRolledBack, StaleHead, Unsigned
from bulletin.signing import MAX_HEAD_AGE_ENV as SIGNING_MAX_HEAD_AGE_ENV
from bulletin.signing import SIGNING_KEY_FILE_ENV as SIGNING_SIGNING_KEY_FILE_ENV
from bulletin.signing import TRUSTED_KEYS_ENV as SIGNING_TRUSTED_KEYS_ENV
from bulletin.signing import (
    Signer,
    TrustPolicy,
    generate_key_files,
    key_id,
    load_private_key,
    load_public_key,
    load_trust,
    parse_private_key,
    parse_public_key,
)
from schemas.head import HeadV1

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
RAW_PUBLIC = KEY.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

PRIVATE_FORMS = {
    "pem": KEY.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()),
    "openssh": KEY.private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()),
    "raw": bytes(range(32)),
    "hex": bytes(range(32)).hex().encode() + b"\n",
}
PUBLIC_FORMS = {
    "pem": KEY.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo),
    "openssh": KEY.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH) + b" trainer@example\n",
    "raw": RAW_PUBLIC,
    "hex": RAW_PUBLIC.hex().encode(),
}


def test_the_key_id_is_the_public_keys_sha256_prefix() -> None:
    assert key_id(KEY.public_key()) == hashlib.sha256(RAW_PUBLIC).hexdigest()[:32]


@pytest.mark.parametrize("form", sorted(PRIVATE_FORMS))
def test_private_keys_in_every_encoding(form: str, tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(PRIVATE_FORMS[form])
    path.chmod(0o600)
    assert Signer(load_private_key(path)).key_id == key_id(KEY.public_key())


@pytest.mark.parametrize("form", sorted(PUBLIC_FORMS))
def test_public_keys_in_every_encoding(form: str, tmp_path: Path) -> None:
    path = tmp_path / "key.pub"
    path.write_bytes(PUBLIC_FORMS[form])
    assert key_id(load_public_key(path)) == key_id(KEY.public_key())


def test_keys_that_are_not_ed25519_or_not_keys_are_refused() -> None:
    ec = generate_private_key(SECP256R1())
    ec_pem = ec.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    with pytest.raises(ConfigError, match="not an Ed25519 private key"):
        parse_private_key(ec_pem, source="ec")
    ec_public = ec.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(ConfigError, match="not an Ed25519 public key"):
        parse_public_key(ec_public, source="ec")
    with pytest.raises(ConfigError, match="private key; trust its public key"):
        parse_public_key(PRIVATE_FORMS["pem"], source="pem")
    with pytest.raises(ConfigError, match="not a private key"):
        parse_private_key(PUBLIC_FORMS["pem"], source="pub")
    encrypted = KEY.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw"))
    with pytest.raises(ConfigError, match="encrypted keys are not supported"):
        parse_private_key(encrypted, source="enc")
    with pytest.raises(ConfigError, match="not a public key"):
        parse_public_key(b"hello", source="junk")


def test_missing_and_oversized_key_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no key file"):
        load_public_key(tmp_path / "absent.pub")
    big = tmp_path / "big.pub"
    big.write_bytes(b"x" * (1 << 17))
    with pytest.raises(ConfigError, match="larger than any key file"):
        load_public_key(big)


def test_keygen_creates_the_private_key_0600_and_never_overwrites(tmp_path: Path) -> None:
    private, public = tmp_path / "k", tmp_path / "k.pub"
    made = generate_key_files(private, public)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert key_id(load_public_key(public)) == made == Signer.from_file(private).key_id
    before = private.read_bytes()
    with pytest.raises(ConfigError, match="exists"):
        generate_key_files(private, tmp_path / "other.pub")
    assert private.read_bytes() == before and not (tmp_path / "other.pub").exists()
    (tmp_path / "lone.pub").write_text("taken")
    with pytest.raises(ConfigError, match="exists"):
        generate_key_files(tmp_path / "lone", tmp_path / "lone.pub")
    assert not (tmp_path / "lone").exists()  # no half key pair left


def test_keys_from_the_environment(tmp_path: Path) -> None:
    assert (SIGNING_KEY_FILE_ENV, TRUSTED_KEYS_ENV, MAX_HEAD_AGE_ENV) == (
        SIGNING_SIGNING_KEY_FILE_ENV,
        SIGNING_TRUSTED_KEYS_ENV,
        SIGNING_MAX_HEAD_AGE_ENV,
    )
    pem = PRIVATE_FORMS["pem"].decode()
    assert Signer.from_env({}) is None
    text = Signer.from_env({"BULLETIN_SIGNING_KEY": pem})
    assert text is not None and text.key_id == key_id(KEY.public_key())
    (tmp_path / "k").write_text(pem)
    from_file = Signer.from_env({"BULLETIN_SIGNING_KEY_FILE": str(tmp_path / "k")})
    assert from_file is not None and from_file.key_id == text.key_id
    with pytest.raises(ConfigError, match="not both"):
        Signer.from_env({"BULLETIN_SIGNING_KEY": pem, "BULLETIN_SIGNING_KEY_FILE": str(tmp_path / "k")})
    a, b = tmp_path / "a.pub", tmp_path / "b.pub"
    a.write_bytes(PUBLIC_FORMS["pem"])
    generate_key_files(tmp_path / "b", b)
    policy = TrustPolicy.from_env({"BULLETIN_TRUSTED_KEYS": f"{a}:{b}", "BULLETIN_MAX_HEAD_AGE": "90"})
    assert policy is not None and len(policy.key_ids) == 2
    assert policy.max_head_age == timedelta(seconds=90)
    assert TrustPolicy.from_env({}) is None
    with pytest.raises(ConfigError, match="needs"):
        TrustPolicy.from_env({"BULLETIN_MAX_HEAD_AGE": "90"})
    with pytest.raises(ConfigError, match="number of seconds"):
        TrustPolicy.from_env({"BULLETIN_TRUSTED_KEYS": str(a), "BULLETIN_MAX_HEAD_AGE": "soon"})
    assert load_trust([]) is None
    with pytest.raises(ConfigError, match="positive"):
        load_trust([a], -1)


def test_the_policy_checks_heads_in_order_signature_age_rollback() -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    signer = Signer(KEY)
    policy = TrustPolicy([KEY.public_key()], max_head_age=60, clock=lambda: now)
    digest = "ab" * 32
    with pytest.raises(Unsigned):
        policy.verify_head("run", HeadV1(run="run", version=1, manifest_digest=digest, updated_at=now), source="h")
    policy.verify_head("run", signer.sign_head("run", 5, digest, now - timedelta(seconds=59)), source="h")
    assert policy.newest_head("run") == 5 and policy.newest_head("other") is None
    with pytest.raises(StaleHead):
        policy.verify_head("run", signer.sign_head("run", 6, digest, now - timedelta(seconds=61)), source="h")
    assert policy.newest_head("run") == 5  # a refused head is not remembered
    with pytest.raises(HeadRolledBack):
        policy.verify_head("run", signer.sign_head("run", 4, digest, now), source="h")
    policy.verify_head("run", signer.sign_head("run", 5, digest, now), source="h")  # the same version again
    policy.verify_head("other", signer.sign_head("other", 1, digest, now), source="h")  # per run
