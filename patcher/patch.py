"""The in-memory form of a patch: what encode consumes and decode produces.

A patch turns one version's tensors into the next one's. Both versions MUST have the
same tensors (names, dtypes, shapes); a layout change is published as a keyframe.
For each tensor a patch holds the sorted flat indices of the elements whose bits
changed and, for each, ``delta = (new - old) mod 2**(8 * width)`` of the bits read
as unsigned integers. Deltas compose by addition, so k consecutive patches fold into
one without their bases, and an element whose net change is zero drops out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod
from typing import Generic, NamedTuple, TypeVar

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.dtypes import bits_dtype, dtype_width
from patcher.errors import IncompatibleTensors, InvalidInput
from patcher.names import check_tensor_name

__all__ = ["Change", "HostChange", "Patch", "TensorDelta", "TensorSpec", "check_layout", "check_names"]

_INT64_MAX = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
#: What native check_changes' codes mean, in the words of the NumPy checks.
_PROBLEMS = {
    1: "index out of range [0, {n})",
    2: "indices must be strictly increasing",
    3: "a zero delta is not a change",
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, safetensors dtype and shape of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_tensor_name(self.name)
        dtype_width(self.dtype)
        if not isinstance(self.shape, tuple) or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape
        ):
            raise InvalidInput(f"{self.name}: shape must be a tuple of non-negative ints")

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def width(self) -> int:
        return dtype_width(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.width

    @property
    def bits_dtype(self) -> np.dtype[np.unsignedinteger]:
        return bits_dtype(self.dtype)


#: The array types of a :class:`Change` (NumPy on the host, CuPy on a GPU).
_IndexT_co = TypeVar("_IndexT_co", covariant=True)
_DeltaT_co = TypeVar("_DeltaT_co", covariant=True)


class Change(NamedTuple, Generic[_IndexT_co, _DeltaT_co]):
    """What a diff found in one tensor's bits: the change alone, relative to its base.

    The result of the GPU path's fused diff (``kernels`` ``diff_cast``, CuPy arrays on
    the device, or NumPy arrays from its twin) and of the trainer's device-kept bits once
    copied to the host (:data:`HostChange`). It knows neither the tensor's spec nor its
    base fingerprint; :meth:`TensorDelta.from_change` adds both.
    """

    #: Flat indices of the elements whose bits changed, strictly increasing (int64).
    indices: _IndexT_co
    #: ``(new - old) mod 2**bits`` at those indices, in the tensor's bits dtype.
    delta: _DeltaT_co
    #: ``fingerprint(new) - fingerprint(old)`` mod 2**64, an int in [0, 2**64).
    fingerprint_delta: int


#: A :class:`Change` held in host memory.
HostChange = Change[NDArray[np.int64], NDArray[np.unsignedinteger]]


@dataclass(frozen=True, slots=True, eq=False)
class TensorDelta:
    """The change of one tensor: sorted unique indices and wrapping bit deltas.

    ``indices`` is int64, strictly increasing, within ``[0, spec.numel)``; ``delta``
    has the spec's bits dtype, the same length, and no zeros. ``base_fingerprint`` and
    ``target_fingerprint`` are the fingerprints (patcher.fingerprint) of the whole
    tensor before and after; they are equal for an unchanged tensor.

    Unlike a :class:`Change` it is self-contained, as a patch shard records it: it
    carries the tensor's spec (so it can be checked on its own) and both absolute
    fingerprints (so a holder can check its base before applying, and the result after)
    rather than only their difference.
    """

    spec: TensorSpec
    indices: NDArray[np.int64]
    delta: NDArray[np.unsignedinteger]
    base_fingerprint: int
    target_fingerprint: int

    @classmethod
    def from_change(cls, spec: TensorSpec, change: HostChange, base_fingerprint: int) -> TensorDelta:
        """The delta of ``spec`` that ``change`` makes to bits whose fingerprint is ``base_fingerprint``."""
        target = (base_fingerprint + change.fingerprint_delta) & _MASK64
        return cls(spec, change.indices, change.delta, base_fingerprint, target)

    @property
    def changed(self) -> int:
        return int(self.indices.size)

    def validate_layout(self) -> None:
        """The O(1) part of :meth:`validate`: dtypes, lengths and fingerprints."""
        idx, dl = self.indices, self.delta
        if not isinstance(idx, np.ndarray) or idx.dtype != np.int64 or idx.ndim != 1:
            raise InvalidInput(f"{self.spec.name}: indices must be a 1-d int64 array")
        if not isinstance(dl, np.ndarray) or dl.dtype != self.spec.bits_dtype or dl.shape != idx.shape:
            raise InvalidInput(f"{self.spec.name}: delta must match indices and the dtype's width")
        for fp in (self.base_fingerprint, self.target_fingerprint):
            if not isinstance(fp, int) or not 0 <= fp < 1 << 64:
                raise InvalidInput(f"{self.spec.name}: fingerprint out of range")

    def validate(self) -> None:
        """Check every invariant above; raises ``InvalidInput``."""
        self.validate_layout()
        n = self.spec.numel
        idx, dl = self.indices, self.delta
        if idx.size and native.active() and idx.flags.c_contiguous and dl.flags.c_contiguous:
            # Indices are int64: a larger numel bounds nothing more.
            problem = native.speedups.check_changes(idx, dl, dl.dtype.itemsize, min(n, _INT64_MAX))
            if problem:
                raise InvalidInput(f"{self.spec.name}: " + _PROBLEMS[problem].format(n=n))
        elif idx.size:
            if idx[0] < 0 or idx[-1] >= n:
                raise InvalidInput(f"{self.spec.name}: index out of range [0, {n})")
            if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
                raise InvalidInput(f"{self.spec.name}: indices must be strictly increasing")
            if not bool(np.all(dl != 0)):
                raise InvalidInput(f"{self.spec.name}: a zero delta is not a change")


@dataclass(frozen=True, slots=True, eq=False)
class Patch:
    """Every tensor of a version, each with its delta (empty when unchanged)."""

    tensors: Mapping[str, TensorDelta]

    def __post_init__(self) -> None:
        for name, td in self.tensors.items():
            if name != td.spec.name:
                raise InvalidInput(f"patch key {name!r} names tensor {td.spec.name!r}")

    def __iter__(self) -> Iterator[TensorDelta]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {name: td.spec for name, td in self.tensors.items()}

    @property
    def changed_elements(self) -> int:
        return sum(td.changed for td in self)

    @property
    def total_elements(self) -> int:
        return sum(td.spec.numel for td in self)

    @property
    def total_bytes(self) -> int:
        return sum(td.spec.nbytes for td in self)

    def check_layout(self, specs: Mapping[str, TensorSpec]) -> None:
        """Raise ``IncompatibleTensors`` unless ``specs`` is exactly this patch's layout."""
        check_layout(self.specs, specs)


def check_names(expected: Mapping[str, object], given: Mapping[str, object], what: str) -> None:
    """``IncompatibleTensors`` ("<what>: missing [...], unexpected [...]", five of each at
    most) unless ``given`` has exactly the keys of ``expected``."""
    if given.keys() != expected.keys():
        missing = sorted(expected.keys() - given.keys())[:5]
        extra = sorted(given.keys() - expected.keys())[:5]
        raise IncompatibleTensors(f"{what}: missing {missing}, unexpected {extra}")


def check_layout(mine: Mapping[str, TensorSpec], specs: Mapping[str, TensorSpec]) -> None:
    """Raise ``IncompatibleTensors`` unless a patch's layout ``mine`` is exactly ``specs``."""
    check_names(mine, specs, "tensor sets differ")
    for name, spec in specs.items():
        if spec != mine[name]:
            raise IncompatibleTensors(
                f"{name}: patch has {mine[name].dtype}{list(mine[name].shape)}, "
                f"target has {spec.dtype}{list(spec.shape)}"
            )
