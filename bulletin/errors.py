"""The one rooted exception tree of Bulletin.

The root and the kinds the pure codecs raise live in :mod:`patcher.errors` (the
ground floor owns its errors); they are re-exported here as the same objects, so
``from bulletin.errors import X`` works for every kind and a caller catches one
``BulletinError``. The kinds only the I/O layer raises are defined below.

Errors are grouped by what a caller does about them:

- ``InvalidInput``: the caller passed something wrong; fix the call.
- ``CorruptData``: bytes read back are not what the format allows; refetch or alert.
- ``WrongBase``: a patch meets bits it was not made for; resync from a keyframe.
- ``NotFound``: the thing does not exist (also a ``KeyError``).
- ``Conflict``: someone else won a race (a stale or second trainer).
- ``StorageUnavailable``: the bucket cannot be reached or refuses us; retry later or
  fix credentials (also an ``OSError``).
- ``EngineError``: the inference engine failed or refused; retry later or check it.
- ``InternalError``: an invariant of Bulletin broke; a bug to report.

Every class has a stable ``code`` used by the CLI's ``--json`` output and by the
sidecar's error bodies; the CLI's exit status per kind is tabled in
``docs/ARCHITECTURE.md``. Storage backends translate their client's exceptions into
this tree at the storage boundary only, keeping the original as ``__cause__``.
Lost compare-and-swap races are *not* exceptions inside the storage protocol
(they are ordinary return values); ``Conflict`` is raised by higher layers that
cannot proceed after losing.
"""

from __future__ import annotations

from patcher.errors import (
    BulletinError,
    CorruptData,
    FormatError,
    IncompatibleTensors,
    InternalError,
    InvalidInput,
    InvalidTensorName,
    UnsupportedDtype,
    UnsupportedFormatVersion,
    VerificationFailed,
    WrongBase,
)

__all__ = [
    "AccessDenied",
    "BulletinError",
    "ConfigError",
    "Conflict",
    "CorruptData",
    "DigestMismatch",
    "EngineError",
    "FingerprintMismatch",
    "FormatError",
    "IncompatibleTensors",
    "InternalError",
    "InvalidInput",
    "InvalidTensorName",
    "NotFound",
    "StorageUnavailable",
    "UnsupportedDtype",
    "UnsupportedFormatVersion",
    "VerificationFailed",
    "VersionConflict",
    "VersionNotFound",
    "WrongBase",
]


# -- the caller's fault ------------------------------------------------------------


class ConfigError(InvalidInput):
    """A store URL, flag or environment setting cannot be used."""

    code = "config_error"


# -- bytes that are not what they claim ---------------------------------------------


class DigestMismatch(CorruptData):
    """Content does not hash to the digest its manifest promises."""

    code = "digest_mismatch"


class FingerprintMismatch(CorruptData):
    """Stored tensors or patch headers disagree with the fingerprints their manifest records.

    The bytes passed their SHA-256 digests, so the version as written is inconsistent
    (a keyframe tensor that does not hash to its manifest's fingerprint); the bits a
    node holds are not at fault, unlike ``VerificationFailed``.
    """

    code = "fingerprint_mismatch"


# -- existence and races -------------------------------------------------------------


class NotFound(BulletinError, KeyError):
    """The object, run or version does not exist."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable.
        return str(self.args[0]) if self.args else self.__class__.__name__


class VersionNotFound(NotFound):
    """The requested version is not (or no longer) in the chain."""

    code = "version_not_found"


class Conflict(BulletinError):
    """Another writer won a race for the same object."""

    code = "conflict"


class VersionConflict(Conflict):
    """The version a trainer tried to commit was committed by someone else."""

    code = "version_conflict"


# -- the bucket -----------------------------------------------------------------------


class StorageUnavailable(BulletinError, OSError):
    """The store cannot be reached, timed out, or failed after retries."""

    code = "storage_unavailable"


class AccessDenied(StorageUnavailable):
    """Credentials are missing or wrong, or the bucket does not exist."""

    code = "access_denied"


# -- the serving engine ------------------------------------------------------------------


class EngineError(BulletinError):
    """The inference engine could not be reached, or refused or failed to load a version.

    The version it served before stays the one reported; retry later or check the engine.
    """

    code = "engine_error"
