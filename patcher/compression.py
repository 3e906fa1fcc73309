"""Entropy coders of patch streams: zstd frames and LZ4 blocks, with exact sizes.

Every stream's decoded size is known from the header before a byte is decompressed, so
a reader never lets the data decide how much memory it gets: zstd frames must declare
exactly that content size (checked on the frame header first), LZ4 blocks are decoded
into a buffer of exactly that size. A stream that would not shrink is stored verbatim,
which a reader recognises by its length being its decoded size; a compressed stream is
always strictly shorter.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Final, Literal, get_args

import lz4.block
import zstandard

from patcher.errors import CorruptData, FormatError, InvalidInput

__all__ = [
    "AUTO_CODEC",
    "CODECS",
    "CONTEXT_CODEC",
    "DEFAULT_CODEC",
    "DEFAULT_LEVELS",
    "LEVEL_RANGES",
    "PATCH_CODECS",
    "PUBLISH_CODECS",
    "ZSTD_MAX_WINDOW",
    "Codec",
    "Decompressor",
    "PatchCodec",
    "check_codec",
    "check_patch_codec",
    "make_compressor",
]

#: The name of a stream compressor of codecs 1 and 2, as shard headers (by id,
#: patcher.format.CODEC_IDS), manifests and the CLI record it.
Codec = Literal["zstd", "lz4"]
CODECS: Final[tuple[Codec, ...]] = get_args(Codec)
#: Every patch codec: the stream compressors, and the context codec (docs/FORMAT.md
#: 3.15), which codes against the base tensors a receiver holds. The one list of names.
PatchCodec = Literal["zstd", "lz4", "context"]
PATCH_CODECS: Final[tuple[PatchCodec, ...]] = get_args(PatchCodec)
CONTEXT_CODEC: Final = "context"
#: What a publisher may be told to write: a patch codec, or ``"auto"``, the context
#: codec unless zstd comes out smaller (patcher.encode.encode_smallest).
AUTO_CODEC: Final = "auto"
PUBLISH_CODECS: Final[tuple[str, ...]] = (AUTO_CODEC, *PATCH_CODECS)
#: The codec of ``encode`` and the publisher unless told otherwise.
DEFAULT_CODEC: Final[Codec] = "zstd"
#: After the transforms of patcher.streams, zstd levels differ by under 2% on real
#: patches (docs/FORMAT.md, "For implementers"), so the fastest wins; LZ4 0 is its fast
#: mode (1..12 select the high-compression coder, ~2% smaller, 5x slower to encode).
DEFAULT_LEVELS: Final = {"zstd": 1, "lz4": 0}
#: zstd levels above 19 ("ultra") would need windows past ZSTD_MAX_WINDOW.
LEVEL_RANGES: Final = {"zstd": (1, 19), "lz4": (0, 12)}
#: Largest zstd window a frame may need; levels 1..19 never exceed it.
ZSTD_MAX_WINDOW: Final = 1 << 23


def check_codec(codec: str) -> Codec:
    """``codec`` if it names a codec; raises ``InvalidInput`` otherwise."""
    if codec not in CODECS:
        raise InvalidInput(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    return codec


def check_patch_codec(codec: str) -> PatchCodec:
    """``codec`` if it names a patch codec; raises ``InvalidInput`` otherwise."""
    if codec not in PATCH_CODECS:
        raise InvalidInput(f"unknown codec {codec!r}; known: {', '.join(PATCH_CODECS)}")
    return codec


def make_compressor(codec: str, level: int | None) -> Callable[[bytes], bytes]:
    """A function that compresses one stream with ``codec`` at ``level`` (None: default)."""
    check_codec(codec)
    if level is None:
        level = DEFAULT_LEVELS[codec]
    lo, hi = LEVEL_RANGES[codec]
    if not isinstance(level, int) or isinstance(level, bool) or not lo <= level <= hi:
        raise InvalidInput(f"{codec} level must be an int in [{lo}, {hi}], got {level!r}")
    coder: Callable[[bytes], bytes]
    if codec == "zstd":
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True, write_dict_id=False)
        coder = cctx.compress
    elif level == 0:
        coder = partial(lz4.block.compress, mode="default", store_size=False)
    else:
        coder = partial(lz4.block.compress, mode="high_compression", compression=level, store_size=False)

    def compress(raw: bytes) -> bytes:
        packed = coder(raw)
        return packed if len(packed) < len(raw) else raw

    return compress


class Decompressor:
    """Decodes the streams of one shard to exactly their declared sizes.

    Holds one decompression context for all the streams of a shard (creating one per
    stream cost more than decoding a small stream). Not thread-safe.
    """

    def __init__(self, codec: str) -> None:
        self.codec = check_codec(codec)
        self._dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW) if codec == "zstd" else None

    def __call__(self, data: memoryview, size: int, what: str) -> bytes | memoryview:
        """Exactly ``size`` bytes from one stream, or ``FormatError`` / ``CorruptData``."""
        if len(data) == size:
            return data  # stored verbatim
        if len(data) > size:
            raise FormatError(f"{what}: a {len(data)}-byte stream for {size} bytes is neither stored nor compressed")
        if self._dctx is not None:
            return _zstd(self._dctx, data, size, what)
        return _lz4(data, size, what)


def _zstd(dctx: zstandard.ZstdDecompressor, data: memoryview, size: int, what: str) -> bytes:
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: not a zstd frame ({e})") from None
    if params.content_size != size:
        raise FormatError(f"{what}: zstd frame declares {params.content_size} bytes, header says {size}")
    if params.dict_id != 0:
        raise FormatError(f"{what}: zstd frame needs a dictionary")
    if params.window_size > ZSTD_MAX_WINDOW:
        raise FormatError(f"{what}: zstd window {params.window_size} over {ZSTD_MAX_WINDOW}")
    try:
        out: bytes = dctx.decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: zstd stream does not decode ({e})") from None
    if len(out) != size:
        raise CorruptData(f"{what}: zstd stream decodes to {len(out)} bytes, expected {size}")
    return out


def _lz4(data: memoryview, size: int, what: str) -> bytes:
    try:
        out: bytes = lz4.block.decompress(data, uncompressed_size=size)
    except lz4.block.LZ4BlockError as e:
        raise CorruptData(f"{what}: LZ4 block does not decode ({e})") from None
    if len(out) != size:
        raise CorruptData(f"{what}: LZ4 block decodes to {len(out)} bytes, expected {size}")
    return out
