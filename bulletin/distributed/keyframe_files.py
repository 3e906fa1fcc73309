"""A sharded job's keyframe files, written where no rank holds every tensor (:func:`write_keyframe_files`).

Each file of the keyframe has a writer rank (round-robin over the files); a block its
owner does not write travels to it, one block at a time (the one place a step moves
bits, not changes: docs/SHARDED.md), and lands in its place with ``pwrite``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from bulletin.blocks import Block, block_runs
from bulletin.checkpoint import encode_safetensors_header
from bulletin.distributed.comm import Comm
from bulletin.distributed.parts import Layout
from bulletin.fileio import pwrite_all
from patcher.patch import TensorSpec

__all__ = ["write_keyframe_files"]

Bits = NDArray[np.unsignedinteger]


def write_keyframe_files(
    comm: Comm, files: list[tuple[str, list[TensorSpec]]], layout: Layout, kept: Mapping[str, Bits], folder: Path
) -> BaseException | None:
    """Write this rank's files, in the one order every rank walks (file, tensor, block),
    so that each send meets its receive. A local failure is returned, not raised,
    after the walk: the other ranks' sends and receives must still be met. Blocks go
    to their places with ``pwrite`` (a run of the tensor's flat elements at a time), not
    through a memory map: the file's pages then stay in the page cache instead of the
    writer's resident set, which holds one received block at most."""
    error: BaseException | None = None
    for index, (file_name, specs) in enumerate(files):
        mine = index % comm.world == comm.rank
        fd: int | None = None
        offsets: dict[str, tuple[int, int]] = {}
        data_start = 0
        if mine and error is None:
            try:
                header, offsets = encode_safetensors_header(specs, {"format": "pt"})
                data_start = len(header)
                with open(folder / file_name, "wb") as fh:
                    fh.write(header)
                    fh.truncate(data_start + sum(spec.nbytes for spec in specs))
                fd = os.open(folder / file_name, os.O_WRONLY)
            except BaseException as exc:
                error = exc
        try:
            for spec in specs:
                for owner, block in layout.owners[spec.name]:
                    if block.numel == 0 or (not mine and owner != comm.rank):
                        continue
                    if owner == comm.rank and not mine:
                        comm.send(kept[spec.name], index % comm.world)
                        continue
                    bits = (
                        kept[spec.name]
                        if owner == comm.rank
                        else comm.recv(block.numel * spec.width, owner).view(spec.bits_dtype)
                    )
                    if fd is None or error is not None:
                        continue
                    try:
                        _write_block(fd, data_start + offsets[spec.name][0], spec.width, block, bits)
                    except BaseException as exc:
                        error = exc
        finally:
            if fd is not None:
                os.close(fd)
    return error


def _write_block(fd: int, tensor_start: int, width: int, block: Block, bits: Bits) -> None:
    """``bits`` (the block's, C order) into their places in the tensor stored from byte
    ``tensor_start`` of the file ``fd``."""
    data = np.ascontiguousarray(bits).reshape(-1).view(np.uint8).data
    starts, run = block_runs(block)
    step = run * width
    for k, start in enumerate(starts.tolist()):
        pwrite_all(fd, data[k * step : (k + 1) * step], tensor_start + start * width)
