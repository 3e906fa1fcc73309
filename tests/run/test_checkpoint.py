"""Safetensors reading and writing: real files both ways, and hostile headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bulletin.checkpoint import Checkpoint, parse_safetensors_header, write_checkpoint
from bulletin.errors import FormatError, InvalidTensorName, NotFound, UnsupportedDtype


def test_reads_files_written_by_safetensors_and_writes_files_it_reads(tmp_path: Path) -> None:
    tensors = {
        "a.weight": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int8),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    with Checkpoint(tmp_path / "x.safetensors") as ckpt:
        specs = ckpt.specs
        assert specs["a.weight"].dtype == "BF16" and specs["f8"].dtype == "F8_E4M3"
        bits = {n: np.array(ckpt.bits(n)) for n in ckpt}
    written = write_checkpoint(tmp_path / "out", specs, bits, max_shard_bytes=40)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    loaded: dict[str, torch.Tensor] = {}
    for path in written[:-1]:
        loaded.update(load_file(path))
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    with Checkpoint(tmp_path / "out") as again:
        assert again.specs == specs


def test_writable_views_change_the_file_in_place(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "m.safetensors")
    with Checkpoint(tmp_path / "m.safetensors", writable=True) as ckpt:
        ckpt.bits("w")[1] = 0x3F80  # 1.0 in BF16
        ckpt.flush()
    assert load_file(tmp_path / "m.safetensors")["w"].tolist() == [0.0, 1.0, 0.0, 0.0]
    with Checkpoint(tmp_path / "m.safetensors") as ro, pytest.raises(ValueError, match="read-only"):
        ro.bits("w")[0] = 1


def _file(header: object, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


@pytest.mark.parametrize(
    ("blob", "error"),
    [
        (b"\x01\x02", FormatError),
        (struct.pack("<Q", 1 << 40) + b"{}", FormatError),
        (_file(None, raw_header=b"{not json"), FormatError),
        (_file([1, 2]), FormatError),
        (_file({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 3), FormatError),
        (_file({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 5), FormatError),
        (_file({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4), FormatError),
        (_file({"w": {"dtype": "BF16", "shape": [-1], "data_offsets": [0, 0]}}), FormatError),
        (_file({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), UnsupportedDtype),
        (_file({"../w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), InvalidTensorName),
        (
            _file(
                {
                    "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                    "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
                },
                b"\0" * 3,
            ),
            FormatError,
        ),
        (_file({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}, b"\0"), FormatError),
        (_file({"__metadata__": {"k": 1}}), FormatError),
    ],
)
def test_hostile_headers_get_typed_errors(blob: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_safetensors_header(blob, len(blob))


def test_missing_checkpoints_and_bad_indexes(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        Checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound):
        Checkpoint(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    with pytest.raises(FormatError):
        Checkpoint(bad)
