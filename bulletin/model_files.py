"""A model's non-tensor files (config, generation config, tokenizer files, ...): which
of a checkpoint folder's files a version carries, checked, and their served dtype.

A run publishes these beside the tensors (docs/FORMAT.md 5.1) so that every node's model
folder is one an engine starts from (``vllm serve DIR/current``). The default selection
(:func:`select_model_files`) takes what engines and ``transformers`` read from a Hugging
Face folder and never code or weights in other formats, and says what it leaves out and
why, so a pickled ``pytorch_model.bin`` is never silently dropped (nor loaded).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from bulletin.errors import InvalidInput, NotFound
from bulletin.fileio import os_errors
from schemas.manifest import MAX_FILE_BYTES, check_file_path, check_files

__all__ = [
    "CODE",
    "CONFIG_NAME",
    "HF_DTYPE_NAMES",
    "HIDDEN",
    "NOT_A_FILE",
    "OTHER",
    "OTHER_WEIGHTS",
    "SUBFOLDER",
    "TENSORS",
    "ModelFiles",
    "select_model_files",
    "with_served_dtype",
]

#: The file whose ``torch_dtype`` / ``dtype`` engines read as the model's default dtype.
CONFIG_NAME: Final = "config.json"
#: Served dtype (safetensors name) -> the name ``transformers`` writes in ``config.json``.
HF_DTYPE_NAMES: Final[dict[str, str]] = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
#: Values of ``torch_dtype`` / ``dtype`` that name a floating-point dtype (rewritten to
#: the served one); anything else (``"auto"``, an integer dtype, a missing key) is left.
_HF_FLOAT_NAMES: Final = frozenset(
    {"bfloat16", "float16", "float32", "float64", "half", "float", "double"}
    | {f"torch.{name}" for name in ("bfloat16", "float16", "float32", "float64", "half", "float", "double")}
)
_DTYPE_KEYS: Final = ("torch_dtype", "dtype")

#: Suffixes (lower case) of the files the default selection takes: what engines and
#: ``transformers`` read from a model folder (configs, tokenizers, chat templates).
_SELECTED: Final = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".vocab", ".spm", ".bpe", ".yaml", ".yml")
#: Weights in formats Bulletin does not serve (pickles among them): never published.
_OTHER_WEIGHTS: Final = (
    ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".h5", ".msgpack", ".onnx",
    ".gguf", ".npy", ".npz", ".ot", ".tflite", ".bin.index.json", ".pth.index.json", ".pt.index.json",
)  # fmt: skip

#: Why a file was left out, by kind (the keys of ``ModelFiles.skipped``'s values).
TENSORS: Final = "tensor file: Bulletin serves the tensors and writes the model folder's own safetensors"
OTHER_WEIGHTS: Final = (
    "weights in another format (pickled or not loaded by Bulletin): the tensors come from safetensors"
)
CODE: Final = "code (remote-code modules): include it explicitly where engines run with trust_remote_code"
OTHER: Final = "not a file engines load from a model folder: include it explicitly to publish it"
SUBFOLDER: Final = "a folder: only the folder's top level is published unless files are named explicitly"
HIDDEN: Final = "hidden"
NOT_A_FILE: Final = "not a regular file"


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A version's model files, checked: relative path -> exact bytes, sorted by path.

    ``skipped`` names what a folder selection left out (path -> why), for the caller to
    show. Build one with :meth:`of` (a mapping) or :func:`select_model_files` (a folder).
    """

    files: Mapping[str, bytes]
    skipped: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, files: Mapping[str, bytes], *, skipped: Mapping[str, str] | None = None) -> ModelFiles:
        """Check ``files`` (path rules and limits, docs/FORMAT.md 5.1; ``InvalidInput``)."""
        if not isinstance(files, Mapping):
            raise InvalidInput(f"files must map relative paths to bytes, not {type(files).__name__}")
        checked: dict[str, bytes] = {}
        for path in sorted(files):
            content = files[path]
            if not isinstance(content, bytes | bytearray | memoryview):
                raise InvalidInput(f"file {path!r}: expected bytes, got {type(content).__name__}")
            try:
                check_file_path(path)
            except ValueError as exc:
                raise InvalidInput(str(exc)) from None
            checked[path] = bytes(content)
        try:
            check_files({path: len(content) for path, content in checked.items()})
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return cls(MappingProxyType(checked), MappingProxyType(dict(sorted((skipped or {}).items()))))

    def __len__(self) -> int:
        return len(self.files)

    @property
    def total_bytes(self) -> int:
        return sum(len(content) for content in self.files.values())


