"""Torch modules laid out as the contract's tensors, for the targets over live tensors."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from numpy.typing import NDArray

from bulletin.engines.torch_module import torch_dtype
from bulletin_kernels.dispatch import as_bits
from patcher.patch import TensorSpec


def module_for(specs: Mapping[str, TensorSpec]) -> torch.nn.Module:
    """A module whose state dict is ``specs`` (zeros), nested by the names' dots, as an
    engine's model is: ``block.proj.weight`` is parameter ``weight`` of ``block.proj``."""
    root = torch.nn.Module()
    made: dict[str, torch.nn.Module] = {"": root}
    for name, spec in specs.items():
        *path, leaf = name.split(".")
        parent = root
        for depth in range(len(path)):
            key = ".".join(path[: depth + 1])
            if key not in made:
                made[key] = torch.nn.Module()
                parent.add_module(path[depth], made[key])
            parent = made[key]
        value = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype))
        parent.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
    return root


def tensor_bits(tensors: Mapping[str, torch.Tensor]) -> dict[str, NDArray[np.unsignedinteger]]:
    """A copy of the bits of each tensor."""
    return {name: np.array(as_bits(t.detach()), copy=True) for name, t in tensors.items()}


def module_bits(module: torch.nn.Module) -> dict[str, NDArray[np.unsignedinteger]]:
    """A copy of the bits of every state dict entry of ``module``."""
    return tensor_bits(module.state_dict())
