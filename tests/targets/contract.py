"""The contract every WeightTarget passes: inherit :class:`TargetContract`, give ``target``.

Modelled on zarr's ``StoreTests`` (and ``tests/storage/contract.py`` here): one suite,
every implementation. A subclass provides a ``target`` fixture (a fresh target that has
activated nothing, laid out as :data:`SPECS` where its layout is fixed) and
:meth:`~TargetContract.held_bits`; durable targets also :meth:`~TargetContract.reopen`.

Every version is small (a few hundred elements) and every patch is made by the real
codec (``patcher.diff``; ``patcher.encode`` for shards), so each test takes
milliseconds, engine round trips included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin.checkpoint import write_checkpoint
from bulletin.errors import IncompatibleTensors, InvalidInput, VerificationFailed, WrongBase
from bulletin.publisher import Publisher
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.subscriber import Subscriber
from bulletin.target import Held, WeightTarget
from patcher.diff import diff
from patcher.encode import encode
from patcher.patch import Patch, TensorSpec
from tests.patcher.helpers import fingerprints, mutate, random_bits

Bits = NDArray[np.unsignedinteger]

SPECS: dict[str, TensorSpec] = {
    spec.name: spec
    for spec in (
        TensorSpec("embed.weight", "BF16", (24, 16)),
        TensorSpec("block.proj.weight", "BF16", (16, 16)),
        TensorSpec("block.norm.weight", "BF16", (16,)),
        TensorSpec("head.bias", "F32", (8,)),
    )
}
#: A tensor that no version changes (norm weights almost never do): an empty delta.
UNCHANGED = "block.norm.weight"
#: Versions 1..4 of one run (each a few percent of elements changed from the last) and
#: OTHER, bits no patch of the run was made for.
OTHER = 0


def _versions() -> dict[int, dict[str, Bits]]:
    rng = np.random.default_rng(20261201)
    out = {1: {name: random_bits(rng, spec.dtype, spec.shape) for name, spec in SPECS.items()}}
    for version in (2, 3, 4):
        last = out[version - 1]
        out[version] = {
            name: last[name].copy() if name == UNCHANGED else mutate(rng, last[name], 0.05, spec.dtype)
            for name, spec in SPECS.items()
        }
    out[OTHER] = {name: random_bits(rng, spec.dtype, spec.shape) for name, spec in SPECS.items()}
    return out


V = _versions()
FPS = {version: fingerprints(bits) for version, bits in V.items()}


def patch(a: int, b: int) -> Patch:
    """The patch from version ``a`` to version ``b``, by the real codec."""
    return diff(SPECS, V[a], V[b])


def off_target(good: Patch) -> Patch:
    """``good`` with one changed tensor's target fingerprint wrong: it lands elsewhere."""
    name = next(td.spec.name for td in good if td.changed)
    td = good.tensors[name]
    return Patch({**good.tensors, name: dataclasses.replace(td, target_fingerprint=td.target_fingerprint ^ 1)})


def assert_bits(got: Mapping[str, NDArray[Any]], want: Mapping[str, Bits]) -> None:
    assert got.keys() == want.keys()
    for name, bits in want.items():
        held = np.asarray(got[name])
        assert held.dtype == bits.dtype, name
        assert np.array_equal(held.reshape(-1), bits.reshape(-1)), f"{name} differs"


