"""The one rooted exception tree of Bulletin.

Errors are grouped by what a caller does about them:

- ``InvalidInput``: the caller passed something wrong; fix the call.
- ``CorruptData``: bytes read back are not what the format allows; refetch or alert.
- ``WrongBase``: a patch meets bits it was not made for; resync from a keyframe.
- ``NotFound``: the thing does not exist (also a ``KeyError``).
- ``Conflict``: someone else won a race (a stale or second trainer).
- ``StorageUnavailable``: the bucket cannot be reached or refuses us; retry later or
  fix credentials (also an ``OSError``).

Every class has a stable ``code`` used by the CLI's ``--json`` output and by the
sidecar's error bodies. Storage backends translate their client's exceptions into
this tree at the storage boundary only, keeping the original as ``__cause__``.
Lost compare-and-swap races are *not* exceptions inside the storage protocol
(they are ordinary return values); ``Conflict`` is raised by higher layers that
cannot proceed after losing.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AccessDenied",
    "BulletinError",
    "ConfigError",
    "Conflict",
    "CorruptData",
    "DigestMismatch",
    "EngineError",
    "FormatError",
    "IncompatibleTensors",
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


class BulletinError(Exception):
    """Root of every error Bulletin raises on purpose."""

    code: ClassVar[str] = "bulletin_error"


# -- the caller's fault ------------------------------------------------------------


class InvalidInput(BulletinError, ValueError):
    """An argument, file or request is not acceptable. Nothing was changed."""

    code = "invalid_input"


class ConfigError(InvalidInput):
    """A store URL, flag or environment setting cannot be used."""

    code = "config_error"


class UnsupportedDtype(InvalidInput):
    """A tensor dtype Bulletin cannot carry bit-exactly."""

    code = "unsupported_dtype"


class InvalidTensorName(InvalidInput):
    """A tensor name that is empty, too long, or path-like."""

    code = "invalid_tensor_name"


class IncompatibleTensors(InvalidInput):
    """Two tensor sets that should share names, dtypes and shapes do not."""

    code = "incompatible_tensors"


# -- bytes that are not what they claim ---------------------------------------------


class CorruptData(BulletinError, ValueError):
    """Stored or received bytes violate the format. Nothing was applied."""

    code = "corrupt_data"


class FormatError(CorruptData):
    """Bad magic, bad header, bad lengths, overlapping or out-of-range data."""

    code = "format_error"


class UnsupportedFormatVersion(FormatError):
    """A document or shard written by a spec version this reader does not know."""

    code = "unsupported_format_version"


class DigestMismatch(CorruptData):
    """Content does not hash to the digest its manifest promises."""

    code = "digest_mismatch"


# -- bits that do not match ----------------------------------------------------------


class WrongBase(BulletinError):
    """A patch meets a base it was not made for; detected before anything changed."""

    code = "wrong_base"


class VerificationFailed(WrongBase):
    """Bits after an apply (or on disk) do not match the recorded fingerprint."""

    code = "verification_failed"


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
