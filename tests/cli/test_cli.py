"""The CLI, driven as users drive it: real safetensors files, exit codes, --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bulletin.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _checkpoints(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    old = {
        "model.embed.weight": torch.randn(64, 16).to(torch.bfloat16),
        "model.layer.weight": torch.randn(32, 16).to(torch.bfloat16),
        "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "model.step": torch.tensor(3, dtype=torch.int64),
    }
    new = {k: v.clone() for k, v in old.items()}
    flat = new["model.layer.weight"].view(-1)
    flat[::37] = (flat[::37].float() * 1.01).to(torch.bfloat16)
    new["model.embed.weight"][5, 3] = float("nan")
    new["model.step"] = torch.tensor(4, dtype=torch.int64)
    save_file(old, tmp_path / "old.safetensors")
    (tmp_path / "new").mkdir()
    save_file(new, tmp_path / "new" / "model.safetensors")
    return tmp_path / "old.safetensors", tmp_path / "new", new


def test_diff_inspect_apply_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new, tensors = _checkpoints(tmp_path)
    patch = tmp_path / "step.bpatch"
    code, out, _ = run(capsys, "diff", str(old), str(new), "-o", str(patch), "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["changed_elements"] > 0 and summary["bytes"] == patch.stat().st_size

    code, out, _ = run(capsys, "inspect", str(patch), "--json")
    assert code == 0
    info = json.loads(out)
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["model.norm.weight"]["changed_elements"] == 0
    assert by_name["model.step"]["changed_elements"] == 1
    assert by_name["model.layer.weight"]["total_elements"] == 32 * 16
    assert info["total_elements"] == 64 * 16 + 32 * 16 + 16 + 1
    assert info["changed_elements"] == sum(t["changed_elements"] for t in info["tensors"])
    assert all("bytes" in t for t in info["tensors"])

    code, out, _ = run(capsys, "inspect", str(patch))
    assert code == 0 and "model.layer.weight" in out

    rebuilt = tmp_path / "rebuilt.safetensors"
    code, out, _ = run(capsys, "apply", str(old), str(patch), "-o", str(rebuilt), "--json")
    assert code == 0 and json.loads(out)["verified"] is True
    loaded = load_file(rebuilt)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name

    code, _, _ = run(capsys, "apply", str(old), str(patch), "-o", str(tmp_path / "folder"))
    assert code == 0 and (tmp_path / "folder" / "model.safetensors").exists()


def test_apply_to_the_wrong_base_is_refused_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new, _ = _checkpoints(tmp_path)
    patch = tmp_path / "p.bpatch"
    assert run(capsys, "diff", str(old), str(new), "-o", str(patch))[0] == 0
    out_path = tmp_path / "out.safetensors"
    code, _, err = run(capsys, "apply", str(new / "model.safetensors"), str(patch), "-o", str(out_path))
    assert code == 6
    assert err.startswith("error: wrong_base:") and err.count("\n") == 1
    assert not out_path.exists()


def test_incompatible_checkpoints_and_corrupt_patches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new, _ = _checkpoints(tmp_path)
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(3)}, other)
    code, _, err = run(capsys, "diff", str(old), str(other), "-o", str(tmp_path / "p"))
    assert code == 2 and "incompatible_tensors" in err
    patch = tmp_path / "p.bpatch"
    run(capsys, "diff", str(old), str(new), "-o", str(patch))
    data = bytearray(patch.read_bytes())
    data[-3] ^= 0xFF
    patch.write_bytes(bytes(data))
    code, out, _ = run(capsys, "inspect", str(patch), "--json")
    assert code == 5
    assert json.loads(out)["error"]["code"] in {"corrupt_data", "format_error"}
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 64)
    code, _, err = run(capsys, "diff", str(tmp_path / "garbage.safetensors"), str(old), "-o", str(tmp_path / "q"))
    assert code == 5 and err.startswith("error: format_error:")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 8, generator=g).to(torch.bfloat16), "b": torch.randn(8, generator=g)}


def test_publish_sync_log_status_verify_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "bucket")
    common = ["--store", store, "--run", "cli-run"]
    state = _state(0)
    for version in range(1, 6):
        ckpt = tmp_path / f"ckpt{version}.safetensors"
        save_file(state, ckpt)
        code, out, _ = run(
            capsys, "publish", str(ckpt), *common, "--keyframe-every", "2", "--meta", f"step={version}", "--json"
        )
        assert code == 0, out
        result = json.loads(out)
        assert result["version"] == version and result["keyframe"] == (version % 2 == 1)
        state["w"].view(-1)[version::50] += 1

    node = tmp_path / "node"
    code, out, _ = run(capsys, "sync", *common, "--to", str(node), "--version", "3", "--json")
    assert code == 0 and json.loads(out)["version"] == 3
    code, out, _ = run(capsys, "sync", *common, "--to", str(node), "--json")
    assert code == 0 and json.loads(out)["from_version"] == 3 and json.loads(out)["version"] == 5
    report = json.loads(out)
    assert report["changed_elements"] > 0 and min(report[k] for k in ("download_s", "decode_s", "apply_s")) >= 0
    synced = load_file(node / "current" / "model.safetensors")
    assert torch.equal(synced["w"], load_file(tmp_path / "ckpt5.safetensors")["w"])

    code, out, _ = run(capsys, "log", *common, "--json")
    entries = json.loads(out)
    assert [e["version"] for e in entries] == [5, 4, 3, 2, 1]
    assert entries[0]["kind"] == "keyframe+patch" and entries[1]["kind"] == "patch"
    assert entries[-1]["metadata"] == {"step": "1"}
    code, out, _ = run(capsys, "log", *common)
    assert code == 0 and "keyframe" in out

    code, out, _ = run(capsys, "status", *common, "--local", str(node), "--json")
    status = json.loads(out)
    assert (status["head_version"], status["newest_version"], status["local_version"], status["lag"]) == (5, 5, 5, 0)

    code, out, _ = run(capsys, "verify", *common, "--json")
    assert code == 0 and json.loads(out)["ok"] and json.loads(out)["versions"] == 5

    code, out, _ = run(capsys, "gc", *common, "--keep", "2", "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["floor"] == 3 and len(plan["deleted_manifests"]) == 2
    assert (tmp_path / "bucket" / "cli-run" / "manifests" / f"{1:020d}.json").exists()
    code, out, _ = run(capsys, "gc", *common, "--keep", "2")
    assert code == 0 and "deleted 2 manifests" in out
    assert not (tmp_path / "bucket" / "cli-run" / "manifests" / f"{1:020d}.json").exists()
    code, out, _ = run(capsys, "verify", *common, "--json")
    assert code == 0 and json.loads(out)["versions"] == 3
    code, out, _ = run(capsys, "sync", *common, "--to", str(tmp_path / "fresh"), "--json")
    assert code == 0 and json.loads(out)["keyframe"] == 5


def test_verify_reports_a_tampered_bucket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "bucket"
    state = _state(1)
    for _ in range(3):
        save_file(state, tmp_path / "c.safetensors")
        run(capsys, "publish", str(tmp_path / "c.safetensors"), "--store", str(store), "--run", "r")
        state["w"].view(-1)[::9] += 1
    shard = next((store / "r" / "patches").rglob("*.bpatch"))
    shard.write_bytes(shard.read_bytes()[:-1])
    code, out, _ = run(capsys, "verify", "--store", str(store), "--run", "r", "--json")
    report = json.loads(out)
    assert code == 5 and not report["ok"] and "digest_mismatch" in " ".join(report["problems"])


def test_configuration_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "log", "--store", str(tmp_path), "--run", "../escape")
    assert code == 2 and err.startswith("error: config_error:") and err.count("\n") == 1
    code, _, err = run(capsys, "log", "--store", "gopher://x", "--run", "r")
    assert code == 2 and err.startswith("error: config_error:")
    code, _, err = run(capsys, "sync", "--store", str(tmp_path / "none"), "--run", "r", "--to", str(tmp_path / "n"))
    assert code == 3 and err.startswith("error: version_not_found:")


def test_console_entry_point_and_env(tmp_path: Path) -> None:
    env = {"BULLETIN_STORE": str(tmp_path / "bucket"), "BULLETIN_RUN": "envrun", "PATH": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "bulletin", "status", "--json"], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["run"] == "envrun"
    proc = subprocess.run([sys.executable, "-m", "bulletin", "--version"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "bulletin" in proc.stdout


def test_demo_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(2):  # again in the same folder: a new run with its own replica
        code, out, _ = run(
            capsys,
            "demo",
            "--dir",
            str(tmp_path),
            "--params",
            "300000",
            "--versions",
            "4",
            "--keyframe-every",
            "2",
            "--json",
        )
        assert code == 0
        report = json.loads(out)
        assert len(report["versions"]) == 4
        assert report["catch_up_bytes"] < report["dense_bf16_bytes"]
        assert np.isfinite(report["fresh_sync_seconds"])
