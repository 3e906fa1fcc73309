#!/usr/bin/env python
"""Standalone fuzzer of every patch decoder (decode, decode_shard, read_shard_header).

    python tests/fuzz/fuzz_decode.py                 # 60 s of structure-aware mutations
    python tests/fuzz/fuzz_decode.py --seconds 600   # longer
    python tests/fuzz/fuzz_decode.py --atheris ...   # coverage-guided, if atheris is installed

With atheris (``pip install atheris``), libFuzzer drives the mutation choices through a
FuzzedDataProvider and keeps the inputs that reach new code. Without it, the same
mutations run from Python's ``random`` until the time budget is spent. Either way a
decoder that raises anything but a typed rejection (``CorruptData`` and its subclasses,
``UnsupportedDtype``, ``InvalidTensorName``) is a bug: the offending shards are written
to ``--crashes`` and the exit status is 1.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
import traceback
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.fuzz.mutations import REJECTIONS, check_decoders, mutate  # noqa: E402
from tests.fuzz.seeds import seed_shards  # noqa: E402


def _save(crashes: Path, shards: list[bytes], name: str, error: BaseException) -> None:
    crashes.mkdir(parents=True, exist_ok=True)
    stem = f"crash-{int(time.time() * 1000)}"
    for i, data in enumerate(shards):
        (crashes / f"{stem}.{i}.shard").write_bytes(data)
    report = "".join(traceback.format_exception(error))
    (crashes / f"{stem}.txt").write_text(f"{name}: {type(error).__name__}: {error}\n\n{report}")
    print(f"BUG in {name}: {type(error).__name__}: {error} (saved {stem})", file=sys.stderr)


def _note(found: list[tuple[str, BaseException]], name: str, error: BaseException) -> None:
    found.append((name, error))


def run_random(seconds: float, seed: int, crashes: Path) -> int:
    """Mutate from ``random`` until ``seconds`` pass; returns the number of bugs."""
    from patcher.decode import decode

    seeds = seed_shards()
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    runs, bugs = 0, 0
    outcomes: collections.Counter[str] = collections.Counter()
    while time.monotonic() < deadline:
        shards = mutate(rng, seeds)
        found: list[tuple[str, BaseException]] = []
        check_decoders(shards, partial(_note, found))
        for name, e in found:
            _save(crashes, shards, name, e)
        bugs += len(found)
        runs += 1
        try:  # how deep do mutations get? (a summary of where decode stops)
            decode(shards)
            outcomes["accepted"] += 1
        except REJECTIONS as e:
            outcomes[type(e).__name__ + ": " + str(e).split(":")[0][:40]] += 1
        except Exception:
            outcomes["BUG"] += 1
    print(f"{runs} mutated inputs in {seconds:.0f} s, {bugs} bugs")
    for what, n in outcomes.most_common(25):
        print(f"  {n:7d}  {what}")
    return bugs


def run_atheris(argv: list[str]) -> None:  # pragma: no cover - needs atheris
    import atheris  # type: ignore[import-untyped, unused-ignore]

    seeds = seed_shards()

    def one_input(data: bytes) -> None:
        rng = random.Random(data)  # libFuzzer's bytes steer every mutation choice
        shards = mutate(rng, seeds)

        def bug(name: str, error: BaseException) -> None:
            raise RuntimeError(f"{name} raised {type(error).__name__}: {error}") from error

        check_decoders(shards, bug)

    atheris.Setup(argv, one_input)
    atheris.Fuzz()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--crashes", type=Path, default=Path("fuzz-crashes"))
    parser.add_argument("--atheris", action="store_true", help="use atheris (libFuzzer) when installed")
    args, rest = parser.parse_known_args()
    if args.atheris:
        try:
            import atheris  # type: ignore[import-untyped, unused-ignore]  # noqa: F401
        except ImportError:
            print("atheris is not installed: falling back to the random mutation loop", file=sys.stderr)
        else:
            run_atheris([sys.argv[0], *rest])
            return 0
    print(f"seed {args.seed}")
    return 1 if run_random(args.seconds, args.seed, args.crashes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
