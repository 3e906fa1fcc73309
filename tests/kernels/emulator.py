"""Run the real CUDA kernel sources on the CPU: a ``Runtime`` for kernels/bulletin_kernels/cuda.py.

Each ``kernels/bulletin_kernels/<name>.cu`` (exactly the text NVRTC gets, from ``kernel_source``) is
compiled with g++ against ``cuda_emulator.hpp`` and UndefinedBehaviorSanitizer, and
launched through the same launch logic as on a GPU (``bulletin_kernels.cuda._diff_cast`` etc.),
with NumPy as the array module. It checks the kernels' arithmetic, ordering,
boundary and alignment handling and the warp-level protocol; it says nothing about
speed, the memory model of a real GPU, or NVRTC itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import shutil
import signal
import subprocess
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np
from numpy.typing import NDArray

from bulletin_kernels.cuda import KERNEL_ENTRIES, KERNEL_FILES, kernel_source

__all__ = ["EmulatorRuntime", "Placed", "build_emulator", "compiler", "isolated"]

HERE: Final = Path(__file__).resolve().parent
T = TypeVar("T")

_SCALARS: Final[dict[type, type]] = {
    np.uint32: ctypes.c_uint32,
    np.int32: ctypes.c_int32,
    np.uint64: ctypes.c_uint64,
    np.int64: ctypes.c_int64,
}


def compiler() -> str | None:
    """The C++ compiler the emulator needs (g++ with C++20 and UBSan), if any."""
    return shutil.which(os.environ.get("CXX", "g++"))


def build_emulator(workdir: Path) -> dict[str, ctypes.CDLL]:
    """Compile every kernel file into a shared library under ``workdir`` and load them."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    libs: dict[str, ctypes.CDLL] = {}
    for name in KERNEL_FILES:
        source = workdir / f"{name}.cpp"
        exports = "\n".join(f"BULLETIN_EMU_EXPORT({k})" for k in KERNEL_ENTRIES[name])
        source.write_text(f'#include "cuda_emulator.hpp"\n{kernel_source(name)}\n{exports}\n', encoding="utf-8")
        lib = workdir / f"lib{name}.so"
        cmd = [
            cxx,
            "-std=c++20",
            "-O1",
            "-g",
            "-fPIC",
            "-shared",
            "-pthread",
            "-fsanitize=undefined",
            "-fno-sanitize=vptr",
            "-fno-sanitize-recover=all",
            "-Wall",
            "-Wextra",
            "-Wno-unknown-pragmas",
            "-Werror",
            f"-I{HERE}",
            str(source),
            "-o",
            str(lib),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode:
            raise RuntimeError(f"emulator build of {name}.cu failed:\n{result.stderr}")
        libs[name] = ctypes.CDLL(str(lib))
    return libs


class EmulatorRuntime:
    """``bulletin_kernels.cuda.Runtime`` on the CPU: NumPy arrays, emulated launches."""

    xp = np

    def __init__(self, libs: dict[str, ctypes.CDLL], sm_count: int = 2) -> None:
        self._libs = libs
        self._sm_count = sm_count
        self.launches: list[tuple[str, int]] = []

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def ptr(self, array: Any) -> int:
        return int(array.ctypes.data)

    def sm_count(self) -> int:
        return self._sm_count

    def launch(self, file: str, kernel: str, grid: int, args: tuple[Any, ...]) -> None:
        values: list[Any] = []
        for arg in args:
            if isinstance(arg, np.ndarray):
                values.append(ctypes.c_void_p(arg.ctypes.data))
            else:
                values.append(_SCALARS[type(arg)](int(arg)))
        argv = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        getattr(self._libs[file], f"emu_{kernel}")(ctypes.c_uint(grid), argv)
        self.launches.append((kernel, grid))


class Placed:
    """An array copied to a chosen byte offset from a 64-byte boundary, between canaries.

    Lets tests put views at the awkward addresses real tensors have (storage offsets
    of any element count) and detect stray writes outside them; stray reads of the
    canary pattern show up as wrong results.
    """

    CANARY: Final = 0xA5
    PAD: Final = 256

    def __init__(self, array: NDArray[Any], byte_offset: int) -> None:
        nbytes = array.nbytes
        self._raw = np.full(nbytes + 2 * self.PAD + 64, self.CANARY, dtype=np.uint8)
        base = (-self._raw.ctypes.data) % 64 + self.PAD + byte_offset
        self._span = (base, base + nbytes)
        self.array: NDArray[Any] = self._raw[base : base + nbytes].view(array.dtype).reshape(array.shape)
        self.array[...] = array

    def canaries_intact(self) -> bool:
        start, stop = self._span
        return bool(np.all(self._raw[:start] == self.CANARY) and np.all(self._raw[stop:] == self.CANARY))


def isolated(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a forked child and return its (pickled) result.

    A kernel bug can crash the process (a UBSan abort, a misaligned SSE load): the child
    dies instead of the test session, and the parent raises with the signal. UBSan's
    report is on stderr, which pytest shows with the failure.
    """
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python >= 3.12 warns when forking with threads alive (torch's pool, here): the
        # child runs only NumPy and the emulator, which starts its own threads afresh.
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: never return into pytest
        os.close(read_fd)
        try:
            payload = pickle.dumps((True, fn()))
        except BaseException as exc:
            payload = pickle.dumps((False, "".join(traceback.format_exception(exc))))
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise AssertionError(f"emulated kernel crashed: {signal.Signals(os.WTERMSIG(status)).name}")
    if not data:  # UBSan's Die() exits with status 1 before anything is written
        raise AssertionError(f"emulated kernel died with exit status {os.WEXITSTATUS(status)} (see stderr)")
    ok, value = pickle.loads(data)
    if not ok:
        raise AssertionError(f"emulated call raised in the child:\n{value}")
    result: T = value
    return result
