"""Safetensors checkpoints as arrays of bits: a file, or an HF-style directory of shards.

Reading memory-maps each file and hands out zero-copy views (the bits dtype of each
tensor), so a diff or an in-place apply touches only the pages it needs. Writing
produces plain safetensors files, plus ``model.safetensors.index.json`` when the
checkpoint is split, loadable by any engine as an ordinary checkpoint.

The header parser follows the safetensors specification with its reader limits: a
capped header length, known dtypes, shapes whose byte size matches the offsets, and
offsets that tile the data buffer exactly (no holes, no overlaps, no trailing bytes).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import numpy as np
from numpy.typing import NDArray

from bulletin.errors import FormatError, IncompatibleTensors, InvalidInput, NotFound
from bulletin.fileio import fsync_dir, local_error, os_errors, write_atomic
from patcher.patch import TensorSpec

__all__ = [
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "SINGLE_NAME",
    "Checkpoint",
    "SafetensorsHeader",
    "encode_safetensors_header",
    "hf_index",
    "parse_safetensors_header",
    "plan_checkpoint",
    "safetensors_bytes",
    "write_checkpoint",
]

#: safetensors' own reader refuses headers over 100 MB.
MAX_HEADER_BYTES: Final = 100_000_000
INDEX_NAME: Final = "model.safetensors.index.json"
SINGLE_NAME: Final = "model.safetensors"
_ALIGN: Final = 8


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """The parsed header of one safetensors file."""

    specs: dict[str, TensorSpec]
    offsets: dict[str, tuple[int, int]]  # relative to ``data_start``
    data_start: int
    metadata: dict[str, str]


def parse_safetensors_header(prefix: bytes, file_size: int, *, source: str = "<bytes>") -> SafetensorsHeader:
    """Parse and validate a header from the first bytes of a file of ``file_size`` bytes.

    ``prefix`` must hold at least the 8-byte length and the header itself.
    """
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"{source}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{source}: header of {n} bytes exceeds the {MAX_HEADER_BYTES} cap")
    if 8 + n > file_size or 8 + n > len(prefix):
        raise FormatError(f"{source}: header runs past the end of the file")
    try:
        raw = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{source}: header is not UTF-8 JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise FormatError(f"{source}: header must be a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{source}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_size = file_size - data_start
    specs: dict[str, TensorSpec] = {}
    offsets: dict[str, tuple[int, int]] = {}
    for name, info in raw.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{source}: tensor {name!r} must have exactly dtype, shape, data_offsets")
        shape, offs = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FormatError(f"{source}: tensor {name!r} has a bad shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data_size
        ):
            raise FormatError(f"{source}: tensor {name!r} has bad data_offsets {offs!r}")
        spec = TensorSpec(name, info["dtype"], tuple(shape))  # names and dtypes checked here
        if offs[1] - offs[0] != spec.nbytes:
            raise FormatError(
                f"{source}: tensor {name!r} occupies {offs[1] - offs[0]} bytes, its dtype and shape need {spec.nbytes}"
            )
        specs[name] = spec
        offsets[name] = (offs[0], offs[1])
    position = 0
    for begin, end in sorted(offsets.values()):
        if begin != position:
            raise FormatError(f"{source}: tensor data has a hole or an overlap at byte {begin}")
        position = end
    if position != data_size:
        raise FormatError(f"{source}: {data_size - position} trailing bytes after the tensor data")
    return SafetensorsHeader(specs, offsets, data_start, dict(metadata))


def encode_safetensors_header(
    specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The 8-byte length plus JSON header for tensors laid out in the given order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for spec in specs:
        offsets[spec.name] = (position, position + spec.nbytes)
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [position, position + spec.nbytes],
        }
        position += spec.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(8 + len(body)) % _ALIGN)  # as safetensors does: data starts aligned
    return struct.pack("<Q", len(body)) + body, offsets


class _MappedFile:
    """One memory-mapped safetensors file."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = path
        flags = os.O_RDWR if writable else os.O_RDONLY
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise NotFound(f"no such checkpoint file: {path}") from None
        except IsADirectoryError:
            raise InvalidInput(f"not a safetensors file: {path}") from None
        except OSError as exc:
            raise local_error(exc, f"cannot open {path}") from exc
        try:
            size = os.fstat(fd).st_size
            with os.fdopen(os.dup(fd), "rb") as fh:
                prefix = fh.read(8)
                if len(prefix) == 8:
                    (n,) = struct.unpack("<Q", prefix)
                    prefix += fh.read(min(n, MAX_HEADER_BYTES))
            self.header = parse_safetensors_header(prefix, size, source=str(path))
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            with os_errors(f"cannot map {path}"):
                self._mmap: mmap.mmap | None = mmap.mmap(fd, 0, access=access) if size else None
        finally:
            os.close(fd)
        self._buffer: NDArray[np.uint8] = (
            np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap is not None else np.zeros(0, dtype=np.uint8)
        )
        if not writable:
            self._buffer.flags.writeable = False

    def bits(self, name: str) -> NDArray[np.unsignedinteger]:
        spec = self.header.specs[name]
        begin, end = self.header.offsets[name]
        start = self.header.data_start
        raw = self._buffer[start + begin : start + end]
        return raw.view(spec.bits_dtype).reshape(spec.shape)

    def flush(self) -> None:
        if self._mmap is not None:
            with os_errors(f"cannot write {self.path}"):
                self._mmap.flush()

    def close(self) -> None:
        # Views handed out keep the buffer alive; dropping ours lets the mmap close when
        # they are gone, and closing it now would invalidate them under the caller.
        self._buffer = np.zeros(0, dtype=np.uint8)
        self._mmap = None


