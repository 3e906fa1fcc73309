"""Model files (config, tokenizer, ...) travel with the run: published once, held by every
node folder byte for byte, kept by gc, copied by mirrors, checked by verify
(docs/FORMAT.md 5.1)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.errors import DigestMismatch, FormatError, InvalidInput
from bulletin.maintenance import collect_garbage, verify
from bulletin.mirror import Mirror
from bulletin.model_files import ModelFiles, select_model_files, with_served_dtype
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, LocalDirTarget, read_local_state
from schemas.local_state import LocalStateV1, LocalStateV2
from schemas.manifest import ManifestV1, ManifestV3, manifest_files, parse_manifest
from tests.run.helpers import ToyTrainer

CONFIG = json.dumps({"model_type": "llama", "torch_dtype": "float32"}, indent=2).encode()
TOKENIZER = b'{"model": {"type": "BPE"}}'
TEMPLATE = b"{% for m in messages %}{{ m['content'] }}{% endfor %}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def folder_files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LocalDirTarget.MARKER and not p.name.endswith(".safetensors")
    }


def objects(store: Path, run: str, prefix: str) -> list[str]:
    root = store / run / prefix
    return sorted(p.relative_to(store / run).as_posix() for p in root.rglob("*") if p.is_file())


def test_files_are_published_once_and_carried_over(tmp_path: Path) -> None:
    store = tmp_path / "bucket"
    trainer = ToyTrainer(seed=1)
    with Publisher(store, "r", keyframe_every=3) as pub:
        pub.publish(trainer.state, files={"config.json": CONFIG, "tokenizer.json": TOKENIZER})
        first = pub.results[-1]
        trainer.step()
        pub.publish(trainer.state)  # no files given: the previous version's
        trainer.step()
        pub.publish(trainer.state, files={"config.json": CONFIG, "tokenizer.json": TOKENIZER})  # the same bytes
        trainer.step()
        pub.publish(trainer.state, files={"config.json": CONFIG, "chat_template.jinja": TEMPLATE})
    run = Run(open_store(store), "r")
    manifests = [run.read_manifest(v).manifest for v in (1, 2, 3, 4)]
    assert all(type(m) is ManifestV3 for m in manifests)
    # config.json names the dtype the tensors are served in, and the publish says so.
    served_config = json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}, indent=2, sort_keys=True) + "\n"
    assert first.notes == ("config.json: torch_dtype float32 -> bfloat16",)
    assert first.files == ("config.json", "tokenizer.json") and first.files_uploaded > 0
    assert [r.files_uploaded for r in pub.results[1:3]] == [0, 0]  # nothing new uploaded
    assert pub.results[3].files_uploaded == len(TEMPLATE)
    config_refs = {f.key for m in manifests for f in manifest_files(m) if f.path == "config.json"}
    assert len(config_refs) == 1 and next(iter(config_refs)).startswith("files/00000000000000000001/")
    assert [f.path for f in manifest_files(manifests[3])] == ["chat_template.jinja", "config.json"]
    assert manifest_files(manifests[3])[0].key == f"files/{4:020d}/{sha(TEMPLATE)}"
    assert objects(store, "r", "files") == sorted(
        [
            f"files/{1:020d}/{sha(served_config.encode())}",
            f"files/{1:020d}/{sha(TOKENIZER)}",
            f"files/{4:020d}/{sha(TEMPLATE)}",
        ]
    )
    # A restarted trainer keeps the tip's files without reading them.
    with Publisher(store, "r") as again:
        trainer.step()
        assert again.publish(trainer.state) == 5
        assert again.results[-1].files == ("chat_template.jinja", "config.json")
        assert again.results[-1].files_uploaded == 0


def test_a_run_without_files_keeps_writing_spec_version_1(tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=2)
    with Publisher(tmp_path, "r", codec="zstd") as pub:
        pub.publish(trainer.state)
        trainer.step()
        pub.publish(trainer.state)
        trainer.step()
        pub.publish(trainer.state, files={"config.json": CONFIG})
    run = Run(open_store(tmp_path), "r")
    assert [type(run.read_manifest(v).manifest) for v in (1, 2, 3)] == [ManifestV1, ManifestV1, ManifestV3]
    node = tmp_path / "node"
    with Subscriber(tmp_path, "r", node) as sub:
        sub.sync(2)
        assert type(read_local_state(node)) is LocalStateV1  # older readers keep reading it
        sub.sync(3)
        assert type(read_local_state(node)) is LocalStateV2


def test_every_node_folder_holds_the_files_of_its_version(tmp_path: Path) -> None:
    store = tmp_path / "bucket"
    trainer = ToyTrainer(seed=3)
    versions = {
        1: {"config.json": CONFIG, "tokenizer.json": TOKENIZER},
        2: {"config.json": CONFIG, "tokenizer.json": TOKENIZER},
        3: {"config.json": CONFIG, "tokenizer.json": TOKENIZER + b" ", "original/tokenizer.model": b"\x00spm"},
        4: {"config.json": CONFIG, "tokenizer.json": TOKENIZER + b" ", "original/tokenizer.model": b"\x00spm"},
        5: {"config.json": CONFIG},
    }
    served = {}
    with Publisher(store, "r", keyframe_every=2) as pub:  # keyframes 1, 3, 5
        for version, files in versions.items():
            if version > 1:
                trainer.step()
            pub.publish(trainer.state, files=files)
            served[version] = {p: (b if p != "config.json" else with_config(b)) for p, b in files.items()}
    node = tmp_path / "node"
    fetched = []
    with Subscriber(store, "r", node) as sub:
        for version in (1, 2, 3, 4, 5, 4, 2):  # in place, keyframes (a new folder), downgrades
            assert sub.sync(version) == version
            report = sub.stats.last_report
            assert report is not None
            fetched.append(report.files_downloaded)
            assert folder_files(node / "current") == served[version], version
            target = sub.target
            assert isinstance(target, LocalDirTarget)
            assert target.files == {p: sha(b) for p, b in served[version].items()}
            assert sorted(os.listdir(node / "files")) == sorted({sha(b) for b in served[version].values()})
    # Files that did not change are never fetched again (2 after 1, 4 after 3, in place;
    # 5 drops two); going back, those dropped since are (through keyframes 3 and 1).
    assert fetched == [2, 0, 2, 0, 0, 2, 1]
    assert not (node / "current" / "original").exists()  # the nested file's folder went with it
    # Targets that are not folders ignore files.
    host = ArrayTarget()
    assert Subscriber(store, "r", target=host).sync() == 5


def with_config(data: bytes) -> bytes:
    files, _ = with_served_dtype(ModelFiles.of({"config.json": data}), "BF16")
    return files.files["config.json"]


def test_a_damaged_file_is_restored_from_the_kept_copy_and_a_lost_one_from_the_run(tmp_path: Path) -> None:
    store = tmp_path / "bucket"
    with Publisher(store, "r") as pub:
        pub.publish(ToyTrainer(seed=4).state, files={"tokenizer.json": TOKENIZER, "vocab.txt": b"a\nb\n"})
    node = tmp_path / "node"
    with Subscriber(store, "r", node) as sub:
        sub.sync()
    (node / "current" / "tokenizer.json").write_bytes(b"edited")  # a user edits the file
    (node / "current" / "vocab.txt").unlink()
    (node / "current" / "README.md").write_bytes(b"mine")  # and adds one
    target = LocalDirTarget(node, run="r")
    assert target.restored() is not None
    assert folder_files(node / "current") == {"README.md": b"mine", "tokenizer.json": TOKENIZER, "vocab.txt": b"a\nb\n"}
    target.close()
    # Both copies gone bad: the folder is not an exact version until a keyframe rebuilds it.
    (node / "current" / "tokenizer.json").write_bytes(b"edited")
    (node / "files" / sha(TOKENIZER)).write_bytes(b"rotten")
    with Subscriber(store, "r", node) as sub:
        assert sub.current_version is None
        assert sub.sync() == 1
        report = sub.stats.last_report
        assert report is not None and report.keyframe == 1 and report.files_downloaded == 1
    assert folder_files(node / "current")["tokenizer.json"] == TOKENIZER


def test_a_tampered_file_object_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    store = tmp_path / "bucket"
    trainer = ToyTrainer(seed=5)
    with Publisher(store, "r") as pub:
        pub.publish(trainer.state, files={"tokenizer.json": TOKENIZER})
        trainer.step()
        pub.publish(trainer.state, files={"tokenizer.json": TOKENIZER + b"2"})
    node = tmp_path / "node"
    with Subscriber(store, "r", node) as sub:
        sub.sync(1)
    (store / "r" / "files" / f"{2:020d}" / sha(TOKENIZER + b"2")).write_bytes(b"X" * (len(TOKENIZER) + 1))
    with Subscriber(store, "r", node) as sub, pytest.raises(DigestMismatch):
        sub.sync(2)
    with Subscriber(store, "r", node) as sub:
        assert sub.current_version == 1
    assert folder_files(node / "current") == {"tokenizer.json": TOKENIZER}
    assert sorted(os.listdir(node / "files")) == [sha(TOKENIZER)]
    report = verify(Run(open_store(store), "r"))
    assert not report.ok and any("file 'tokenizer.json'" in p and "digest_mismatch" in p for p in report.problems)
    assert report.files == 2


def test_gc_keeps_every_file_a_kept_version_names_and_mirrors_copy_them(tmp_path: Path) -> None:
    store = tmp_path / "bucket"
    trainer = ToyTrainer(seed=6)
    with Publisher(store, "r", keyframe_every=3) as pub:  # keyframes 1, 4
        for version in range(1, 6):
            if version > 1:
                trainer.step()
            files = {"config.json": CONFIG, "tokenizer.json": TOKENIZER if version < 3 else TOKENIZER + b"3"}
            pub.publish(trainer.state, files=files)
    before = objects(store, "r", "files")
    assert len(before) == 3  # config (v1), tokenizer (v1), tokenizer (v3)
    # A mirror copies them; its subscriber's folder holds them.
    mirror_store = tmp_path / "mirror"
    report = Mirror(store, mirror_store, "r").sync()
    assert report.to_version == 5 and objects(mirror_store, "r", "files") == before
    with Subscriber(mirror_store, "r", tmp_path / "via-mirror") as sub:
        sub.sync()
    assert folder_files(tmp_path / "via-mirror" / "current")["tokenizer.json"] == TOKENIZER + b"3"
    # An orphan (a publish that never committed) goes once old enough; referenced ones stay.
    orphan = store / "r" / "files" / f"{9:020d}" / sha(b"orphan")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"orphan")
    old = 1_000_000_000
    os.utime(orphan, (old, old))
    gc = collect_garbage(Run(open_store(store), "r"), keep=2)
    assert gc.floor == 4
    after = objects(store, "r", "files")
    # config.json of version 1 is still named by 4 and 5; version 1's tokenizer is not.
    assert after == [f"files/{1:020d}/{sha(with_config(CONFIG))}", f"files/{3:020d}/{sha(TOKENIZER + b'3')}"]
    assert not orphan.exists()
    assert verify(Run(open_store(store), "r")).ok
    with Subscriber(store, "r", tmp_path / "fresh") as sub:
        assert sub.sync() == 5
    assert folder_files(tmp_path / "fresh" / "current") == {
        "config.json": with_config(CONFIG),
        "tokenizer.json": TOKENIZER + b"3",
    }


def test_folder_selection_takes_configs_and_tokenizers_and_names_what_it_leaves(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    names = {
        "config.json": b"{}",
        "generation_config.json": b"{}",
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "special_tokens_map.json": b"{}",
        "vocab.json": b"{}",
        "merges.txt": b"",
        "tokenizer.model": b"\x00",
        "cl100k.tiktoken": b"",
        "chat_template.jinja": b"",
        "model.safetensors": b"",
        "model.safetensors.index.json": b"{}",
        "pytorch_model.bin": b"pickle",
        "training_args.bin": b"pickle",
        "optimizer.pt": b"pickle",
        "modeling_custom.py": b"",
        "README.md": b"",
        ".gitattributes": b"",
    }
    for name, data in names.items():
        (folder / name).write_bytes(data)
    (folder / "original").mkdir()
    selected = select_model_files(folder)
    assert sorted(selected.files) == [
        "chat_template.jinja",
        "cl100k.tiktoken",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert set(selected.skipped) == set(names) - set(selected.files) | {"original"}
    assert "pickled" in selected.skipped["pytorch_model.bin"] and "pickled" in selected.skipped["training_args.bin"]
    assert "code" in selected.skipped["modeling_custom.py"]
    assert "tensor file" in selected.skipped["model.safetensors"]
    chosen = select_model_files(folder, include=["*.py", "*.bin", "README.md"], exclude=["vocab.json"])
    assert {"modeling_custom.py", "pytorch_model.bin", "README.md"} <= set(chosen.files)
    assert "vocab.json" not in chosen.files and "model.safetensors" not in chosen.files


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"../config.json": b""}, "no '..'"),
        ({"/etc/passwd": b""}, "no absolute"),
        ({".hidden": b""}, "not starting with '.'"),
        ({"a//b": b""}, "each '/'-separated part"),
        ({"model.safetensors": b""}, "tensor file"),
        ({"weights/model-00001-of-00002.safetensors": b""}, "tensor file"),
        ({"model.safetensors.index.json": b"{}"}, "tensor file"),
        ({"Config.json": b"", "config.json": b""}, "differ only by case"),
        ({"tok": b"", "tok/vocab.txt": b""}, "also a folder"),
        ({"big.json": bytes(64 << 20 | 1)}, "at most"),
        ({f"f{i}.txt": b"" for i in range(257)}, "at most 256"),
        ({"config.json": "text"}, "expected bytes"),
    ],
)
def test_bad_files_are_refused_before_anything_is_written(
    tmp_path: Path, files: dict[str, bytes], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message), Publisher(tmp_path, "r") as pub:
        pub.publish({"w": np.zeros(4, np.float32)}, files=files)
    assert not (tmp_path / "r").exists()


def test_a_manifest_with_bad_files_is_refused(tmp_path: Path) -> None:
    with Publisher(tmp_path, "r") as pub:
        pub.publish({"w": np.zeros(4, np.float32)}, files={"config.json": b"{}", "vocab.txt": b"x"})
    data = (tmp_path / "r" / "manifests" / f"{1:020d}.json").read_bytes()
    assert type(parse_manifest(data)) is ManifestV3
    doc = json.loads(data)
    for change, message in [
        (lambda d: d["files"][0].update(path="../config.json"), "path"),
        (lambda d: d["files"][0].update(key=f"files/{2:020d}/{d['files'][0]['sha256']}"), "key"),
        (lambda d: d["files"][0].update(key="patches/x"), "key"),
        (lambda d: d["files"].reverse(), "sorted"),
        (lambda d: d.update(files=[]), "at least 1"),
        (lambda d: d.update(spec_version=2), "Extra inputs"),
    ]:
        bad = json.loads(data)
        change(bad)
        with pytest.raises(FormatError, match=message):
            parse_manifest(json.dumps(bad).encode())
    assert doc["files"][0]["path"] == "config.json"


def test_bulletin_publish_files_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bulletin.checkpoint import write_checkpoint
    from bulletin.cli import main
    from patcher.patch import TensorSpec

    spec = TensorSpec("w", "F32", (8,))
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, {"w": spec}, {"w": np.arange(8, dtype=np.float32).view(np.uint32)})
    (folder / "config.json").write_bytes(CONFIG)
    (folder / "modeling_toy.py").write_bytes(b"class Toy: ...\n")
    common = ["--store", str(tmp_path / "b"), "--run", "r", "--json"]
    assert main(["publish", str(folder), *common, "--include-file", "*.py"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["files"] == ["config.json", "modeling_toy.py"] and set(first["files_skipped"]) == {"model.safetensors"}
    (folder / "config.json").write_bytes(b"{}")
    assert main(["publish", str(folder), *common, "--no-files"]) == 0  # the previous version's
    second = json.loads(capsys.readouterr().out)
    assert second["files"] == first["files"] and second["files_uploaded"] == 0
    assert main(["publish", str(folder), *common, "--exclude-file", "config.json"]) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["files"] == first["files"] and third["files_skipped"]["config.json"] == "excluded"
    assert "code" in third["files_skipped"]["modeling_toy.py"]
    assert main(["publish", str(folder), *common]) == 0
    fourth = json.loads(capsys.readouterr().out)
    assert fourth["files"] == ["config.json"] and fourth["files_uploaded"] == 2
    assert main(["publish", str(folder), *common, "--dtype", "int8"]) == 2  # not a choice
    assert main(["sync", "--store", str(tmp_path / "b"), "--run", "r", "--to", str(tmp_path / "n")]) == 0
    assert folder_files(tmp_path / "n" / "current") == {"config.json": b"{}"}


def test_the_cli_dtype_names_are_the_served_dtypes() -> None:
    from bulletin.cli.options import SERVED_DTYPES
    from bulletin.model_files import HF_DTYPE_NAMES
    from patcher.dtypes import SERVED_FLOAT_DTYPES

    assert tuple(SERVED_DTYPES.values()) == SERVED_FLOAT_DTYPES == tuple(HF_DTYPE_NAMES)
