"""Run by tests/run/test_publish_async.py in a fresh process: what queued ``publish_async``
versions hold in anonymous memory beyond the caller's tensors.

    python -m tests.run.queued_memory STORE_DIR CACHE_DIR MEGABYTES QUEUED

Publishes a keyframe of torch BF16 tensors (about ``MEGABYTES``), then holds the commit
of the next version (its manifest PUT waits) and queues ``QUEUED`` more behind it, each
after an Adam-like step (0.4% of the elements move one BF16 step). Prints one JSON line:
the model's bytes, ``RssAnon`` growth once every call returned (versions in flight and
queued), the peak while they ran, each call's return time, and each version's served
fingerprints as the caller computed them before the call (to check against the
manifests).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bulletin import Publisher
from bulletin.errors import StorageUnavailable
from bulletin.storage import Store, WriteResult, open_store
from patcher.fingerprint import fingerprint
from tests.run.test_ambiguous_commit import LostCommitResponse
from tests.run.test_publisher_base import _peak_anon as peak_anon

#: How long a held PUT waits for its release before the test calls it stuck.
HOLD_TIMEOUT_S = 120.0


class HeldUploads(LostCommitResponse):
    """Holds the first create-only PUT whose key contains the part given to :meth:`hold`
    until :meth:`release` (``entered`` is set once it waits), so that the versions
    published after it queue behind it; released with ``fail``, it raises
    ``StorageUnavailable`` instead of writing (what a dropped upload does)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.entered = threading.Event()
        self._released = threading.Event()
        self._part: str | None = None
        self._fail = False

    def hold(self, part: str) -> None:
        self.entered.clear()
        self._released.clear()
        self._part, self._fail = part, False

    def release(self, *, fail: bool = False) -> None:
        self._fail = fail
        self._released.set()

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        part = self._part
        if part is not None and part in key:
            self._part = None
            self.entered.set()
            if not self._released.wait(HOLD_TIMEOUT_S):
                raise StorageUnavailable(f"{key}: held for {HOLD_TIMEOUT_S:g} s and never released (test stuck)")
            if self._fail:
                raise StorageUnavailable(f"{key}: service unavailable (injected)")
        return super().put_if_absent(key, data)


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def step(state: dict[str, torch.Tensor], rng: np.random.Generator) -> None:
    """0.4% of each tensor's elements one BF16 step up, in place (indices drawn with
    replacement: no full-size temporaries)."""
    for tensor in state.values():
        flat = tensor.view(-1).view(torch.int16)
        where = torch.from_numpy(rng.integers(0, flat.numel(), size=flat.numel() // 250))
        flat[where] += 1


def served_fingerprints(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: fingerprint(tensor.view(torch.int16).numpy().view(np.uint16)) for name, tensor in state.items()}


def main(store_dir: str, cache_dir: str, megabytes: float, queued: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    rows, cols = 2048, 2048  # 8 MiB of BF16 per tensor
    count = max(1, round(megabytes * 2**20 / (rows * cols * 2)))
    state = {
        f"layers.{i}.weight": torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).to(
            torch.bfloat16
        )
        for i in range(count)
    }
    model = sum(t.numel() * 2 for t in state.values())
    store = HeldUploads(open_store(store_dir))
    expected: dict[int, dict[str, int]] = {}
    returns: list[float] = []
    with Publisher(store, "run", keyframe_every=1000, queue_size=queued, cache_dir=cache_dir) as pub:
        expected[pub.publish(state)] = served_fingerprints(state)
        store.hold("/manifests/")
        futures = []
        held = 0

        def queue_all() -> None:
            nonlocal held
            before = rss_anon()
            for i in range(queued + 1):  # one in flight (its commit held), the rest queued
                step(state, rng)
                fps = served_fingerprints(state)
                t0 = time.perf_counter()
                futures.append((pub.publish_async(state), fps))
                returns.append(time.perf_counter() - t0)
                if i == 0 and not store.entered.wait(HOLD_TIMEOUT_S):
                    raise RuntimeError("the first queued version never reached its commit")
            held = rss_anon() - before

        try:
            peak = peak_anon(queue_all)
        finally:
            store.release()
        pub.flush()
        for future, fps in futures:
            expected[future.result().version] = fps
    return {
        "model_bytes": model,
        "held": held,
        "peak": peak,
        "returns": returns,
        "expected": {str(v): {n: format(fp, "016x") for n, fp in fps.items()} for v, fps in expected.items()},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))))
