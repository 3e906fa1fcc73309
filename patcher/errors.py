"""The root of Bulletin's exception tree, and the kinds the pure codecs raise.

The ground floor owns its errors: ``patcher``, ``kernels`` and ``schemas`` raise from
here and import nothing above them. The I/O layer's errors module re-exports every
class below (the same objects, not copies) and adds the kinds only it raises (not
found, conflicts, storage, engines), so a caller still catches one ``BulletinError``
and imports any kind from that one module. The table of kinds, codes and exit
statuses is in ``docs/ARCHITECTURE.md``.

Kinds are grouped by what a caller does about them:

- ``InvalidInput``: the caller passed something wrong; fix the call (also a ``ValueError``).
- ``CorruptData``: bytes read back are not what the format allows; refetch or alert
  (also a ``ValueError``).
- ``WrongBase``: a patch meets bits it was not made for; resync from a keyframe.
- ``InternalError``: an invariant of Bulletin itself broke; a bug to report, not
  something a caller can fix. Deliberately no builtin mixin, so that a broad
  ``except ValueError`` or ``except RuntimeError`` does not swallow it.

Every class has a stable ``code`` (CLI ``--json`` output, sidecar error bodies).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BulletinError",
    "ContextUnavailable",
    "CorruptData",
    "FormatError",
    "IncompatibleTensors",
    "InternalError",
    "InvalidInput",
    "InvalidTensorName",
    "UnsupportedDtype",
    "UnsupportedFormatVersion",
    "VerificationFailed",
    "WrongBase",
]


class BulletinError(Exception):
    """Root of every error Bulletin raises on purpose."""

    code: ClassVar[str] = "bulletin_error"


# -- the caller's fault ------------------------------------------------------------


class InvalidInput(BulletinError, ValueError):
    """An argument, file or request is not acceptable. Nothing was changed."""

    code = "invalid_input"


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


# -- bits that do not match ----------------------------------------------------------


class WrongBase(BulletinError):
    """A patch meets a base it was not made for; detected before anything changed."""

    code = "wrong_base"


class VerificationFailed(WrongBase):
    """Bits after an apply (or on disk) do not match the recorded fingerprint."""

    code = "verification_failed"


class ContextUnavailable(WrongBase):
    """A context-coded patch (docs/FORMAT.md 3.15) needs the bits of its base to decode,
    and they were not given (a target that cannot show its bits on the host). Nothing was
    changed; sync takes a keyframe route instead, decoding what follows against it."""

    code = "context_unavailable"


# -- Bulletin's own fault -------------------------------------------------------------


class InternalError(BulletinError):
    """An invariant of Bulletin itself does not hold: a bug, please report it.

    Raised where a state that earlier checks rule out is met anyway (a planned route
    missing the keyframe or patch it was planned with). Retrying will not help.
    """

    code = "internal_error"
