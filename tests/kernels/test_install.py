"""The installed project lives beside Hugging Face's ``kernels`` package.

A rollout node installs Bulletin into the environment of vLLM or SGLang, where
transformers (5.25 and later) imports the PyPI package ``kernels`` whenever one of that
name is found (``transformers/utils/import_utils.py``, ``is_kernels_available``; then
``transformers/integrations/hub_kernels.py``, ``from kernels import ...``). The kernels'
folder is ``kernels/`` but their import name is ``bulletin_kernels`` (docs/ARCHITECTURE.md):
the wheel built here must hold no top-level ``kernels``, carry the CUDA sources the
kernels compile from, and, installed by pip beside the real ``kernels``, leave
transformers' import of it working.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "bulletin", "patcher", "schemas", "kernels")
TOP_LEVEL = {"bulletin", "patcher", "schemas", "bulletin_kernels"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of its sources (the checkout stays clean)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    for name in SOURCES:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(origin, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(work), "."],
        cwd=source,
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (built,) = work.glob("bulletin-*.whl")
    return built


def test_the_wheel_installs_no_top_level_kernels(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == TOP_LEVEL, top
    kernel_dir = ROOT / "kernels" / "bulletin_kernels"
    shipped = {p.name for p in kernel_dir.iterdir() if p.suffix in {".cu", ".cuh", ".typed"}}
    assert {"common.cuh", "py.typed"} <= shipped
    assert {f"bulletin_kernels/{name}" for name in shipped} <= set(names)


def test_installed_beside_hugging_face_kernels_transformers_still_imports_it(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert not (target / "kernels").exists()
    code = f"""
import transformers
from transformers.utils import is_kernels_available
assert is_kernels_available(), "transformers no longer sees Hugging Face's kernels"
import transformers.integrations.hub_kernels  # `from kernels import ...` when available
import kernels
assert hasattr(kernels, "get_kernel"), kernels.__file__
import bulletin, bulletin_kernels, bulletin_kernels.cuda
for module in (bulletin, bulletin_kernels):
    assert module.__file__.startswith({str(target)!r}), module.__file__
for name in bulletin_kernels.cuda.KERNEL_FILES:
    assert "__global__" in bulletin_kernels.cuda.kernel_source(name), name
"""
    # Run away from the checkout, so only the installed copy can be imported.
    subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, env={**os.environ, "PYTHONPATH": str(target)}
    )


def test_in_the_checkout_kernels_is_still_hugging_faces() -> None:
    # The checkout is on sys.path (pytest's pythonpath): its kernels/ folder, which has no
    # __init__.py, must lose to the installed package of that name.
    module = importlib.import_module("kernels")
    assert module.__file__ is not None and "site-packages" in module.__file__, module
