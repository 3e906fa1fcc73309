"""Small realistic trainers for the run tests: FP32 masters, Adam-like steps."""

from __future__ import annotations

import os

import numpy as np
from numpy.typing import NDArray

from bulletin import Publisher
from patcher.cast import cast_bits

SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (64, 32),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.mlp.up_proj.weight": (48, 32),
    "model.layers.0.mlp.up_proj.bias": (48,),
    "model.norm.weight": (32,),
    "model.step": (),
}


class ToyTrainer:
    """A state dict of FP32 masters that takes Adam-like steps (~lr per element)."""

    def __init__(self, seed: int = 0, shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.state: dict[str, NDArray[np.float32]] = {
            name: np.array(self.rng.standard_normal(shape) * 0.02, dtype=np.float32)
            for name, shape in (shapes or SHAPES).items()
        }

    def step(self, lr: float = 3e-4) -> None:
        for name, w in self.state.items():
            if name.endswith("norm.weight"):
                continue
            np.add(w, (lr * self.rng.standard_normal(w.shape)).astype(np.float32), out=w)

    def served(self) -> dict[str, NDArray[np.unsignedinteger]]:
        """The BF16 bits a node must hold for the current state."""
        return {n: cast_bits(np.ascontiguousarray(w).view(np.uint32), "F32", "BF16") for n, w in self.state.items()}


def assert_bits_equal(
    held: dict[str, NDArray[np.unsignedinteger]], expected: dict[str, NDArray[np.unsignedinteger]]
) -> None:
    assert held.keys() == expected.keys()
    for name, bits in expected.items():
        got = np.asarray(held[name]).reshape(bits.shape)
        assert got.dtype == bits.dtype, name
        assert np.array_equal(got, bits), f"{name} differs"


def publish_versions(
    store: str | os.PathLike[str], run: str, versions: int, *, seed: int, keyframe_every: int
) -> list[dict[str, NDArray[np.unsignedinteger]]]:
    """Publish ``versions`` steps of a fresh :class:`ToyTrainer`; the bits each one serves."""
    trainer = ToyTrainer(seed=seed)
    served = []
    with Publisher(store, run, keyframe_every=keyframe_every) as pub:
        for i in range(versions):
            if i:
                trainer.step()
            pub.publish(trainer.state)
            served.append(trainer.served())
    return served
