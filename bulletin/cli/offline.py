"""Offline commands: a bsdiff for safetensors checkpoints.

``bulletin diff OLD NEW -o PATCH``, ``bulletin apply BASE PATCH -o OUT`` and
``bulletin inspect PATCH``. A patch file is one self-describing patch shard
(docs/FORMAT.md) holding every tensor, with the fingerprints of both checkpoints.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from bulletin.cli.output import Output, human_bytes, json_option, pass_output
from patcher.compression import CODECS, DEFAULT_CODEC

if TYPE_CHECKING:
    from patcher.patch import Patch

__all__ = ["apply_command", "diff_command", "inspect_command", "patch_summary"]

_ONE_SHARD = 1 << 62


def patch_summary(patch: Patch, data: bytes) -> dict[str, Any]:
    """Per-tensor and total figures of a one-shard patch, as ``inspect --json`` prints them.

    The streams of a shard are compressed together, across tensors, so a tensor's
    ``bytes`` is its share of the compressed payload in proportion to its decoded
    stream bytes; the totals are exact.
    """
    from patcher.decode import read_shard_header
    from patcher.fingerprint import format_fingerprint

    header = read_shard_header(data)
    decoded: dict[str, int] = {}
    for entry in header.entries:
        decoded[entry.tensor] = decoded.get(entry.tensor, 0) + entry.decoded_bytes
    all_decoded = sum(decoded.values())
    stream_bytes = {
        name: round(header.payload_length * size / all_decoded) if all_decoded else 0 for name, size in decoded.items()
    }
    encoded_bytes = len(data)
    tensors = [
        {
            "name": td.spec.name,
            "dtype": td.spec.dtype,
            "shape": list(td.spec.shape),
            "changed_elements": td.changed,
            "total_elements": td.spec.numel,
            "bytes": stream_bytes.get(td.spec.name, 0),
            "base_fingerprint": format_fingerprint(td.base_fingerprint),
            "target_fingerprint": format_fingerprint(td.target_fingerprint),
        }
        for td in patch
    ]
    changed = patch.changed_elements
    return {
        "tensors": tensors,
        "changed_elements": changed,
        "total_elements": patch.total_elements,
        "dense_bytes": patch.total_bytes,
        "bytes": encoded_bytes,
        "bytes_per_changed_element": encoded_bytes / changed if changed else None,
        "changed_fraction": changed / patch.total_elements if patch.total_elements else 0.0,
    }


@click.command("diff")
@click.argument("old", type=click.Path(exists=True, path_type=Path))
@click.argument("new", type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Patch file to write.")
@click.option("--codec", type=click.Choice(CODECS), default=DEFAULT_CODEC, show_default=True)
@json_option
@pass_output
def diff_command(out: Output, old: Path, new: Path, output: Path, codec: str) -> None:
    """Write the exact bit difference between two safetensors checkpoints."""
    from bulletin.checkpoint import Checkpoint
    from bulletin.errors import IncompatibleTensors
    from bulletin.fileio import write_atomic
    from patcher.diff import diff
    from patcher.encode import encode

    t0 = time.perf_counter()
    with Checkpoint(old) as a, Checkpoint(new) as b:
        if a.specs != b.specs:
            raise IncompatibleTensors(
                f"{old} and {new} do not hold the same tensors (names, dtypes and shapes must match)"
            )
        specs = a.specs
        patch = diff(specs, {n: a.bits(n) for n in specs}, {n: b.bits(n) for n in specs})
        (data,) = encode(patch, max_shard_bytes=_ONE_SHARD, codec=codec)
    write_atomic(output, [data])
    summary = patch_summary(patch, data) | {"output": str(output), "seconds": time.perf_counter() - t0}

    def human() -> None:
        click.echo(
            f"{output}: {human_bytes(len(data))} for {summary['changed_elements']:,} changed of "
            f"{summary['total_elements']:,} elements ({100 * summary['changed_fraction']:.3f}%), "
            f"{human_bytes(patch.total_bytes)} dense"
        )

    out.emit(summary, human)


@click.command("apply")
@click.argument("base", type=click.Path(exists=True, path_type=Path))
@click.argument("patch_file", metavar="PATCH", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    required=True,
    help="A .safetensors file, or a directory for an HF-style checkpoint.",
)
@json_option
@pass_output
def apply_command(out: Output, base: Path, patch_file: Path, output: Path) -> None:
    """Rebuild the new checkpoint from BASE and PATCH, verified bit for bit."""
    import numpy as np

    from bulletin.checkpoint import Checkpoint, safetensors_bytes, write_checkpoint
    from bulletin.errors import InvalidInput, WrongBase
    from bulletin.fileio import write_atomic
    from patcher.apply import apply as apply_patch
    from patcher.decode import decode
    from patcher.fingerprint import fingerprint

    t0 = time.perf_counter()
    patch = decode([patch_file.read_bytes()])
    if output.exists() and output.resolve() == base.resolve():
        raise InvalidInput("the output must not overwrite the base checkpoint")
    with Checkpoint(base) as ckpt:
        patch.check_layout(ckpt.specs)
        arrays = {}
        fps = {}
        for name in ckpt.specs:
            bits = np.array(ckpt.bits(name), copy=True)
            fps[name] = fingerprint(bits)
            if fps[name] != patch.tensors[name].base_fingerprint:
                raise WrongBase(f"{base}: tensor {name!r} is not the base this patch was made from")
            arrays[name] = bits
        specs = ckpt.specs
        metadata = {k: v for k, v in ckpt.metadata.items() if k != "format"}
    new_fps = apply_patch(patch, arrays, fps)
    if output.suffix == ".safetensors":
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(output, [safetensors_bytes([specs[n] for n in sorted(specs)], arrays, metadata)])
        written = [output]
    else:
        written = write_checkpoint(output, specs, arrays, metadata=metadata)
    summary = {
        "output": [str(p) for p in written],
        "changed_elements": patch.changed_elements,
        "tensors": len(new_fps),
        "verified": True,
        "seconds": time.perf_counter() - t0,
    }
    out.emit(summary, lambda: click.echo(f"wrote {', '.join(map(str, written))} ({len(new_fps)} tensors verified)"))


@click.command("inspect")
@click.argument("patch_file", metavar="PATCH", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--top", type=int, default=20, show_default=True, help="Tensors listed (most changed first).")
@json_option
@pass_output
def inspect_command(out: Output, patch_file: Path, top: int) -> None:
    """Show what a patch file changes, per tensor and in total."""
    from patcher.decode import decode

    data = patch_file.read_bytes()
    summary = patch_summary(decode([data]), data)

    def human() -> None:
        click.echo(
            f"{patch_file}: {human_bytes(summary['bytes'])}, {summary['changed_elements']:,} of "
            f"{summary['total_elements']:,} elements changed ({100 * summary['changed_fraction']:.3f}%)"
        )
        rows = sorted(summary["tensors"], key=lambda t: -t["changed_elements"])[:top]
        width = max((len(t["name"]) for t in rows), default=4)
        click.echo(f"{'tensor':<{width}}  {'dtype':<7} {'changed':>12} {'total':>14} {'%':>8} {'bytes':>10}")
        for t in rows:
            pct = 100 * t["changed_elements"] / t["total_elements"] if t["total_elements"] else 0.0
            click.echo(
                f"{t['name']:<{width}}  {t['dtype']:<7} {t['changed_elements']:>12,} "
                f"{t['total_elements']:>14,} {pct:>8.3f} {t['bytes']:>10,}"
            )

    out.emit(summary, human)
