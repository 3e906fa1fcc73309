"""Signed versions: Ed25519 keys, the trainer's :class:`Signer`, and the reader's :class:`TrustPolicy`.

The one place where signatures are made and checked (docs/SECURITY.md has the threat
model, FORMAT.md "Signatures" the exact bytes). A trainer signs each manifest (a
detached document at ``signatures/<manifest sha256>.json``, written before the
manifest) and each head it writes (a ``HeadV2``); a reader whose :class:`~bulletin.run.Run`
holds a :class:`TrustPolicy` checks every head and every manifest it reads by number
as it reads it, before any shard is downloaded:

>>> signer = Signer.from_file("trainer.key")                     # Publisher(..., signing_key=signer)
>>> trust = TrustPolicy.from_files(["trainer.pub"], max_head_age=600)
>>> Subscriber(store, "grpo", "/var/lib/bulletin/grpo", trust=trust)

A refusal is an :class:`~bulletin.errors.UntrustedVersion`: ``Unsigned``, ``UntrustedKey``,
``BadSignature``, ``HeadRolledBack`` (a head older than the newest this policy accepted
for the run) or ``StaleHead`` (older than ``max_head_age``).

Keys are read from PEM (PKCS #8 private keys, SubjectPublicKeyInfo public keys, as
``bulletin keygen`` writes them), OpenSSH (``ssh-keygen -t ed25519``), 32 raw bytes, or
64 hex digits; from files or from the environment (:data:`SIGNING_KEY_ENV`,
:data:`SIGNING_KEY_FILE_ENV`, :data:`TRUSTED_KEYS_ENV`, :data:`MAX_HEAD_AGE_ENV`).
A key's id is the first 16 bytes of the SHA-256 of its 32 raw public bytes, in hex.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from bulletin.errors import (
    BadSignature,
    ConfigError,
    FormatError,
    HeadRolledBack,
    StaleHead,
    Unsigned,
    UntrustedKey,
)
from bulletin.fileio import fsync_dir, local_error, os_errors
from schemas.head import Head, HeadV2
from schemas.signature import Signature, SignatureV1, head_message, manifest_message, parse_signature

__all__ = [
    "MAX_HEAD_AGE_ENV",
    "SIGNING_KEY_ENV",
    "SIGNING_KEY_FILE_ENV",
    "TRUSTED_KEYS_ENV",
    "Signer",
    "TrustPolicy",
    "as_signer",
    "generate_key_files",
    "key_id",
    "load_private_key",
    "load_public_key",
    "load_signer",
    "load_trust",
    "parse_private_key",
    "parse_public_key",
]

#: The trainer's private key itself (PEM text or 64 hex digits), for secret stores that inject variables.
SIGNING_KEY_ENV: Final = "BULLETIN_SIGNING_KEY"
#: A file holding the trainer's private key.
SIGNING_KEY_FILE_ENV: Final = "BULLETIN_SIGNING_KEY_FILE"
#: Files of trusted public keys, separated by ``os.pathsep`` (``:``), as ``--trusted-key`` takes them.
TRUSTED_KEYS_ENV: Final = "BULLETIN_TRUSTED_KEYS"
#: Seconds after which a signed head is refused as stale (``--max-head-age``).
MAX_HEAD_AGE_ENV: Final = "BULLETIN_MAX_HEAD_AGE"

#: Key files are small; anything larger is not one.
_MAX_KEY_FILE_BYTES: Final = 64 << 10

log = logging.getLogger("bulletin.signing")


def key_id(public: Ed25519PublicKey) -> str:
    """The key's id: the first 16 bytes of the SHA-256 of its 32 raw bytes, in hex."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def _raw32(data: bytes) -> bytes | None:
    """The 32 key bytes of a raw or hex key file, or None for another encoding."""
    if len(data) == 32 and not data.strip().startswith(b"-----"):
        return data
    text = data.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
    return None


