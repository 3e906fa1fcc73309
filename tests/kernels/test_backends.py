"""The two backends have the same API, and the CUDA one is importable without CuPy."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bulletin.errors import InvalidInput
from bulletin_kernels import cuda, numpy_twin
from bulletin_kernels.dispatch import Backend

ROOT = Path(__file__).resolve().parents[2]
API = sorted(name for name in vars(Backend) if not name.startswith("_"))


def test_api_is_the_protocol() -> None:
    assert API == [
        "apply",
        "apply_delta",
        "apply_ranks",
        "cast",
        "decode_gaps",
        "diff_cast",
        "fingerprint",
        "select_ranks",
    ]


@pytest.mark.parametrize("name", API)
def test_same_signatures(name: str) -> None:
    gpu = inspect.signature(getattr(cuda, name))
    cpu = inspect.signature(getattr(numpy_twin, name))
    assert gpu == cpu, f"{name}: cuda{gpu} != numpy_twin{cpu}"
    protocol = inspect.signature(getattr(Backend, name))
    self_param, *params = protocol.parameters.values()
    assert self_param.name == "self"
    assert protocol.replace(parameters=params) == cpu


def test_importing_needs_neither_cupy_nor_torch() -> None:
    code = (
        "import sys, bulletin_kernels, bulletin_kernels.cuda, bulletin_kernels.numpy_twin, bulletin_kernels.dispatch\n"
        "loaded = sorted({'cupy', 'torch'} & set(sys.modules))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_cuda_backend_refuses_numpy_arrays() -> None:
    bits = np.zeros(8, dtype=np.uint16)
    # Without CuPy, or with it: a NumPy array is not a device array. Nothing is written.
    with pytest.raises(InvalidInput):
        cuda.fingerprint(bits)
    with pytest.raises(InvalidInput):
        cuda.apply_delta(bits, np.array([1], dtype=np.int64), np.ones(1, dtype=np.uint16))
    assert not bits.any()


def test_kernel_sources_are_self_contained() -> None:
    # NVRTC gets no include path and has no host headers: nothing may be #included.
    for name in cuda.KERNEL_FILES:
        source = cuda.kernel_source(name)
        assert not re.search(r"^\s*#\s*include\b", source, re.MULTILINE)
        assert "namespace bulletin" in source
    assert {p.stem for p in cuda.KERNEL_DIR.glob("*.cu")} == set(cuda.KERNEL_FILES)
    with pytest.raises(InvalidInput):
        cuda.kernel_source("../etc/passwd")


@pytest.mark.parametrize("dst_width", [1, 2, 4, 8])
@pytest.mark.parametrize("src_width", [1, 2, 4, 8])
def test_diff_plan_aligns_every_vector_load(src_width: int, dst_width: int) -> None:
    for kept_phase in range(0, 16, dst_width):
        for cur_phase in range(0, 16, src_width):
            kept_ptr, cur_ptr = 4096 + kept_phase, 8192 + cur_phase
            plan = cuda.plan_diff(cur_ptr, kept_ptr, 100_000, src_width, dst_width)
            assert 0 <= plan.shift < 8
            # Group g starts at element 8g - shift: every group start is vector-aligned.
            for g in range(1, 5):
                first = 8 * g - plan.shift
                assert (kept_ptr + first * dst_width) % min(16, 8 * dst_width) == 0
                cur_ok = (cur_ptr + first * src_width) % min(16, 8 * src_width) == 0
                assert plan.cur_vec == cur_ok
            assert plan.tiles == -(-(100_000 + plan.shift) // cuda.TILE_ELEMENTS)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_fingerprint_plan(width: int) -> None:
    align = min(16, 8 * width)
    for phase in range(0, 16, width):
        ptr = 1 << 20 | phase
        head = cuda.plan_fingerprint(ptr, 1000, width)
        assert 0 <= head < align // width
        assert (ptr + head * width) % align == 0
        assert cuda.plan_fingerprint(ptr, 2, width) <= 2
