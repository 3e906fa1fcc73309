"""apply: checks before touching, verifies after, and undoes everything on a mismatch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bulletin.errors import IncompatibleTensors, InvalidInput, VerificationFailed, WrongBase
from patcher.apply import apply
from patcher.diff import diff
from patcher.patch import Patch, TensorDelta, TensorSpec
from tests.patcher.helpers import fingerprints, mutate, random_bits

NAMES = ["a.weight", "b.bias", "c.weight", "d.scale"]


def _model(seed: int = 0) -> tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    shapes = {"a.weight": (30, 40), "b.bias": (40,), "c.weight": (1000,), "d.scale": ()}
    dtypes = {"a.weight": "BF16", "b.bias": "F32", "c.weight": "U8", "d.scale": "F64"}
    specs = {n: TensorSpec(n, dtypes[n], shapes[n]) for n in NAMES}
    old = {n: random_bits(rng, dtypes[n], shapes[n]) for n in NAMES}
    new = {n: mutate(rng, old[n], 0.2, dtypes[n]) for n in NAMES}
    return specs, old, new


def _snapshot(tensors: dict[str, Any]) -> dict[str, bytes]:
    return {n: t.tobytes() for n, t in tensors.items()}


def test_apply_returns_the_target_fingerprints() -> None:
    specs, old, new = _model()
    patch = diff(specs, old, new)
    held = {n: t.copy() for n, t in old.items()}
    fps = apply(patch, held, fingerprints(old))
    assert fps == fingerprints(new) == {n: td.target_fingerprint for n, td in patch.tensors.items()}
    assert _snapshot(held) == _snapshot(new)


def test_wrong_base_is_detected_before_any_byte_changes() -> None:
    specs, old, new = _model()
    patch = diff(specs, old, new)
    held = {n: t.copy() for n, t in old.items()}
    before = _snapshot(held)
    fps = fingerprints(old)
    fps["d.scale"] ^= 1  # the last tensor applied would be the one found wrong
    with pytest.raises(WrongBase) as info:
        apply(patch, held, fps)
    assert not isinstance(info.value, VerificationFailed)
    assert "d.scale" in str(info.value)
    assert _snapshot(held) == before
    # A missing fingerprint is a wrong base too.
    del fps["d.scale"]
    with pytest.raises(WrongBase):
        apply(patch, held, fps)
    assert _snapshot(held) == before


def test_lying_holder_gets_verification_failed_and_everything_restored() -> None:
    specs, old, new = _model(1)
    patch = diff(specs, old, new)
    held = {n: t.copy() for n, t in old.items()}
    # The holder claims the base fingerprints, but one element the patch overwrites in
    # the third tensor applied holds other bits: only the result can tell.
    victim = "c.weight"
    idx = patch.tensors[victim].indices
    held[victim].reshape(-1)[idx[len(idx) // 2]] ^= 0x10
    before = _snapshot(held)
    with pytest.raises(VerificationFailed) as info:
        apply(patch, held, fingerprints(old))
    assert victim in str(info.value)
    assert _snapshot(held) == before  # a.weight and b.bias, already applied, are back too


def test_layout_and_array_checks_come_first() -> None:
    specs, old, new = _model()
    patch = diff(specs, old, new)
    fps = fingerprints(old)

    def attempt(held: dict[str, Any], error: type[Exception]) -> None:
        before = {n: t.tobytes() for n, t in held.items() if isinstance(t, np.ndarray)}
        with pytest.raises(error):
            apply(patch, held, fps)
        assert {n: t.tobytes() for n, t in held.items() if isinstance(t, np.ndarray)} == before

    base = {n: t.copy() for n, t in old.items()}
    attempt({n: t for n, t in base.items() if n != "b.bias"}, IncompatibleTensors)
    attempt({**base, "extra": np.zeros(3, np.uint8)}, IncompatibleTensors)
    attempt({**base, "c.weight": np.zeros(999, np.uint8)}, IncompatibleTensors)
    attempt({**base, "a.weight": base["a.weight"].reshape(40, 30)}, IncompatibleTensors)
    attempt({**base, "b.bias": base["b.bias"].view(np.uint16)}, IncompatibleTensors)
    read_only = base["c.weight"].copy()
    read_only.flags.writeable = False
    attempt({**base, "c.weight": read_only}, InvalidInput)
    attempt({**base, "b.bias": np.zeros(80, np.uint32)[::2]}, InvalidInput)
    attempt({**base, "b.bias": [0] * 40}, InvalidInput)


def test_malformed_patch_is_refused_before_anything_changes() -> None:
    specs, old, new = _model()
    patch = diff(specs, old, new)
    td = patch.tensors["c.weight"]
    bad = TensorDelta(td.spec, td.indices[::-1].copy(), td.delta, td.base_fingerprint, td.target_fingerprint)
    held = {n: t.copy() for n, t in old.items()}
    before = _snapshot(held)
    with pytest.raises(InvalidInput):
        apply(Patch({**patch.tensors, "c.weight": bad}), held, fingerprints(old))
    assert _snapshot(held) == before


def test_apply_of_an_empty_patch_changes_nothing() -> None:
    spec = TensorSpec("e", "F16", (0,))
    td = TensorDelta(spec, np.empty(0, np.int64), np.empty(0, np.uint16), 5, 5)
    held = {"e": np.empty(0, np.uint16)}
    assert apply(Patch({"e": td}), held, {"e": 5}) == {"e": 5}
