#!/usr/bin/env python
"""vLLM's own Python code for the tests, without installing vLLM: prints a search path.

    .venv/bin/python scripts/vllm_source.py          # prints the kit's path (os.pathsep-separated)
    export BULLETIN_TEST_VLLM_PATH="$(.venv/bin/python scripts/vllm_source.py)"

vLLM cannot be installed on a CPU-only machine (its wheel is built against CUDA and
pins its own torch), but the code the tests need from it, the parallel layers and their
weight loaders, the tensor-parallel groups and collectives, is plain Python that runs on
CPU with ``VLLM_TARGET_DEVICE=cpu`` and this environment's torch. So the kit is:

- the ``.py`` files of the ``vllm`` wheel (:data:`VLLM_VERSION`, whose checksum
  :data:`VLLM_SHA256` is checked before anything is unpacked; no compiled extension is
  used, none is unpacked), and
- the few dependencies that ``import vllm.config``, ``vllm.distributed`` and
  ``vllm.model_executor.layers.*`` need and this project's environment lacks
  (:data:`DEPENDENCIES`, pinned, installed with ``pip install --target --no-deps
  --require-hashes``, each wheel's checksum recorded below).

Everything goes to one cache folder (``$BULLETIN_VLLM_KIT_DIR``, default
``${XDG_CACHE_HOME:-~/.cache}/bulletin/vllm-<version>-<digest of the pins>``), built in
a temporary folder next to it and renamed into place when complete, so an interrupted
build never leaves a half kit that looks whole. A warm cache costs one ``stat``. The
tests that need the kit (``tests/tp``) skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: The vLLM release whose code the tests run (``vllm/_version.py``: commit ``g4ba787ec9``).
VLLM_VERSION = "0.33.0"
VLLM_WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
VLLM_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"

#: What vLLM's imports need beyond this project's environment: requirement -> wheel SHA-256
#: (CPython 3.11, x86_64 Linux). Found by importing vllm.config, vllm.distributed, the layers,
#: models.utils and models.llama with nothing else on the path, adding what each failure named.
DEPENDENCIES: dict[str, str] = {
    "apache_tvm_ffi==0.1.15.post2": "8ecebe749834f6ac0f2693d5964acf9ac75d0bc26e6ba64c46eb7ab00ea50fac",
    "cachetools==8.0.2": "502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d",
    "cbor2==6.3.0": "ebe634e9fe6ae36b3fe1c42d280c4ecb368397efbcd497f8d5826d48e9093f1b",
    "certifi==2026.10.19.post1": "1324c476b4811eff41a8bc2122cd0bbd4d9c7234c725446d99ab1612b3a7fdd2",
    "cloudpickle==3.1.3": "1654f4f18e416447210a63c5c25a135d65a292156aa5fa519dfa4baf7726dddb",
    "einops==0.8.2": "54058201ac7087911181bfec4af6091bb59380360f069276601256a76af08193",
    "fastapi==0.165.0": "896f48462042bb4f162147eb8fac7e858753dc1f486765709baf105d70e4fc5b",
    "llguidance==1.9.1": "dfac6021d9c4c5ef16b3a1d336c05ca5e8208ff30dec29d1c63ebcafbee3a346",
    "msgspec==0.23.0": "2e514e5b2a23e376f545f4962834b7312d9400705627c53330116b46daddfbe3",
    "openai==3.57.0": "f97bc74024c06ced8428b56c4a3594066709d3082779bf9d0b4b6092fbf587a8",
    "openai_harmony==0.0.8": "c007d277218a50db8839e599ed78e0fffe5130f614c3f6d93ae257f282071a29",
    "opentelemetry_api==1.45.2": "2cbd737377e710ee740d261c94e93fa0f08e6d037c18f17513cc0a2d94479a34",
    "partial_json_parser==0.2.1.1.post7": "145119e5eabcf80cbb13844a6b50a85c68bf99d376f8ed771e2a3c3b03e653ae",
    "pillow==13.0.0": "a625df9a2a5597fa5e5266e01aefc82604bb85d291e3547981e863560d75da6c",
    "prometheus_client==0.26.0": "fa93d06737aa02bacd05794768508bb97d2fbee28cb3bca04eaae92f0ca953d6",
    "psutil==7.2.2": "076a2d2f923fd4821644f5ba89f059523da90dc9014e85f8e45a5774ca5bc6f9",
    "py_cpuinfo==9.0.0": "859625bc251f64e21f077d099d4162689c762b5d6a4c3c97553d56241c9674d5",
    "pybase64==1.5.1": "13cfb64d2a0a8e15b9196c8b1ad61d8adfd8ee68bf4ce749cbb3a313239fef3b",
    "pyzmq==27.3.0": "477b8ad30d66fc905c5388351e83b9ac25824b00e82c0d052b72ea6392636dfd",
    "requests==2.34.2": "2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0",
    "sniffio==1.3.1": "2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2",
    "starlette==1.10.0": "478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4",
    "uvloop==0.23.0": "ab17b3a8aa754be0de0e397f7b95f13b14e56f077a4c6ae295e3d4afd199b325",
    "xgrammar==0.2.9": "b5179499ae9ef8366e1dcf592c3ee6b17ecf646971df50828b242934862d916c",
}

KIT_ENV = "BULLETIN_VLLM_KIT_DIR"
STAMP = "COMPLETE"


def _pins_digest() -> str:
    text = "\n".join([VLLM_WHEEL, VLLM_SHA256, *(f"{r} {h}" for r, h in sorted(DEPENDENCIES.items()))])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def kit_dir() -> Path:
    given = os.environ.get(KIT_ENV)
    if given:
        return Path(given)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "bulletin" / f"vllm-{VLLM_VERSION}-{_pins_digest()}"


def search_path(kit: Path) -> str:
    """The kit's folders, as ``BULLETIN_TEST_VLLM_PATH`` wants them."""
    return os.pathsep.join([str(kit / "src"), str(kit / "deps")])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check", "--no-input"]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if result.returncode:
        # pip on these machines lists every local index folder it skips: keep the error readable.
        lines = [ln for ln in result.stdout.splitlines() if "is ignored: it is neither a file" not in ln]
        raise SystemExit(f"vllm_source: pip {args[0]} failed:\n" + "\n".join(lines[-30:]))


