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
- ``Conflict``: someone else won a race (a stale or second trainer, a second writer of
  a node's replica folder).
- ``StorageUnavailable``: the bucket cannot be reached or refuses us; retry later or
  fix credentials (also an ``OSError``).
- ``EngineError``: the inference engine failed or refused; retry later or check it.
- ``LocalStorageError``: the node's own disk refused a write or read (full, read-only,
  permission denied); free space or fix the mount, then run again (also an ``OSError``).
- ``OutOfMemory``: the process ran out of memory; free memory or use a larger machine
  (also a ``MemoryError``).
- ``ChainMismatch``: the run no longer continues the version a node or trainer holds
  (rolled back, rewritten, replaced by another run's chain); a person decides, then
  opts in to follow it (``allow_reset``, ``--allow-reset``).
- ``UntrustedVersion``: under a trust policy, a head or manifest is not signed by a
  trusted key, or a signed head goes back or is too old; nothing was fetched or changed.
- ``InternalError``: an invariant of Bulletin broke; a bug to report.

Every class has a stable ``code`` used by the CLI's ``--json`` output and by the
sidecar's error bodies; the CLI's exit status per kind is tabled in
``docs/ARCHITECTURE.md``. Storage backends translate their client's exceptions into
this tree at the storage boundary only, keeping the original as ``__cause__``; the
node's own files do the same in :mod:`bulletin.fileio` (``local_error``).
Lost compare-and-swap races are *not* exceptions inside the storage protocol
(they are ordinary return values); ``Conflict`` is raised by higher layers that
cannot proceed after losing.
"""

from __future__ import annotations

from patcher.errors import (
    BulletinError,
    ContextUnavailable,
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
    "BadSignature",
    "BulletinError",
    "ChainMismatch",
    "ConfigError",
    "Conflict",
    "ContextUnavailable",
    "CorruptData",
    "DigestMismatch",
    "DiskFull",
    "EngineError",
    "FingerprintMismatch",
    "FormatError",
    "HeadRolledBack",
    "IncompatibleLayout",
    "IncompatibleTensors",
    "InternalError",
    "InvalidInput",
    "InvalidTensorName",
    "LocalStorageError",
    "NotFound",
    "ObjectTooLarge",
    "OutOfMemory",
    "PermissionDenied",
    "RankFailed",
    "ReadOnlyStorage",
    "ReplicaBusy",
    "RunRewound",
    "StaleHead",
    "StorageUnavailable",
    "StoreNotWritable",
    "UnrepresentableNaN",
    "Unsigned",
    "UnsupportedDtype",
    "UnsupportedFormatVersion",
    "UntrustedKey",
    "UntrustedVersion",
    "VerificationFailed",
    "VersionConflict",
    "VersionNotFound",
    "WrongBase",
]


# -- the caller's fault ------------------------------------------------------------


class ConfigError(InvalidInput):
    """A store URL, flag or environment setting cannot be used."""

    code = "config_error"


class IncompatibleLayout(IncompatibleTensors):
    """An engine holds the checkpoint's tensors in a layout Bulletin cannot patch in
    place: tensor-parallel shards it cannot map (MoE experts, MLA-derived weights,
    quantized or repacked parameters, sharding of an unknown layer), or ranks whose
    pieces overlap or leave a tensor uncovered. Permanent, as every
    ``IncompatibleTensors``: found when the target binds, before anything is written."""

    code = "incompatible_layout"


class StoreNotWritable(ConfigError):
    """A write was asked of a store that can only be read (an HTTP site or CDN, an fsspec
    filesystem without atomic create-only and compare-and-swap writes).

    Refused before anything is sent or written, by the store and by the writers up front
    (``Publisher``, ``gc``): publish to a store with conditional writes (a local directory,
    ``s3://``, ``fsspec+s3://``) and let nodes read it through this one. Not the node's
    read-only disk, which is ``ReadOnlyStorage``.
    """

    code = "store_not_writable"


# -- bytes that are not what they claim ---------------------------------------------


class DigestMismatch(CorruptData):
    """Content does not hash to the digest its manifest promises."""

    code = "digest_mismatch"


class ObjectTooLarge(CorruptData):
    """An object in the store is larger than its reader allows (the size its manifest
    promises, a document cap): refused from its size, before its bytes are read."""

    code = "object_too_large"


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


class ReplicaBusy(Conflict):
    """Another process (or another target in this one) holds the node's replica folder.

    A replica folder has one writer at a time, held by an OS lock for the writer's
    lifetime; nothing was read, recovered or changed. Wait for the other writer or stop
    it, or use another folder; read-only looks (``bulletin status --local``) need no lock.
    """

    code = "replica_busy"


# -- the bucket -----------------------------------------------------------------------


class StorageUnavailable(BulletinError, OSError):
    """The store cannot be reached, timed out, or failed after retries."""

    code = "storage_unavailable"


class AccessDenied(StorageUnavailable):
    """Credentials are missing or wrong, or the bucket does not exist."""

    code = "access_denied"


# -- the node's own disk ---------------------------------------------------------------


class LocalStorageError(BulletinError, OSError):
    """The node's own disk refused a write or a read (a replica folder, a checkpoint).

    Translated from ``OSError`` at the local-file boundary (``errno`` is kept). The
    version held before is intact and nothing half-written is left behind; fix the disk
    and run again.
    """

    code = "local_storage_error"


class DiskFull(LocalStorageError):
    """No space (or no quota) left on the device (ENOSPC, EDQUOT): free some and rerun."""

    code = "disk_full"


class ReadOnlyStorage(LocalStorageError):
    """The file system is mounted read-only (EROFS): remount it or write elsewhere."""

    code = "read_only_storage"


class PermissionDenied(LocalStorageError):
    """The process may not write or read there (EACCES, EPERM): fix ownership or modes."""

    code = "permission_denied"


# -- the machine ---------------------------------------------------------------------------


class OutOfMemory(BulletinError, MemoryError):
    """The process ran out of memory (``MemoryError``); the held version is intact.

    Free memory, lower the parallelism, or run on a larger machine; retrying on the same
    machine helps only if something else released memory.
    """

    code = "out_of_memory"


# -- the serving engine ------------------------------------------------------------------


class RankFailed(BulletinError):
    """Another rank of a sharded publish failed, died or timed out (or this one lost the
    others): nothing was committed for that step, and every rank's base is still the
    last committed version. Restart the job: each rank resumes from the run."""

    code = "rank_failed"


class EngineError(BulletinError):
    """The inference engine could not be reached, or refused or failed to load a version.

    The version it served before stays the one reported; retry later or check the engine.
    """

    code = "engine_error"


class UnrepresentableNaN(EngineError):
    """A change would set an engine element to a NaN bit pattern, which vLLM's sparse
    checkpoint patches (the fallback for layouts Bulletin cannot patch in place) read as
    "unchanged". Refused before anything is written; the engine keeps the version it holds."""

    code = "unrepresentable_nan"


# -- the run went somewhere else -------------------------------------------------------


class ChainMismatch(BulletinError):
    """The run's chain no longer holds the version held here, as it was held.

    The manifest of that version is gone from a chain that still has older ones, or
    it has another digest: the run was rolled back, rewritten, or replaced by another
    run's chain. Nothing was changed; following it is a decision (``allow_reset=True``
    on a Subscriber, ``--allow-reset`` on ``bulletin sync`` and ``bulletin serve``).
    """

    code = "chain_mismatch"


class RunRewound(ChainMismatch):
    """The run's newest version is older than the version held here: it was rolled back."""

    code = "run_rewound"


# -- not vouched for by a trusted key ----------------------------------------------------


class UntrustedVersion(BulletinError):
    """Under a trust policy, a head or manifest is not one to take (docs/SECURITY.md).

    Raised as it is read, before any shard is downloaded and before anything held
    changes: the node keeps serving what it holds. Someone who can write the bucket (or
    a mirror, or the network path to it) can cause it; it is never a transient fault.
    """

    code = "untrusted_version"


class Unsigned(UntrustedVersion):
    """The head is not signed, or the manifest has no detached signature."""

    code = "unsigned"


class UntrustedKey(UntrustedVersion):
    """Signed by a key that is not in the trusted set (an attacker's, or a retired key)."""

    code = "untrusted_key"


class BadSignature(UntrustedVersion):
    """A signature by a trusted key id that does not verify over these bytes: forged,
    damaged, copied from another version, or a head's replayed as a manifest's."""

    code = "bad_signature"


class HeadRolledBack(UntrustedVersion):
    """A validly signed head older than one this trust policy already accepted for the run
    (an old head replayed, or a mirror behind one already seen)."""

    code = "head_rolled_back"


class StaleHead(UntrustedVersion):
    """A validly signed head older than the policy's ``max_head_age``: the head may be
    frozen (newer versions withheld), or the trainer stopped moving it."""

    code = "stale_head"
