"""Planning reads the manifest chain down from the target, only as far as a route needs.

The route chosen is the one an exhaustive planner (every manifest from the held version
to the target read and compared) would choose; the manifests read are those down to the
held version, a layout change, or the point where the patches below the newest keyframe
outweigh it, a few at a time, each checked against its child's digest before parsing.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import Counter

import pytest

from bulletin import Publisher
from bulletin.errors import CorruptData, ObjectTooLarge
from bulletin.run import MANIFEST_SLACK, Run, StoredManifest
from bulletin.storage import ObjectData, Store, open_store
from bulletin.storage.wrapper import WrapperStore
from bulletin.sync import SyncPlan, plan
from bulletin.target import Held
from tests.run.helpers import ToyTrainer

RUN = "run"


class ManifestReads(WrapperStore):
    """Counts the manifests read, and the most read at once."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.reads: Counter[int] = Counter()
        self._lock = threading.Lock()

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        if "/manifests/" in key:
            with self._lock:
                self.reads[int(key.rsplit("/", 1)[1].split(".", 1)[0])] += 1
        return super().get(key, max_bytes=max_bytes)


def _exhaustive(run: Run, target: StoredManifest, held: Held | None) -> SyncPlan:
    """The planner before the bounded walk: every manifest of the span read, then chosen."""
    if held is not None and held.version == target.version:
        return SyncPlan(target, None, ())
    if held is not None and held.version < target.version:
        span = run.read_manifests(list(range(held.version, target.version)))
        if span[0].manifest.fingerprints == held.fingerprints:
            steps = [*span, target][1:]
            start = max((i for i, s in enumerate(steps) if s.manifest.patch is None), default=-1)
            patch_route = SyncPlan(target, steps[start] if start >= 0 else None, tuple(steps[start + 1 :]))
            keyframes = [i for i, s in enumerate(steps) if s.manifest.keyframe is not None and i > start]
            if keyframes:
                kf_route = SyncPlan(target, steps[keyframes[-1]], tuple(steps[keyframes[-1] + 1 :]))
                if kf_route.download_bytes < patch_route.download_bytes:
                    return kf_route
            return patch_route
    chain = [target]
    while chain[0].manifest.keyframe is None:
        chain.insert(0, run.read_manifest(chain[0].version - 1))
    return SyncPlan(target, chain[0], tuple(chain[1:]))


def _summary(route: SyncPlan) -> tuple[int | None, list[int]]:
    return (route.keyframe.version if route.keyframe else None, [p.version for p in route.patches])


@pytest.fixture(scope="module")
def url() -> str:
    """A run of 14 versions: keyframes every 5, a layout change (keyframe only) at 9,
    one tiny transition (a single changed element) at 12 and an empty one at 13."""
    url = f"memory://{uuid.uuid4().hex}"
    small = {"w": (64, 64), "b": (64,)}
    large = {"w": (64, 64), "b": (64,), "e": (32, 16)}
    trainer = ToyTrainer(seed=9, shapes=small)
    with Publisher(url, RUN, keyframe_every=5) as pub:
        for version in range(1, 15):
            if version == 9:
                state = trainer.state
                trainer = ToyTrainer(seed=10, shapes=large)
                trainer.state.update({k: v for k, v in state.items() if k in small})
            elif version == 12:
                trainer.state["b"][0] += 1.0
            elif version > 1 and version != 13:
                trainer.step(lr=1e-2)
            pub.publish(trainer.state)
    return url


def test_routes_are_those_an_exhaustive_planner_chooses(url: str) -> None:
    run = Run(open_store(url), RUN)
    manifests = {v: run.read_manifest(v) for v in range(1, 15)}
    for start, end in itertools.combinations_with_replacement(range(1, 15), 2):
        for held in (
            Held(start, dict(manifests[start].manifest.fingerprints)),
            Held(start, {name: fp ^ 1 for name, fp in manifests[start].manifest.fingerprints.items()}),
        ):
            expected = _exhaustive(run, manifests[end], held)
            assert _summary(plan(run, manifests[end], held)) == _summary(expected), (start, end, held)
    for end in range(1, 15):
        expected = _exhaustive(run, manifests[end], None)
        assert _summary(plan(run, manifests[end], None)) == _summary(expected)


def _parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The versions whose manifests get parsed from now on."""
    parsed: list[int] = []
    real = Run._stored

    def counting(self: Run, version: int, key: str, data: bytes, digest: str | None = None) -> StoredManifest:
        parsed.append(version)
        return real(self, version, key, data, digest)

    monkeypatch.setattr(Run, "_stored", counting)
    return parsed


def test_a_long_catch_up_parses_only_what_its_route_needs(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = ManifestReads(open_store(url))
    run = Run(counting, RUN)
    target, held = run.read_manifest(8), run.read_manifest(1)
    counting.reads.clear()
    parsed = _parsed(monkeypatch)
    route = plan(run, target, Held(1, dict(held.manifest.fingerprints)))
    # The keyframe of 6 outweighs the patches of 6 and 5: nothing below 5 can change that.
    assert _summary(route) == (6, [7, 8])
    assert parsed == [7, 6, 5]
    assert max(counting.reads.values()) == 1  # read ahead, never twice


def test_the_walk_stops_at_a_layout_change(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(open_store(url), RUN)
    target, held = run.read_manifest(10), run.read_manifest(2)
    parsed = _parsed(monkeypatch)
    assert _summary(plan(run, target, Held(2, dict(held.manifest.fingerprints)))) == (9, [10])
    assert parsed == [9]
    assert [s.version for s in run.ancestors(target)] == [9]  # nothing below the change


def test_a_forged_parent_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    trainer = ToyTrainer(seed=2)
    with Publisher(url, RUN, keyframe_every=100) as pub:
        for i in range(4):
            if i:
                trainer.step()
            pub.publish(trainer.state)
    store = open_store(url)
    run = Run(store, RUN)
    target = run.read_manifest(4)
    key = f"{RUN}/manifests/{3:020d}.json"
    forged = store.get(key).data.replace(b'"writer":"', b'"writer":"0')
    store.delete(key)
    store.put_if_absent(key, forged)
    parsed = _parsed(monkeypatch)
    with pytest.raises(CorruptData, match="does not chain to version 3"):
        plan(run, target, Held(1, dict(Run(store, RUN).read_manifest(1).manifest.fingerprints)))
    assert 3 not in parsed
    # A parent far larger than its child could be is refused from its size alone.
    store.delete(key)
    store.put_if_absent(key, b" " * (2 * target.size + MANIFEST_SLACK + 1))
    with pytest.raises(ObjectTooLarge, match="version 3"):
        next(run.ancestors(target))
    assert 3 not in parsed
