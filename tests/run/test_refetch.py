"""A data object that fails its check is fetched once more before the version is refused.

A transfer can go wrong where the object did not (a proxy, a truncated body): one more
read gets the right bytes. An object that is bad in the bucket must still be refused
after that second read, never retried without end.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from pathlib import Path

import pytest

from bulletin import Subscriber
from bulletin.errors import DigestMismatch
from bulletin.storage import Store, open_store
from bulletin.storage.base import Downloaded, ObjectData
from bulletin.storage.wrapper import WrapperStore
from bulletin.target import ArrayTarget
from tests.run.helpers import assert_bits_equal, publish_versions


class BadReads(WrapperStore):
    """Damages the first ``times`` reads of every key containing ``part`` (None: all
    of them): a flipped byte, or with ``truncate`` a body cut short."""

    def __init__(self, inner: Store, part: str, *, times: int | None = 1, truncate: bool = False) -> None:
        super().__init__(inner)
        self.part, self.times, self.truncate = part, times, truncate
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        obj = super().get(key, max_bytes=max_bytes)
        if self.part not in key:
            return obj
        with self._lock:
            self.reads[key] += 1
            damage = self.times is None or self.reads[key] <= self.times
        if not damage:
            return obj
        if self.truncate:
            return ObjectData(obj.data[:-1], obj.etag)
        data = bytearray(obj.data)
        data[len(data) // 2] ^= 0x40
        return ObjectData(bytes(data), obj.etag)

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        """A streamed read (keyframe files) damaged the same way: a store's stream checks
        the digest it is given and keeps nothing that fails it."""
        obj = self.get(key, max_bytes=max_bytes)
        digest = hashlib.sha256(obj.data).hexdigest()
        if sha256 is not None and digest != sha256:
            raise DigestMismatch(f"{key}: SHA-256 {digest} where {sha256} was expected; nothing was kept")
        Path(path).write_bytes(obj.data)
        return Downloaded(len(obj.data), obj.etag, digest)


def _publish(bucket: Path, versions: int) -> list[dict[str, object]]:
    return list(publish_versions(bucket, "run", versions, seed=31, keyframe_every=10))


@pytest.mark.parametrize("part", ["/patches/", "/keyframes/"])
@pytest.mark.parametrize("truncate", [False, True], ids=["flipped", "truncated"])
def test_an_object_damaged_in_transit_once_is_fetched_again(tmp_path: Path, part: str, truncate: bool) -> None:
    bucket = tmp_path / "bucket"
    served = _publish(bucket, 3)
    store = BadReads(open_store(bucket), part, truncate=truncate)
    node = ArrayTarget()
    assert Subscriber(store, "run", target=node).sync() == 3
    assert_bits_equal(node.arrays, served[-1])  # type: ignore[arg-type]
    assert store.reads and set(store.reads.values()) == {2}  # each damaged object read exactly twice


def test_an_object_bad_in_the_bucket_is_refused_after_one_more_read(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    served = _publish(bucket, 3)
    store = BadReads(open_store(bucket), "/patches/", times=None)
    node = ArrayTarget()
    sub = Subscriber(store, "run", target=node)
    assert sub.sync(1) == 1  # a keyframe: no patch read yet
    with pytest.raises(DigestMismatch, match="fetched twice"):
        sub.sync()
    assert max(store.reads.values()) == 2  # one more read, no retry without end
    assert sub.current_version == 1
    assert_bits_equal(node.arrays, served[0])  # type: ignore[arg-type]
