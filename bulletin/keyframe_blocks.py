"""A rank's blocks of a keyframe, read from the run by byte ranges: O(its shard), not O(model).

A rank of a sharded job rebuilding its base (``PublishedBase.open`` with blocks) needs
only its block of each tensor. A keyframe file is safetensors: each tensor's bits are
one span of the file, in C order, so a block is a set of runs in that span
(:func:`~bulletin.blocks.block_runs`): a ``Shard(0)`` block one run, a column split one
run a row. This reads each file's header (two small ranges), then the runs, in reads of
at most :data:`READ_BYTES` (runs less than :data:`GAP_BYTES` apart are read as one span
and cut apart here, so that a column split of small rows costs a few requests, not one
a row), in parallel, each written straight to its place in one safetensors file of the
blocks.

No digest covers a range: the blocks are checked by their fingerprints, which the
sharded publisher sums over every rank against the manifest's before it trusts them
(a header that lies, or bytes damaged in flight, give a sum that misses).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from bulletin.blocks import Block, block_runs
from bulletin.checkpoint import (
    INDEX_NAME,
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    encode_safetensors_header,
    parse_safetensors_header,
)
from bulletin.errors import DigestMismatch, FormatError
from bulletin.fileio import os_errors, pwrite_all
from bulletin.run import sha256_hex
from bulletin.storage import Store
from patcher.patch import TensorSpec
from schemas.manifest import ObjectRef

__all__ = ["GAP_BYTES", "READ_BYTES", "read_blocks"]

#: The most one ranged read asks for (and the most each reading thread holds).
READ_BYTES: Final = 16 << 20
#: Runs this close are read as one span, the bytes between them read and dropped: a
#: request costs about what a megabyte takes to arrive from an object store.
GAP_BYTES: Final = 1 << 20

#: One read: the file's byte range, and where each run in it goes in the output
#: (offset in the range, length, offset in the output file).
_Read = tuple[int, int, list[tuple[int, int, int]]]


def _reads(begin: int, block: Block, itemsize: int, out: int) -> Iterator[_Read]:
    """The reads of ``block``'s runs, its tensor's bits starting at byte ``begin`` of the
    file, its own bits at byte ``out`` of the output."""
    if block.numel == 0:
        return
    starts, run = block_runs(block)
    width = run * itemsize
    if width >= READ_BYTES or len(starts) == 1:  # long runs: each read in pieces
        for k, start in enumerate(starts.tolist()):
            for piece in range(0, width, READ_BYTES):
                size = min(READ_BYTES, width - piece)
                at = begin + start * itemsize + piece
                yield at, at + size, [(0, size, out + k * width + piece)]
        return
    k = 0
    while k < len(starts):  # short runs: as many close ones as one read's span holds
        first = int(starts[k])
        end = k + 1
        while (
            end < len(starts)
            and (int(starts[end]) - int(starts[end - 1])) * itemsize - width <= GAP_BYTES
            and (int(starts[end]) - first) * itemsize + width <= READ_BYTES
        ):
            end += 1
        cuts = [((int(s) - first) * itemsize, width, out + j * width) for j, s in enumerate(starts[k:end].tolist(), k)]
        at = begin + first * itemsize
        yield at, at + cuts[-1][0] + width, cuts
        k = end


def _header(store: Store, key: str, obj: ObjectRef) -> SafetensorsHeader:
    """The parsed safetensors header of keyframe file ``obj``, read by two ranges."""
    head = store.get_range(key, 0, 8)
    if len(head) < 8:
        raise FormatError(f"{obj.key}: too short for a safetensors file")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES or 8 + size > obj.size:
        raise FormatError(f"{obj.key}: a header of {size} bytes does not fit a file of {obj.size}")
    return parse_safetensors_header(head + store.get_range(key, 8, 8 + size), obj.size, source=obj.key)


def read_blocks(
    store: Store,
    key_of: Callable[[str], str],
    files: Mapping[str, ObjectRef],
    specs: Mapping[str, TensorSpec],
    blocks: Mapping[str, Block],
    target: Path,
    *,
    workers: int,
) -> None:
    """Write ``target``, one safetensors file holding each of ``blocks`` (of tensors
    ``specs``), read from keyframe ``files`` (by name; ``key_of`` gives a file's store
    key): the index whole (SHA-256 verified), each file's header and its blocks' runs by
    ranges, ``workers`` reads at a time. A file or header that does not hold a tensor
    as ``specs`` has it is ``FormatError``."""
    weight_map: dict[str, str] = {}
    if INDEX_NAME in files:
        obj = files[INDEX_NAME]
        data = store.get(key_of(obj.key), max_bytes=obj.size).data
        if sha256_hex(data) != obj.sha256:
            raise DigestMismatch(f"{obj.key}: does not hash to the digest its manifest promises")
        try:
            raw: Any = json.loads(data).get("weight_map", {})
        except (ValueError, AttributeError) as exc:
            raise FormatError(f"{obj.key}: not a safetensors index: {exc}") from None
        weight_map = {str(k): str(v) for k, v in raw.items()}
    tensor_files = [name for name in files if name != INDEX_NAME]
    by_file: dict[str, list[str]] = {}
    for name in blocks:
        file = weight_map.get(name, tensor_files[0] if len(tensor_files) == 1 else "")
        if file not in files or not file.endswith(".safetensors"):
            raise FormatError(f"the keyframe has no file for {name!r}")
        by_file.setdefault(file, []).append(name)
    held = [TensorSpec(name, specs[name].dtype, blocks[name].sizes) for name in sorted(blocks)]
    header, offsets = encode_safetensors_header(held, {"format": "pt"})
    with os_errors(f"cannot write {target}"):
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        with os_errors(f"cannot write {target}"):
            pwrite_all(fd, header, 0)
            os.ftruncate(fd, len(header) + sum(spec.nbytes for spec in held))
        jobs: list[tuple[str, str, _Read]] = []
        for file, names in sorted(by_file.items()):
            obj = files[file]
            found = _header(store, key_of(obj.key), obj)
            for name in sorted(names):
                spec = specs[name]
                if found.specs.get(name) != spec:
                    raise FormatError(f"{obj.key}: holds tensor {name!r} otherwise than its manifest")
                begin = found.data_start + found.offsets[name][0]
                itemsize = spec.nbytes // max(1, spec.numel)
                out = len(header) + offsets[name][0]
                jobs.extend((obj.key, key_of(obj.key), read) for read in _reads(begin, blocks[name], itemsize, out))

        def fetch(job: tuple[str, str, _Read]) -> None:
            name, key, (start, stop, cuts) = job
            data = store.get_range(key, start, stop)
            if len(data) != stop - start:
                raise FormatError(f"{name}: ends before byte {stop}, which its header names")
            view = memoryview(data)
            for at, size, out in cuts:
                with os_errors(f"cannot write {target}"):
                    pwrite_all(fd, view[at : at + size], out)

        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="bulletin-blocks") as pool:
            for _ in pool.map(fetch, jobs):
                pass
    finally:
        os.close(fd)
