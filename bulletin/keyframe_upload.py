"""A staged keyframe's files uploaded while the next ones are still being written.

A keyframe is written into the publisher's cache one file at a time
(:class:`~bulletin.keyframe_stage.StagedKeyframe`), then every file goes to the store. Waiting for
the last file before sending the first puts the cache write and the upload end to end;
:class:`KeyframeUpload` sends each data file as soon as it is closed, a few at a time,
so that the store's copy (a kernel copy and an fsync on a local store, a multipart
upload on S3) of file *i* overlaps the writing of file *i + 1*. The index goes last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from bulletin.keyframe_stage import KeyframeFile
from schemas.manifest import KeyframeRef, ObjectRef

__all__ = ["KeyframeUpload"]


class KeyframeUpload:
    """Uploads of one keyframe's files under ``prefix``: ``put(key, file)`` creates one
    object (create-only), on up to ``workers`` threads."""

    def __init__(self, put: Callable[[str, KeyframeFile], None], prefix: str, workers: int) -> None:
        self._put, self.prefix = put, prefix
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="bulletin-keyframe")
        self._sent: dict[str, Future[None]] = {}

    def send(self, file: KeyframeFile) -> None:
        """Start uploading ``file`` (complete and closed: it must not change any more)."""
        self._sent[file.name] = self._pool.submit(self._put, f"{self.prefix}/{file.name}", file)

    def finish(self, files: Sequence[KeyframeFile]) -> KeyframeRef:
        """Send what was not sent yet, wait for every upload (raising the first failure)
        and return the keyframe's reference, its files in ``files``' order."""
        try:
            for file in files:
                if file.name not in self._sent:
                    self.send(file)
            for file in files:
                self._sent[file.name].result()
        finally:
            self.abort()
        return KeyframeRef(
            prefix=self.prefix,
            files=tuple(ObjectRef(key=f"{self.prefix}/{f.name}", size=f.size, sha256=f.sha256) for f in files),
        )

    def abort(self) -> None:
        """Cancel the uploads not started and wait for those running (so that nothing
        reads the staged folder once it is discarded). Idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)