def build(kit: Path) -> None:
    kit.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{kit.name}-", dir=kit.parent))
    try:
        wheels = work / "wheels"
        _pip("download", f"vllm=={VLLM_VERSION}", "--no-deps", "--only-binary=:all:", "-d", str(wheels))
        wheel = wheels / VLLM_WHEEL
        if not wheel.is_file():
            raise SystemExit(f"vllm_source: pip did not download {VLLM_WHEEL}: {sorted(os.listdir(wheels))}")
        found = _sha256(wheel)
        if found != VLLM_SHA256:
            raise SystemExit(f"vllm_source: {VLLM_WHEEL} has SHA-256 {found}, expected {VLLM_SHA256}")
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith("vllm/") and m.endswith(".py")]
            for member in members:
                target = (work / "src" / member).resolve()
                if not target.is_relative_to((work / "src").resolve()):
                    raise SystemExit(f"vllm_source: {member!r} escapes the kit")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
        wheel.unlink()
        if DEPENDENCIES:
            requirements = work / "requirements.txt"
            requirements.write_text("".join(f"{r} --hash=sha256:{h}\n" for r, h in DEPENDENCIES.items()))
            _pip(
                "install",
                "--no-deps",
                "--only-binary=:all:",
                "--require-hashes",
                "--no-compile",
                "--target",
                str(work / "deps"),
                "-r",
                str(requirements),
            )
        else:
            (work / "deps").mkdir()
        shutil.rmtree(wheels)
        (work / STAMP).write_text(f"{VLLM_WHEEL} {len(members)} files\n")
        if kit.exists():  # an incomplete kit (no stamp) from an older layout
            shutil.rmtree(kit)
        work.rename(kit)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    kit = kit_dir()
    if not (kit / STAMP).is_file():
        print(
            f"vllm_source: building {kit} (vllm {VLLM_VERSION} .py files + {len(DEPENDENCIES)} deps)", file=sys.stderr
        )
        build(kit)
    print(search_path(kit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