class TargetContract:
    """Behaviour every :class:`~bulletin.target.WeightTarget` implementation must show."""

    #: ``restored()`` reports the version last activated, also from a reopened target
    #: (a folder, an engine backed by one); volatile targets report None.
    durable: ClassVar[bool] = False
    #: The layout is the engine's own, fixed before anything is loaded (live tensors).
    layout_up_front: ClassVar[bool] = False
    #: ``abort`` after ``load_full`` puts the previous bits back (False where a load
    #: overwrites live memory that has no second copy).
    restores_aborted_loads: ClassVar[bool] = True

    @pytest.fixture
    def target(self) -> Iterator[WeightTarget]:
        raise NotImplementedError("subclasses provide a fresh target")

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        """The bits the target's holder has now (the engine's memory, the files)."""
        raise NotImplementedError

    def active_version(self, target: WeightTarget) -> int | None:
        """The version the target reports as active (the one activated last)."""
        held = target.restored()
        return held.version if held else None

    def reopen(self, target: WeightTarget) -> WeightTarget:
        """Durable targets: close ``target`` and open the same place again (a restart)."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------

    def at(self, target: WeightTarget, version: int) -> None:
        """Bring a fresh target to ``version``: keyframe 1, then one patch per version."""
        target.load_full(V[1], SPECS)
        target.activate(1)
        for v in range(2, version + 1):
            assert target.apply(patch(v - 1, v), FPS[v - 1]) == FPS[v]
            target.activate(v)

    def assert_holds(self, target: WeightTarget, version: int) -> None:
        """Settled on ``version``: bits, fingerprints and what is reported."""
        assert target.full_fingerprints() == FPS[version]
        assert_bits(self.held_bits(target), V[version])
        assert self.active_version(target) == version
        assert dict(target.layout() or {}) == SPECS
        if self.durable:
            assert target.restored() == Held(version, FPS[version])

    def assert_reports_no_new_version(self, target: WeightTarget, version: int | None) -> None:
        """Between a change and its activation: still ``version``, never the new one."""
        assert self.active_version(target) == version
        held = target.restored()
        assert held is None or (self.durable and version is not None and held == Held(version, FPS[version]))

    # -- what it is -----------------------------------------------------------------------

    def test_is_a_weight_target(self, target: WeightTarget) -> None:
        assert isinstance(target, WeightTarget)
        assert isinstance(target.in_place, bool)
        assert isinstance(target.supports_shards, bool)

    def test_holds_nothing_at_first(self, target: WeightTarget) -> None:
        assert target.restored() is None
        assert self.active_version(target) is None
        if self.layout_up_front:
            assert dict(target.layout() or {}) == SPECS
        else:
            assert target.layout() is None

    # -- activation -----------------------------------------------------------------------

    def test_a_load_is_reported_only_once_activated(self, target: WeightTarget) -> None:
        target.load_full(V[1], SPECS)
        assert target.full_fingerprints() == FPS[1]
        self.assert_reports_no_new_version(target, None)
        target.activate(1)
        self.assert_holds(target, 1)

    def test_an_apply_is_reported_only_once_activated(self, target: WeightTarget) -> None:
        self.at(target, 1)
        assert target.apply(patch(1, 2), FPS[1]) == FPS[2]
        assert target.full_fingerprints() == FPS[2]
        self.assert_reports_no_new_version(target, 1)
        target.activate(2)
        self.assert_holds(target, 2)

    def test_what_is_served_changes_during_apply_only_in_place(self, target: WeightTarget) -> None:
        self.at(target, 1)
        target.apply(patch(1, 2), FPS[1])
        if not target.in_place:
            assert_bits(self.held_bits(target), V[1])
        target.activate(2)
        assert_bits(self.held_bits(target), V[2])

    # -- load_full ------------------------------------------------------------------------

    def test_load_full_replaces_everything(self, target: WeightTarget) -> None:
        self.at(target, 2)
        target.load_full(V[OTHER], SPECS)
        target.activate(7)
        assert target.full_fingerprints() == FPS[OTHER]
        assert_bits(self.held_bits(target), V[OTHER])
        assert self.active_version(target) == 7
        if self.durable:
            assert target.restored() == Held(7, FPS[OTHER])

    @pytest.mark.parametrize("fault", ["missing tensor", "wrong dtype", "wrong size"])
    def test_load_full_checks_its_input_before_changing_anything(self, target: WeightTarget, fault: str) -> None:
        self.at(target, 1)
        tensors = dict(V[2])
        if fault == "missing tensor":
            del tensors["head.bias"]
        elif fault == "wrong dtype":
            tensors["head.bias"] = tensors["head.bias"].view(np.uint16)
        else:
            tensors["embed.weight"] = tensors["embed.weight"][:-1]
        with pytest.raises(IncompatibleTensors):
            target.load_full(tensors, SPECS)
        self.assert_holds(target, 1)

    # -- base checks and verification -----------------------------------------------------

    def test_an_apply_before_anything_is_held_is_refused(self, target: WeightTarget) -> None:
        if self.layout_up_front:
            # Live tensors always hold something; a patch meets their bits' fingerprints.
            with pytest.raises(WrongBase):
                target.apply(patch(1, 2), FPS[1])
            assert self.active_version(target) is None
            return
        with pytest.raises(InvalidInput):
            target.apply(patch(1, 2), FPS[1])
        assert target.layout() is None and target.restored() is None

    @pytest.mark.parametrize("wrong", ["patch made for other bits", "fingerprints of other bits"])
    def test_a_wrong_base_is_refused_before_any_write(self, target: WeightTarget, wrong: str) -> None:
        self.at(target, 1)
        with pytest.raises(WrongBase) as caught:
            if wrong == "patch made for other bits":
                target.apply(patch(OTHER, 2), FPS[1])
            else:
                target.apply(patch(1, 2), FPS[OTHER])
        assert not isinstance(caught.value, VerificationFailed)  # refused up front
        target.abort()  # what a Subscriber does after any failure
        self.assert_holds(target, 1)
        assert target.apply(patch(1, 2), FPS[1]) == FPS[2]  # and the target still works
        target.activate(2)
        self.assert_holds(target, 2)

    def test_a_patch_missing_its_targets_changes_nothing(self, target: WeightTarget) -> None:
        self.at(target, 1)
        with pytest.raises(VerificationFailed):
            target.apply(off_target(patch(1, 2)), FPS[1])
        target.abort()
        self.assert_holds(target, 1)
        assert target.apply(patch(1, 2), FPS[1]) == FPS[2]
        target.activate(2)
        self.assert_holds(target, 2)

    def test_a_patch_of_another_layout_is_refused(self, target: WeightTarget) -> None:
        self.at(target, 1)
        good = patch(1, 2)
        partial = Patch({name: td for name, td in good.tensors.items() if name != UNCHANGED})
        with pytest.raises(IncompatibleTensors):
            target.apply(partial, FPS[1])
        self.assert_holds(target, 1)

    # -- restore on failure ---------------------------------------------------------------

    def test_abort_after_an_apply_restores_the_activated_version(self, target: WeightTarget) -> None:
        self.at(target, 2)
        assert target.apply(patch(2, 3), FPS[2]) == FPS[3]
        target.abort()
        self.assert_holds(target, 2)
        assert target.apply(patch(2, 3), FPS[2]) == FPS[3]
        target.activate(3)
        self.assert_holds(target, 3)

    def test_abort_after_a_load_keeps_the_activated_version(self, target: WeightTarget) -> None:
        self.at(target, 1)
        target.load_full(V[OTHER], SPECS)
        target.abort()
        assert self.active_version(target) == 1
        assert target.restores_loads is self.restores_aborted_loads  # the flag sync relies on
        if self.restores_aborted_loads:
            self.assert_holds(target, 1)

    def test_abort_with_nothing_to_undo_changes_nothing(self, target: WeightTarget) -> None:
        target.abort()
        assert target.restored() is None and self.active_version(target) is None
        self.at(target, 2)
        target.abort()
        target.abort()
        self.assert_holds(target, 2)

    def test_prepare_only_reads(self, target: WeightTarget) -> None:
        self.at(target, 1)
        good = patch(1, 2)
        target.prepare(good, FPS[1])
        self.assert_holds(target, 1)
        assert target.apply(good, FPS[1]) == FPS[2]
        target.activate(2)
        self.assert_holds(target, 2)
        bad = patch(OTHER, 3)
        with pytest.raises(WrongBase):  # refused by prepare where it checks, else by apply
            target.prepare(bad, FPS[2])
            target.apply(bad, FPS[2])
        target.abort()
        self.assert_holds(target, 2)

    # -- capabilities ---------------------------------------------------------------------

    def test_shards_are_applied_exactly_when_supported(self, target: WeightTarget) -> None:
        self.at(target, 1)
        shards = encode(patch(1, 2), max_shard_bytes=1024)
        assert len(shards) > 1  # several shards, as a run's patches have
        if not target.supports_shards:
            with pytest.raises(InvalidInput, match="supports_shards"):
                target.apply_shards(shards, FPS[1])
            self.assert_holds(target, 1)
            return
        with pytest.raises(WrongBase):
            target.apply_shards(encode(patch(OTHER, 2)), FPS[1])
        self.assert_holds(target, 1)
        with pytest.raises(VerificationFailed):
            target.apply_shards(encode(off_target(patch(1, 2))), FPS[1])
        self.assert_holds(target, 1)
        assert target.apply_shards(shards, FPS[1]) == FPS[2]
        target.abort()
        self.assert_holds(target, 1)
        assert target.apply_shards(shards, FPS[1]) == FPS[2]
        target.activate(2)
        self.assert_holds(target, 2)

    # -- lifetime -------------------------------------------------------------------------

    def test_close_is_idempotent(self, target: WeightTarget) -> None:
        target.close()
        target.close()

    def test_close_after_use_is_idempotent(self, target: WeightTarget) -> None:
        self.at(target, 2)
        target.close()
        target.close()

    def test_a_restart_resumes_exactly_the_activated_version(self, target: WeightTarget) -> None:
        self.at(target, 2)
        if not self.durable:
            assert target.restored() is None  # volatile: nothing survives this process
            return
        again = self.reopen(target)
        try:
            self.assert_holds(again, 2)
            assert again.apply(patch(2, 3), FPS[2]) == FPS[3]
            again.activate(3)
            self.assert_holds(again, 3)
        finally:
            again.close()

    def test_a_restart_forgets_what_was_not_activated(self, target: WeightTarget) -> None:
        self.at(target, 1)
        target.apply(patch(1, 2), FPS[1])
        if not self.durable:
            assert target.restored() is None
            return
        again = self.reopen(target)
        try:
            held = again.restored()
            assert held is None or held == Held(1, FPS[1])  # None: "I cannot vouch", a keyframe follows
        finally:
            again.close()

    # -- through a Subscriber -------------------------------------------------------------

    def test_a_subscriber_follows_a_run_onto_it(self, target: WeightTarget, tmp_path: Path) -> None:
        store = str(tmp_path / "store")
        with Publisher(store, "r", keyframe_every=10) as pub:
            for version in (1, 2, 3, 4):
                write_checkpoint(tmp_path / f"v{version}", SPECS, V[version])
                assert pub.publish_checkpoint(tmp_path / f"v{version}").version == version
        sub = Subscriber(store, "r", target=target)
        assert sub.sync(1) == 1
        self.assert_holds(target, 1)
        assert sub.sync(2) == 2  # one behind: straight from the shards where supported
        self.assert_holds(target, 2)
        assert sub.sync(4) == 4  # two behind: folded, one apply
        report = sub.stats.last_report
        assert report is not None and report.transitions == 2 and report.keyframe is None
        self.assert_holds(target, 4)
        digest = Run(open_store(store), "r").read_manifest(4).digest
        assert sub.held is not None and sub.held.manifest_digest == digest  # what the chain is checked by
        if self.durable:
            restored = target.restored()
            assert restored is not None and restored.manifest_digest == digest
            again = self.reopen(target)
            try:
                assert Subscriber(store, "r", target=again).current_version == 4
                resumed = again.restored()
                assert resumed is not None and resumed.manifest_digest == digest  # across a restart too
            finally:
                again.close()