def parse_private_key(data: bytes, *, source: str) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM (PKCS #8), OpenSSH, 32 raw bytes or 64 hex digits;
    ``ConfigError`` for anything else (another algorithm, an encrypted or public key)."""
    raw = _raw32(data)
    try:
        if raw is not None:
            return Ed25519PrivateKey.from_private_bytes(raw)
        text = data.strip()
        if text.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----"):
            key: object = serialization.load_ssh_private_key(text, password=None)
        elif text.startswith(b"-----BEGIN") and b"PRIVATE KEY-----" in text.split(b"\n", 1)[0]:
            key = serialization.load_pem_private_key(text, password=None)
        else:
            raise ConfigError(
                f"{source}: not a private key (PEM, OpenSSH, 32 raw bytes or 64 hex digits); "
                "a public key verifies, it cannot sign"
            )
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{source}: cannot read the private key ({exc}); encrypted keys are not supported") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{source}: a {type(key).__name__}, not an Ed25519 private key")
    return key


def parse_public_key(data: bytes, *, source: str) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM (SubjectPublicKeyInfo), OpenSSH (``ssh-ed25519 ...``),
    32 raw bytes or 64 hex digits; ``ConfigError`` for anything else. A private key is
    refused: trusted keys are distributed as public keys only."""
    text = data.strip()
    if b"PRIVATE KEY-----" in text.split(b"\n", 1)[0]:
        raise ConfigError(f"{source}: a private key; trust its public key instead (bulletin keygen writes both)")
    raw = _raw32(data)
    try:
        if raw is not None:
            return Ed25519PublicKey.from_public_bytes(raw)
        if text.startswith(b"ssh-ed25519 "):
            key: object = serialization.load_ssh_public_key(text)
        elif text.startswith(b"-----BEGIN PUBLIC KEY-----"):
            key = serialization.load_pem_public_key(text)
        else:
            raise ConfigError(f"{source}: not a public key (PEM, OpenSSH, 32 raw bytes or 64 hex digits)")
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{source}: cannot read the public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{source}: a {type(key).__name__}, not an Ed25519 public key")
    return key


def _read_key_file(path: str | os.PathLike[str]) -> bytes:
    where = Path(path)
    try:
        with where.open("rb") as file:
            data = file.read(_MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"no key file at {where}") from None
    except OSError as exc:
        raise local_error(exc, f"cannot read the key file {where}") from exc
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{where}: larger than any key file ({_MAX_KEY_FILE_BYTES} bytes)")
    return data


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The private key in the file ``path`` (see :func:`parse_private_key`). A file others
    may read is used, with a warning: the key signs what every node will serve."""
    key = parse_private_key(_read_key_file(path), source=str(path))
    with os_errors(f"cannot stat the key file {path}"):
        mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: the private key file is readable by others (mode %o); chmod 600 it", path, mode & 0o777)
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """The public key in the file ``path`` (see :func:`parse_public_key`)."""
    return parse_public_key(_read_key_file(path), source=str(path))


def generate_key_files(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str]) -> str:
    """Write a new key pair: the private key as PEM (PKCS #8, unencrypted) to a file created
    with mode 0600, the public key as PEM beside it; returns the key id. Refuses
    (``ConfigError``) to overwrite either file."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    written: list[Path] = []
    try:
        for path, data, mode in ((Path(private_path), private_pem, 0o600), (Path(public_path), public_pem, 0o644)):
            try:
                # Created with its final mode (never a moment readable by others), and never over a key.
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                raise ConfigError(f"{path} exists; not overwriting a key file") from None
            except OSError as exc:
                raise local_error(exc, f"cannot create the key file {path}") from exc
            written.append(path)
            with os_errors(f"cannot write the key file {path}"):
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                fsync_dir(path.parent)
    except BaseException:
        for path in written:  # no half key pair left behind
            path.unlink(missing_ok=True)
        raise
    return key_id(key.public_key())


class Signer:
    """Signs a trainer's manifests and heads with one Ed25519 private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key: Final = private_key.public_key()
        self.key_id: Final = key_id(self.public_key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Signer:
        return cls(load_private_key(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Signer | None:
        """The signer :data:`SIGNING_KEY_ENV` (the key) or :data:`SIGNING_KEY_FILE_ENV` (a file)
        names, or None when neither is set; ``ConfigError`` when both are."""
        env = os.environ if environ is None else environ
        text, path = env.get(SIGNING_KEY_ENV), env.get(SIGNING_KEY_FILE_ENV)
        if text and path:
            raise ConfigError(f"set {SIGNING_KEY_ENV} or {SIGNING_KEY_FILE_ENV}, not both")
        if text:
            return cls(parse_private_key(text.encode(), source=f"${SIGNING_KEY_ENV}"))
        return cls.from_file(path) if path else None

    def _sign(self, message: bytes) -> Signature:
        return Signature(key_id=self.key_id, value=self._key.sign(message).hex())

    def sign_manifest(self, manifest_digest: str) -> SignatureV1:
        """The detached signature of the manifest whose exact bytes hash to ``manifest_digest``."""
        return SignatureV1(
            manifest_digest=manifest_digest, signature=self._sign(manifest_message(self.key_id, manifest_digest))
        )

    def sign_head(self, run: str, version: int, manifest_digest: str, updated_at: datetime) -> HeadV2:
        """A signed head pointing at ``version`` (``updated_at`` must carry its UTC offset)."""
        signature = self._sign(head_message(self.key_id, run, version, manifest_digest, updated_at))
        return HeadV2(
            run=run, version=version, manifest_digest=manifest_digest, updated_at=updated_at, signature=signature
        )

    def __repr__(self) -> str:
        return f"Signer(key_id={self.key_id!r})"


def _seconds(max_head_age: float | timedelta | None) -> timedelta | None:
    if max_head_age is None:
        return None
    age = max_head_age if isinstance(max_head_age, timedelta) else timedelta(seconds=float(max_head_age))
    if not math.isfinite(age.total_seconds()) or age <= timedelta(0):
        raise ConfigError(f"max_head_age must be a positive number of seconds, not {max_head_age!r}")
    return age


def _now() -> datetime:
    return datetime.now(UTC)


class TrustPolicy:
    """What a reader accepts: heads and manifests signed by one of ``trusted_keys``.

    It also remembers, per run, the newest head version it accepted (in memory, for its
    lifetime): an older head is :class:`~bulletin.errors.HeadRolledBack`, however validly
    signed (an old head replayed). With ``max_head_age``, a signed head whose
    ``updated_at`` is older than that is :class:`~bulletin.errors.StaleHead` (a frozen
    head, newer versions withheld). Thread-safe; share one policy between the Runs of
    one node (every store it reads the run from) so that they share its memory.
    """

    def __init__(
        self,
        trusted_keys: Iterable[Ed25519PublicKey],
        *,
        max_head_age: float | timedelta | None = None,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        for public in trusted_keys:
            if not isinstance(public, Ed25519PublicKey):
                raise ConfigError(f"trusted keys are Ed25519 public keys, not {type(public).__name__}")
            self._keys[key_id(public)] = public
        if not self._keys:
            raise ConfigError("a trust policy needs at least one trusted key")
        self.max_head_age: Final = _seconds(max_head_age)
        self._clock = clock
        self._lock = threading.Lock()
        self._newest: dict[str, int] = {}

    @classmethod
    def from_files(
        cls, paths: Iterable[str | os.PathLike[str]], *, max_head_age: float | timedelta | None = None
    ) -> TrustPolicy:
        return cls([load_public_key(p) for p in paths], max_head_age=max_head_age)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrustPolicy | None:
        """The policy :data:`TRUSTED_KEYS_ENV` and :data:`MAX_HEAD_AGE_ENV` describe, or None
        when no trusted key is set (``ConfigError`` for a staleness bound without keys)."""
        env = os.environ if environ is None else environ
        paths = [p for p in env.get(TRUSTED_KEYS_ENV, "").split(os.pathsep) if p]
        age = env.get(MAX_HEAD_AGE_ENV) or None
        try:
            seconds = float(age) if age is not None else None
        except ValueError:
            raise ConfigError(f"{MAX_HEAD_AGE_ENV} must be a number of seconds, not {age!r}") from None
        return load_trust(paths, seconds)

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset(self._keys)

    def newest_head(self, run: str) -> int | None:
        """The newest head version this policy accepted for ``run`` (None: none yet)."""
        with self._lock:
            return self._newest.get(run)

    def _verify(self, signature: Signature, message: bytes, what: str) -> None:
        public = self._keys.get(signature.key_id)
        if public is None:
            raise UntrustedKey(
                f"{what}: signed by key {signature.key_id}, which is not trusted here "
                f"(trusted: {', '.join(sorted(self._keys))})"
            )
        try:
            public.verify(bytes.fromhex(signature.value), message)
        except InvalidSignature:
            raise BadSignature(
                f"{what}: the signature by key {signature.key_id} does not verify: forged or damaged"
            ) from None

    def verify_manifest(self, run: str, manifest_digest: str, document: bytes | None, *, source: str) -> None:
        """Accept the manifest of ``run`` whose bytes hash to ``manifest_digest`` only if
        ``document`` (its detached signature's bytes; None when there is none) is a valid
        signature of exactly that digest by a trusted key."""
        what = f"{source} (manifest {manifest_digest[:16]}...)"
        if document is None:
            raise Unsigned(f"{what}: has no signature; this node takes only versions signed by a trusted key")
        try:
            signed = parse_signature(document, source=f"{run}: signature of {manifest_digest[:16]}...")
        except FormatError as exc:
            raise BadSignature(f"{what}: its signature document is unreadable: {exc}") from exc
        if signed.manifest_digest != manifest_digest:
            raise BadSignature(
                f"{what}: the signature found signs another manifest ({signed.manifest_digest[:16]}...): "
                "copied from another version"
            )
        self._verify(signed.signature, manifest_message(signed.signature.key_id, manifest_digest), what)

    def verify_head(self, run: str, head: Head, *, source: str) -> None:
        """Accept ``head`` of ``run`` only if it is a ``HeadV2`` signed by a trusted key, for
        this run, not older than ``max_head_age``, and not older than the newest head this
        policy accepted for the run (which it then becomes)."""
        if not isinstance(head, HeadV2):
            raise Unsigned(f"{source}: the head is not signed; this node takes only heads signed by a trusted key")
        self._verify(head.signature, head.message(), f"{source} (version {head.version})")
        if head.run != run:
            raise BadSignature(f"{source}: a head signed for run {head.run!r}, read as run {run!r}")
        if self.max_head_age is not None:
            age = self._clock() - head.updated_at
            if age > self.max_head_age:
                raise StaleHead(
                    f"{source}: the head (version {head.version}) was signed {age.total_seconds():.0f} s ago, "
                    f"more than the {self.max_head_age.total_seconds():.0f} s allowed: newer versions may be "
                    "withheld, or the trainer stopped publishing"
                )
        with self._lock:
            newest = self._newest.get(run, 0)
            if head.version < newest:
                raise HeadRolledBack(
                    f"{source}: the head names version {head.version}, but a head of version {newest} was "
                    "already accepted here: an old head replayed, or a copy behind the one seen"
                )
            self._newest[run] = head.version

    def __repr__(self) -> str:
        return f"TrustPolicy(key_ids={sorted(self._keys)}, max_head_age={self.max_head_age})"


def load_trust(
    trusted_keys: Iterable[str | os.PathLike[str]], max_head_age: float | timedelta | None = None
) -> TrustPolicy | None:
    """The policy of ``--trusted-key`` / ``--max-head-age``: None without trusted keys (any
    version is taken, as before signing existed); ``ConfigError`` for a staleness bound
    without keys, which could not be checked."""
    paths = list(trusted_keys)
    if not paths:
        if max_head_age is not None:
            raise ConfigError("--max-head-age needs --trusted-key: only a signed head's age can be trusted")
        return None
    return TrustPolicy.from_files(paths, max_head_age=max_head_age)


def as_signer(signing_key: Signer | str | os.PathLike[str] | None) -> Signer | None:
    """A publisher's ``signing_key`` argument as a signer: a :class:`Signer` as it is, a
    private key file loaded, None (unsigned) as it is."""
    return signing_key if isinstance(signing_key, Signer) or signing_key is None else Signer.from_file(signing_key)


def load_signer(path: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None) -> Signer | None:
    """The signer of ``--signing-key``: the key file ``path``, else the environment's
    (:meth:`Signer.from_env`), else None (unsigned)."""
    return Signer.from_file(path) if path is not None else Signer.from_env(environ)
