#!/usr/bin/env python3
"""CI compile check of the CUDA kernels: no GPU needed, only nvcc (and NVRTC if present).

For every kernels/bulletin_kernels/<name>.cu, takes exactly the text that
kernels/bulletin_kernels/cuda.py hands to NVRTC at run time (common.cuh pasted in, no
include path) and

- compiles it with nvcc for sm_90, warnings as errors in the front end and in ptxas
  (register spills included), and checks that the PTX defines every kernel
  kernels/bulletin_kernels/cuda.py launches;
- if an NVRTC library is found (``--nvrtc``, ``$BULLETIN_NVRTC``, the CUDA toolkit, or
  the ``nvidia-cuda-nvrtc`` wheel), compiles it with NVRTC too, as CuPy does, under
  C++11, C++14 and C++17 (CuPy's default standard differs by version); any warning
  in NVRTC's log fails the check.

Prints one line per file; exits 1 on any failure. Without nvcc it exits 0 with a
message, unless the environment variable CI is set (CI images must have nvcc).

    python scripts/check_kernels.py [--nvcc PATH] [--nvrtc LIBNVRTC] [--arch sm_90]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bulletin_kernels.cuda import KERNEL_DIR, KERNEL_ENTRIES, KERNEL_FILES, kernel_source

_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.MULTILINE)
_INCLUDE = re.compile(r"^\s*#\s*include\b", re.MULTILINE)
_STANDARDS = ("c++11", "c++14", "c++17")


def _missing_entries(name: str, ptx: str) -> list[str]:
    return sorted(set(KERNEL_ENTRIES[name]) - set(_ENTRY.findall(ptx)))


def compile_nvcc(nvcc: str, arch: str, name: str, source: str, workdir: Path) -> str | None:
    """Compile with nvcc; returns an error message, or None."""
    cu = workdir / f"{name}.cu"
    cu.write_text(source, encoding="utf-8")
    ptx = workdir / f"{name}.ptx"
    common = [nvcc, f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings"]
    steps = [
        [*common, "--ptx", "-o", str(ptx), str(cu)],
        # -c runs ptxas too: spills and ptxas warnings fail the check.
        [*common, "-Xptxas", "--warn-on-spills,--warning-as-error", "-c", "-o", str(workdir / f"{name}.o"), str(cu)],
    ]
    for cmd in steps:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            return (result.stdout + result.stderr).strip()
    missing = _missing_entries(name, ptx.read_text(encoding="utf-8"))
    return (
        f"kernels launched by kernels/bulletin_kernels/cuda.py but not defined: {', '.join(missing)}"
        if missing
        else None
    )


class Nvrtc:
    """The few NVRTC calls CuPy makes to compile a source, through ctypes."""

    def __init__(self, path: Path) -> None:
        # libnvrtc loads its builtins library by soname; make the sibling one visible.
        for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
            if ".alt." not in builtins.name:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                break
        self._lib = ctypes.CDLL(str(path))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"

    def compile(self, name: str, source: str, options: list[str]) -> tuple[int, str, str]:
        """Returns (NVRTC status, log, PTX)."""
        lib, prog = self._lib, ctypes.c_void_p()
        status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None)
        if status:
            return status, "nvrtcCreateProgram failed", ""
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            ptx = b""
            if status == 0:
                lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
                buf = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetPTX(prog, buf)
                ptx = buf.value
            return status, log.value.decode(errors="replace").strip(), ptx.decode(errors="replace")
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_nvrtc(explicit: str | None) -> Path | None:
    """libnvrtc from the flag, the environment, the CUDA toolkit or the pip wheel."""
    candidates: list[Path] = []
    if explicit or os.environ.get("BULLETIN_NVRTC"):
        return Path(explicit or os.environ["BULLETIN_NVRTC"])
    for root in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        candidates += sorted((Path(root) / "lib64").glob("libnvrtc.so*"))
    candidates += sorted((Path(sysconfig.get_paths()["purelib"]) / "nvidia").glob("cu*/lib/libnvrtc.so*"))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(Path(found))
    return next((c for c in candidates if c.exists() and ".alt." not in c.name), None)


def compile_nvrtc(nvrtc: Nvrtc, arch: str, name: str, source: str) -> str | None:
    """Compile with NVRTC under each C++ standard; returns an error message, or None."""
    compute = arch.replace("sm_", "compute_")
    for std in _STANDARDS:
        status, log, ptx = nvrtc.compile(name, source, [f"--gpu-architecture={compute}", f"--std={std}"])
        if status or "warning" in log.lower() or "error" in log.lower():
            return f"NVRTC {nvrtc.version} ({std}), status {status}:\n{log}"
        missing = _missing_entries(name, ptx)
        if missing:
            return f"NVRTC ({std}): kernels not defined: {', '.join(missing)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvcc", default=os.environ.get("NVCC") or shutil.which("nvcc"))
    parser.add_argument("--nvrtc", default=None, help="path of libnvrtc.so (optional)")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args(argv)
    if not args.nvcc or not Path(args.nvcc).exists():
        if os.environ.get("CI"):
            print("check_kernels: nvcc not found, and CI is set: failing", file=sys.stderr)
            return 1
        print("check_kernels: nvcc not found; skipped (set CI=1 to make this an error)")
        return 0
    nvrtc_path = find_nvrtc(args.nvrtc)
    nvrtc = Nvrtc(nvrtc_path) if nvrtc_path is not None else None
    on_disk = sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))
    failures = 0
    if on_disk != sorted(KERNEL_FILES):
        print(f"FAIL {KERNEL_DIR}/*.cu is {on_disk}, bulletin_kernels.cuda.KERNEL_FILES {sorted(KERNEL_FILES)}")
        failures += 1
    with tempfile.TemporaryDirectory(prefix="bulletin-kernels-") as tmp:
        for name in KERNEL_FILES:
            started = time.perf_counter()
            source = kernel_source(name)
            if _INCLUDE.search(source):
                error: str | None = "an #include is left after pasting common.cuh (NVRTC gets no include path)"
            else:
                error = compile_nvcc(args.nvcc, args.arch, name, source, Path(tmp))
                if error is None and nvrtc is not None:
                    error = compile_nvrtc(nvrtc, args.arch, name, source)
            took = time.perf_counter() - started
            compilers = "nvcc" if nvrtc is None else f"nvcc + NVRTC {nvrtc.version} ({'/'.join(_STANDARDS)})"
            kernels = len(KERNEL_ENTRIES[name])
            shown = f"kernels/bulletin_kernels/{name}.cu"
            if error is None:
                print(f"ok   {shown} ({args.arch}, {compilers}, {took:.1f} s): {kernels} kernels")
            else:
                print(f"FAIL {shown} ({args.arch}, {compilers}):\n{error}")
                failures += 1
    if nvrtc is None:
        print("check_kernels: no libnvrtc found (--nvrtc, $BULLETIN_NVRTC); NVRTC compile skipped")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