def _kind(name: str) -> str | None:
    """Why the default selection leaves a top-level file of this name out, or None."""
    lower = name.lower()
    if name.startswith("."):
        return HIDDEN
    if lower.endswith(".safetensors") or lower.endswith(".safetensors.index.json"):
        return TENSORS
    if lower.endswith(_OTHER_WEIGHTS):
        return OTHER_WEIGHTS
    if lower.endswith(".py"):
        return CODE
    if lower.endswith(_SELECTED):
        return None
    return OTHER


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def select_model_files(
    folder: str | os.PathLike[str], *, include: Iterable[str] = (), exclude: Iterable[str] = ()
) -> ModelFiles:
    """The model files of a checkpoint folder, by the default rule (docs/FORMAT.md 5.1).

    Of the folder's top level (files a symlink leads to included, as in a Hugging Face
    cache snapshot): configs, tokenizer and chat-template files (``*.json``, ``*.jinja``,
    ``*.txt``, ``*.model``, ``*.tiktoken``, ``*.vocab``, ``*.spm``, ``*.bpe``, ``*.yaml``,
    ``*.yml``). Left out, and named in ``skipped`` with the reason: the tensor files and
    their index (Bulletin writes its own), weights in other formats (``*.bin``, ``*.pt``,
    ``*.pth``, ``*.pkl``, ``*.gguf``, ...: pickles are never published), code (``*.py``),
    hidden files, subfolders, and anything else. ``include`` (glob patterns on the names)
    adds files the rule leaves out (``"*.py"`` for remote code, ``"README.md"``), except
    tensor files, hidden files and subfolders; ``exclude`` removes files it takes. A
    selected file over the size limits, or with a name the format refuses, is
    ``InvalidInput``: exclude it, rather than publish a folder an engine cannot start from.
    """
    root = Path(folder)
    if not root.is_dir():
        raise NotFound(f"no such folder: {root}")
    include, exclude = tuple(include), tuple(exclude)
    chosen: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    with os_errors(f"cannot list {root}"):
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    for entry in entries:
        name = entry.name
        with os_errors(f"cannot read {entry.path}"):
            is_dir, is_file = entry.is_dir(), entry.is_file()
        kind = SUBFOLDER if is_dir else None if is_file else NOT_A_FILE
        kind = kind or _kind(name)
        if kind in (OTHER_WEIGHTS, CODE, OTHER) and _matches(name, include):
            kind = None
        if kind is None and _matches(name, exclude):
            kind = "excluded"
        if kind is not None:
            skipped[name] = kind
            continue
        try:
            check_file_path(name)
        except ValueError as exc:
            raise InvalidInput(f"{entry.path}: {exc}; exclude it to publish the folder") from None
        with os_errors(f"cannot read {entry.path}"):
            size = os.stat(entry.path).st_size
        if size > MAX_FILE_BYTES:
            raise InvalidInput(
                f"{entry.path}: {size} bytes; a model file is at most {MAX_FILE_BYTES} (exclude it to publish the rest)"
            )
        chosen[name] = Path(entry.path)
    contents: dict[str, bytes] = {}
    for name, path in chosen.items():
        with os_errors(f"cannot read {path}"):
            contents[name] = path.read_bytes()
    return ModelFiles.of(contents, skipped=skipped)


def _rewrite_dtypes(config: dict[str, Any], served: str, where: str, notes: list[str]) -> None:
    for key in _DTYPE_KEYS:
        value = config.get(key)
        if isinstance(value, str) and value in _HF_FLOAT_NAMES and value != served:
            config[key] = served
            notes.append(f"{CONFIG_NAME}: {where}{key} {value} -> {served}")


def with_served_dtype(files: ModelFiles, dtype: str) -> tuple[ModelFiles, tuple[str, ...]]:
    """``files`` with ``config.json`` naming ``dtype`` (a served dtype) where it names a
    floating dtype: its top-level ``torch_dtype`` / ``dtype`` and those of its sub-configs
    (``text_config``, ...), which engines take as the dtype to load in when started with
    ``--dtype auto``. Returns the files and one note per value changed (say them: the
    rewrite is never silent). A config that is not a JSON object is left as it is, and so
    is every byte when nothing needs to change; a rewritten one is written as
    ``transformers`` writes configs (sorted keys, two-space indent)."""
    served = HF_DTYPE_NAMES[dtype]
    raw = files.files.get(CONFIG_NAME)
    if raw is None:
        return files, ()
    try:
        config = json.loads(raw)
    except ValueError:
        return files, ()
    if not isinstance(config, dict):
        return files, ()
    notes: list[str] = []
    _rewrite_dtypes(config, served, "", notes)
    for name, sub in config.items():
        if isinstance(sub, dict):
            _rewrite_dtypes(sub, served, f"{name}.", notes)
    if not notes:
        return files, ()
    rewritten = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")
    return ModelFiles.of({**files.files, CONFIG_NAME: rewritten}, skipped=files.skipped), tuple(notes)
