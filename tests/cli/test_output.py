"""How the command is wired: --json at group and command level, errors, lazy imports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from bulletin.cli import cli, main
from bulletin.cli.output import EXIT_CODES, Output, exit_status
from bulletin.errors import BulletinError, ConfigError, DigestMismatch, NotFound


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_before_or_after_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--store", str(tmp_path / "bucket"), "--run", "r"]
    code, after, _ = run(capsys, "status", *where, "--json")
    assert code == 0
    code, before, _ = run(capsys, "--json", "status", *where)
    assert code == 0 and json.loads(before) == json.loads(after)
    # Nothing carries over from one invocation to the next (no module state).
    code, text, _ = run(capsys, "status", *where)
    assert code == 0 and text.startswith("run r in ")


def test_group_json_formats_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--json", "log", "--store", "gopher://x", "--run", "r")
    assert code == 2 and err == ""
    assert json.loads(out)["error"]["code"] == "config_error"
    code, out, err = run(capsys, "log", "--store", "gopher://x", "--run", "r")
    assert code == 2 and out == "" and err.startswith("error: config_error:") and err.count("\n") == 1


def test_store_and_run_are_required_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = click.Context(cli)
    for name in ("publish", "sync", "log", "status", "verify", "gc", "serve"):
        command = cli.get_command(ctx, name)
        assert command is not None, name
        params = {p.name for p in command.params}
        assert {"store", "run"} <= params, name
    code, _, err = run(capsys, "log", "--run", "r")
    assert code == 2 and "Missing option '--store'" in err


def test_exit_status_by_kind() -> None:
    assert exit_status(ConfigError("x")) == 2
    assert exit_status(NotFound("x")) == 3
    assert exit_status(DigestMismatch("x")) == 5
    assert exit_status(BulletinError("x")) == 1
    assert EXIT_CODES[-1] == (BulletinError, 1)  # the catch-all comes last


def test_commands_get_the_context_output() -> None:
    seen: list[Output] = []

    @click.command()
    @click.pass_obj
    def probe(obj: Output) -> None:
        seen.append(obj)

    cli.add_command(probe, "probe-output")
    try:
        result = CliRunner().invoke(cli, ["--json", "probe-output"], obj=Output())
    finally:
        del cli.commands["probe-output"]
    assert result.exit_code == 0, result.output
    assert seen and seen[0].json is True


def test_starting_the_command_does_not_load_the_server_stack(tmp_path: Path) -> None:
    # A subprocess: this test process may already hold aiohttp from other tests.
    script = textwrap.dedent(
        """
        import sys
        from bulletin.cli import main
        import bulletin.sidecar.cli  # first: it must import without a cycle through bulletin.cli
        codes = [main(["--help"]), main(["serve", "--help"]),
                 main(["log", "--store", sys.argv[1], "--run", "r", "--json"])]
        loaded = sorted(m for m in ("aiohttp", "torch", "transformers") if m in sys.modules)
        print("RESULT", codes, loaded)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    assert line == "RESULT [0, 0, 0] []", proc.stdout