class Checkpoint:
    """A safetensors checkpoint (file or HF-style directory) whose tensors are bit views."""

    def __init__(self, path: str | os.PathLike[str], *, writable: bool = False) -> None:
        self.path = Path(path)
        self.writable = writable
        self._files: list[_MappedFile] = []
        self._where: dict[str, _MappedFile] = {}
        for file in self._resolve_files(self.path):
            mapped = _MappedFile(file, writable=writable)
            self._files.append(mapped)
            for name in mapped.header.specs:
                if name in self._where:
                    raise FormatError(f"{self.path}: tensor {name!r} appears in two files")
                self._where[name] = mapped

    @staticmethod
    def _resolve_files(path: Path) -> list[Path]:
        if path.is_file():
            return [path]
        if not path.is_dir():
            raise NotFound(f"no such checkpoint: {path}")
        index = path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise FormatError(f"{index}: not an HF safetensors index: {exc}") from None
            files = []
            for name in names:
                if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
                    raise FormatError(f"{index}: refusing file name {name!r}")
                files.append(path / name)
            return files
        files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
        if not files:
            raise NotFound(f"no safetensors files in {path}")
        return files

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {name: f.header.specs[name] for name, f in sorted(self._where.items())}

    @property
    def files(self) -> list[Path]:
        return [f.path for f in self._files]

    @property
    def metadata(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for f in self._files:
            merged.update(f.header.metadata)
        return merged

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._where))

    def bits(self, name: str) -> NDArray[np.unsignedinteger]:
        """Zero-copy view of a tensor's bits (read-only unless opened writable)."""
        try:
            return self._where[name].bits(name)
        except KeyError:
            raise NotFound(f"{self.path}: no tensor named {name!r}") from None

    def flush(self) -> None:
        for f in self._files:
            f.flush()

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def plan_checkpoint(specs: Mapping[str, TensorSpec], max_shard_bytes: int) -> list[tuple[str, list[TensorSpec]]]:
    """Split tensors (in name order) into HF-style file names and their contents."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in (specs[name] for name in sorted(specs)):
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    if len(shards) == 1:
        return [(SINGLE_NAME, shards[0])]
    n = len(shards)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", shard) for i, shard in enumerate(shards)]


def hf_index(plan: list[tuple[str, list[TensorSpec]]]) -> bytes:
    """``model.safetensors.index.json`` for a split checkpoint."""
    index = {
        "metadata": {"total_size": sum(s.nbytes for _, shard in plan for s in shard)},
        "weight_map": {s.name: file_name for file_name, shard in plan for s in shard},
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _tensor_bytes(array: NDArray[Any], spec: TensorSpec) -> memoryview:
    if array.nbytes != spec.nbytes:
        raise IncompatibleTensors(f"{spec.name}: {array.nbytes} bytes given, spec needs {spec.nbytes}")
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def safetensors_bytes(
    shard: list[TensorSpec],
    tensors: Mapping[str, NDArray[Any]],
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """One safetensors file, in memory."""
    header, _ = encode_safetensors_header(shard, {"format": "pt", **(metadata or {})})
    parts: list[bytes | memoryview] = [header]
    parts.extend(_tensor_bytes(tensors[spec.name], spec) for spec in shard)
    return b"".join(parts)


def write_checkpoint(
    directory: str | os.PathLike[str],
    specs: Mapping[str, TensorSpec],
    tensors: Mapping[str, NDArray[Any]],
    *,
    max_shard_bytes: int = 5 << 30,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``tensors`` (bits or any array of the right byte size) as an HF-style checkpoint.

    One ``model.safetensors`` when everything fits in ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Files are
    written to temporary names, fsynced, then renamed: a crash leaves no partial file
    under a final name, and a failure (a full disk: ``DiskFull``; any ``OSError`` is raised
    typed, see :mod:`bulletin.fileio`) removes the files this call had created. Returns
    the paths written (data files, then the index).
    """
    out = Path(directory)
    with os_errors(f"cannot create {out}"):
        out.mkdir(parents=True, exist_ok=True)
    if specs.keys() != tensors.keys():
        raise IncompatibleTensors("specs and tensors name different sets of tensors")
    plan = plan_checkpoint(specs, max_shard_bytes)
    for _, shard in plan:
        for spec in shard:
            _tensor_bytes(tensors[spec.name], spec)  # size check before any file is written
    names = [file_name for file_name, _ in plan] + ([INDEX_NAME] if len(plan) > 1 else [])
    created = [out / name for name in names if not (out / name).exists()]
    written: list[Path] = []
    try:
        for file_name, shard in plan:
            header, _ = encode_safetensors_header(shard, {"format": "pt", **(metadata or {})})
            parts: list[bytes | memoryview] = [header, *(_tensor_bytes(tensors[s.name], s) for s in shard)]
            written.append(write_atomic(out / file_name, parts, sync_dir=False))
        if len(plan) > 1:
            written.append(write_atomic(out / INDEX_NAME, [hf_index(plan)], sync_dir=False))
        fsync_dir(out)
    except BaseException:
        for path in created:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        raise
    return written
