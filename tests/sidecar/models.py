"""Small helpers shared by the engine tests."""

from __future__ import annotations

from typing import TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def cast(model: M, dtype: torch.dtype = torch.bfloat16) -> M:
    """``model.to(dtype).eval()`` in place, typed (transformers' own stubs confuse mypy)."""
    torch.nn.Module.to(model, dtype)
    torch.nn.Module.eval(model)
    return model
