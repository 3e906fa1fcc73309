"""The cyclic collector is held off while a publish step runs (bulletin/collector.py),
and given back exactly as it was, from any number of threads."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulletin import Publisher
from bulletin.collector import collector_paused
from bulletin.publisher import PHASES
from tests.run.helpers import ToyTrainer


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.usefixtures("collector_on")
def test_nested_and_threaded_holds_give_the_collector_back_once_all_leave() -> None:
    entered, release = threading.Barrier(3), threading.Event()

    def hold() -> None:
        with collector_paused():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the threads still hold it
    release.set()
    for t in threads:
        t.join()
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


@pytest.mark.usefixtures("collector_on")
def test_a_patch_step_runs_with_the_collector_held_off(tmp_path: Path) -> None:
    seen: dict[tuple[int, str], bool] = {}
    trainer = ToyTrainer()
    with Publisher(tmp_path / "store", "r", keyframe_every=2, cache_dir=tmp_path / "cache") as pub:
        pub._hook = lambda phase, version: seen.setdefault((version, phase), gc.isenabled())
        for _ in range(3):  # a keyframe, a patch, a keyframe with its patch
            pub.publish(trainer.state)
            trainer.step()
        with pytest.raises(Exception, match="expected a torch tensor"):
            pub.publish({"w": "not a tensor"})  # refused: the collector as it was
    # The patch step (after the layout is agreed) holds it off; a keyframe step leaves it as it is.
    assert {phase for (version, phase), on in seen.items() if version == 2 and not on} == set(PHASES) - {"layout"}
    assert all(on for (version, _), on in seen.items() if version != 2)
    assert gc.isenabled()
