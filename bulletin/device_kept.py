"""The trainer's GPU path: served bits kept on the GPU, diffed there in one pass.

For a CUDA torch tensor (or a CuPy array) the publisher's base
(:class:`~bulletin.base.PublishedBase`, the one owner of what the next diff is against)
keeps the served bits of the last snapshot on the same device (two bytes per BF16
parameter) and calls the fused ``diff_cast`` kernel: cast to the served dtype as torch
rounds, compare, compact the changed indices and their deltas, update the kept bits.
Only the O(changed) result crosses to the host; the full tensor does so only for
keyframes.

**When the caller may touch its tensors again.** ``diff`` and ``keep`` return only once
the device has finished reading the tensor: the change (or the host copy) is copied to
the host, which waits for the kernels that produced it, and so for the read of the
tensor before them. A caller's later in-place update (an optimizer step on any stream,
a host write) cannot reach the bits being published. (Returning once the kernels are
merely queued would be safe only for writes queued on the same stream afterwards.)
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bulletin_kernels.dispatch import as_bits, backend_for, dtype_name
from patcher.dtypes import FLOAT_DTYPES
from patcher.patch import Change, HostChange, TensorSpec

__all__ = ["DeviceKept", "on_gpu"]


def on_gpu(value: object) -> bool:
    """True for CUDA torch tensors and CuPy arrays, when CuPy can be imported."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cuda":
            return False
    elif not type(value).__module__.startswith("cupy"):
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


class DeviceKept:
    """Served bits of GPU tensors, kept where the tensors live."""

    def __init__(self, served_dtype: str) -> None:
        self.served_dtype = served_dtype
        self._kept: dict[str, tuple[TensorSpec, Any]] = {}

    def spec(self, name: str, value: Any) -> tuple[TensorSpec, str]:
        """The served spec of ``value`` and the dtype its bits are read as."""
        source = dtype_name(value)
        served = self.served_dtype if source in FLOAT_DTYPES else source
        return TensorSpec(name, served, tuple(int(d) for d in value.shape)), source

    def _current(self, value: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            value = value.detach().contiguous()
        return as_bits(value)

    def diff(self, name: str, value: Any) -> HostChange | None:
        """Diff against the kept bits and update them; the change found, copied to the
        host, or None when nothing is kept for it."""
        spec, source = self.spec(name, value)
        kept = self._kept.get(name)
        if kept is None or kept[0] != spec:
            return None
        current = self._current(value)
        backend = backend_for(current)
        result = backend.diff_cast(current, kept[1], current_dtype=source, served_dtype=spec.dtype)
        cupy = sys.modules["cupy"]
        return Change(
            indices=cupy.asnumpy(result.indices).astype(np.int64, copy=False),
            delta=cupy.asnumpy(result.delta),
            fingerprint_delta=result.fingerprint_delta,
        )

    def keep(self, name: str, value: Any) -> tuple[NDArray[np.unsignedinteger], int]:
        """(Re)start keeping ``value``'s served bits on its device; returns a host copy
        and their fingerprint (computed on the device)."""
        spec, source = self.spec(name, value)
        current = self._current(value)
        backend = backend_for(current)
        served = backend.cast(current, source, spec.dtype)
        self._kept[name] = (spec, served)
        fp = backend.fingerprint(served)
        host: NDArray[np.unsignedinteger] = sys.modules["cupy"].asnumpy(served)
        return host.reshape(spec.shape), fp

    def drop(self, name: str) -> None:
        self._kept.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._kept
