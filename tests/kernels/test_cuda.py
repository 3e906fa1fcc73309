"""The CUDA backend against the NumPy twin, byte for byte, on a real GPU.

Skipped as a whole where CuPy or a CUDA device is missing (CI); run with
``pytest -m gpu tests/kernels`` on a GPU machine (scripts/bench_gpu.py does).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

import bulletin_kernels
from bulletin.errors import FormatError, InvalidInput, VerificationFailed
from bulletin_kernels import cuda
from bulletin_kernels import numpy_twin as twin
from patcher.context import ClassWindow
from patcher.fingerprint_update import fingerprint_change
from tests.kernels.helpers import (
    CASTS,
    SELECT_FIELDS,
    SPECIALS,
    golden_cases,
    golden_patch,
    model_patch,
    pair,
    random_bits,
    select_case,
    sorted_unique,
)

cp = pytest.importorskip("cupy")
try:
    _DEVICES = int(cp.cuda.runtime.getDeviceCount())
except cp.cuda.runtime.CUDARuntimeError:
    _DEVICES = 0
if not _DEVICES:
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

TILE = cuda.TILE_ELEMENTS
SIZES = [1, 7, 8, 9, 1000, TILE - 1, TILE, TILE + 1, 5 * TILE + 333, 1_000_003]
DENSITIES = [0.0, 1e-5, 0.01, 0.5, 1.0]


def host(array: Any) -> NDArray[Any]:
    """A host copy of a device array."""
    out: NDArray[Any] = cp.asnumpy(array)
    return out


def on_device(array: NDArray[Any], element_offset: int = 0) -> Any:
    """A device copy of ``array`` that starts ``element_offset`` elements into a
    256-byte-aligned allocation: the odd addresses of real tensor views."""
    flat = array.reshape(-1)
    base = cp.empty(flat.size + element_offset, dtype=flat.dtype)
    view = base[element_offset:]
    view[...] = cp.asarray(flat)
    return view.reshape(array.shape)


@pytest.mark.parametrize("source,served", CASTS)
def test_diff_cast(source: str, served: str) -> None:
    rng = np.random.default_rng(sum(map(ord, source + served)))
    for n in SIZES:
        for density in DENSITIES:
            current, kept = pair(rng, source, served, (n,), density)
            cur_off, kept_off = (int(x) for x in rng.integers(0, 8, 2))
            cur_d, kept_d = on_device(current, cur_off), on_device(kept, kept_off)
            want = twin.diff_cast(current, kept, current_dtype=source, served_dtype=served)
            got = cuda.diff_cast(cur_d, kept_d, current_dtype=source, served_dtype=served)
            where = f"n={n} density={density} offsets={cur_off},{kept_off}"
            np.testing.assert_array_equal(host(got.indices), want.indices, err_msg=where)
            np.testing.assert_array_equal(host(got.delta), want.delta, err_msg=where)
            assert got.delta.dtype == want.delta.dtype, where
            assert got.fingerprint_delta == want.fingerprint_delta, where
            np.testing.assert_array_equal(host(kept_d), kept, err_msg=where)


def test_diff_cast_empty_and_shaped() -> None:
    got = cuda.diff_cast(
        cp.empty((0, 3), cp.uint32), cp.empty((0, 3), cp.uint16), current_dtype="F32", served_dtype="F16"
    )
    assert got.indices.size == 0 and got.fingerprint_delta == 0
    current, kept = pair(np.random.default_rng(1), "F32", "BF16", (37, 129), 0.1)
    kept_d = on_device(kept)
    got = cuda.diff_cast(on_device(current), kept_d, current_dtype="F32", served_dtype="BF16")
    want = twin.diff_cast(current, kept, current_dtype="F32", served_dtype="BF16")
    np.testing.assert_array_equal(host(got.indices), want.indices)
    np.testing.assert_array_equal(host(kept_d), kept)


def test_diff_cast_past_2_to_the_31() -> None:
    # 64-bit index arithmetic: changes beyond element 2**31 of a 2 GiB tensor.
    n = (1 << 31) + 1234
    current = cp.zeros(n, dtype=cp.uint8)
    kept = cp.zeros(n, dtype=cp.uint8)
    where = np.array([5, (1 << 31) - 1, 1 << 31, n - 1], dtype=np.int64)
    current[cp.asarray(where)] = cp.asarray(np.array([1, 2, 3, 4], dtype=np.uint8))
    got = cuda.diff_cast(current, kept, current_dtype="U8", served_dtype="U8")
    np.testing.assert_array_equal(host(got.indices), where)
    np.testing.assert_array_equal(host(got.delta), [1, 2, 3, 4])
    assert int(kept[n - 1]) == 4
    values = np.array([1, 2, 3, 4], dtype=np.uint8)
    assert got.fingerprint_delta == fingerprint_change(where, np.zeros(4, dtype=np.uint8), values)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_fingerprint(width: int) -> None:
    rng = np.random.default_rng(width)
    dtype = np.dtype(f"u{width}")
    for n in [1, 2, 7, 8, 9, 17, 1000, 1 << 20, (1 << 24) + 5]:
        for offset in (0, 1, 3, 7):
            bits = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
            assert cuda.fingerprint(on_device(bits, offset)) == twin.fingerprint(bits), f"n={n} offset={offset}"
    assert cuda.fingerprint(cp.empty(0, dtype=dtype)) == 0


@pytest.mark.parametrize("dtype", ["U8", "BF16", "F32", "F64"])
def test_apply_delta(dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    for n, m in [(1, 1), (10, 0), (10, 3), (TILE * 3 + 1, 500), (1_000_000, 10_000), (1_000_000, 1_000_000)]:
        bits = random_bits(rng, dtype, (n,))
        idx = sorted_unique(rng, n, m)
        delta = random_bits(rng, dtype, (idx.size,))
        delta[delta == 0] = 1
        bits_d = on_device(bits, int(rng.integers(0, 8)))
        change = cuda.apply_delta(bits_d, cp.asarray(idx), cp.asarray(delta))
        assert change == twin.apply_delta(bits, idx, delta)
        np.testing.assert_array_equal(host(bits_d), bits)


def test_apply_delta_refuses_bad_indices_and_changes_nothing() -> None:
    bits = cp.arange(10_000, dtype=cp.uint16)
    for idx in ([3, 3], [5, 4], [-1, 4], [0, 10_000], [*range(9000), 8999]):
        with pytest.raises(InvalidInput):
            cuda.apply_delta(bits, cp.asarray(np.array(idx, dtype=np.int64)), cp.ones(len(idx), dtype=cp.uint16))
        assert bool((bits == cp.arange(10_000, dtype=cp.uint16)).all())
    with pytest.raises(InvalidInput):  # host arrays are not device arrays
        cuda.apply_delta(bits, np.array([1], dtype=np.int64), cp.ones(1, dtype=cp.uint16))


@pytest.mark.parametrize("served", ["BF16", "F16"])
def test_cast(served: str) -> None:
    rng = np.random.default_rng(4)
    current = np.concatenate([SPECIALS, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    got = cuda.cast(on_device(current, 1), "F32", served)
    np.testing.assert_array_equal(host(got), twin.cast(current, "F32", served))


def test_decode_gaps() -> None:
    rng = np.random.default_rng(6)
    for start in (0, 1, 12345):
        indices = start + sorted_unique(rng, 1 << 22, 100_000)
        gaps = np.diff(indices, prepend=start - 1)
        for dtype in (np.uint16, np.uint32, np.int64):
            if int(gaps.max()) <= np.iinfo(dtype).max:
                got = cuda.decode_gaps(cp.asarray(gaps.astype(dtype)), start)
                np.testing.assert_array_equal(host(got), twin.decode_gaps(gaps.astype(dtype), start))


def test_apply_patch_and_restore() -> None:
    patch, old, new = model_patch(np.random.default_rng(3))
    fps = {td.spec.name: td.base_fingerprint for td in patch}
    held = {name: on_device(bits, 1) for name, bits in old.items()}
    assert cuda.apply(patch, held, fps) == twin.apply(patch, {k: v.copy() for k, v in old.items()}, fps)
    for name, bits in held.items():
        np.testing.assert_array_equal(host(bits), new[name])
    lying = {name: on_device(bits) for name, bits in old.items()}
    lying["head.bias"][2] ^= 1
    snapshot = {name: host(bits) for name, bits in lying.items()}
    with pytest.raises(VerificationFailed):
        cuda.apply(patch, lying, fps)
    for name, bits in lying.items():
        np.testing.assert_array_equal(host(bits), snapshot[name])


def test_torch_cuda_tensors_are_patched_in_place() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    # Views at odd storage offsets, as tensors carved from a flat buffer are.
    master = (torch.randn(2001, device="cuda") * 10)[1:]
    served = torch.zeros(2003, dtype=torch.bfloat16, device="cuda")[3:]
    backend = bulletin_kernels.backend_for(served)
    assert backend is cuda and bulletin_kernels.backend_for(cp.zeros(1)) is cuda
    result = backend.diff_cast(
        bulletin_kernels.as_bits(master), bulletin_kernels.as_bits(served), current_dtype="F32", served_dtype="BF16"
    )
    # torch's own CUDA rounding agrees with ours on every number (NaNs aside).
    assert torch.equal(served, master.to(torch.bfloat16))
    assert int(result.indices.size) == int((served != 0).sum())
    bits = bulletin_kernels.as_bits(served)
    before = backend.fingerprint(bits)
    change = backend.apply_delta(bits, cp.asarray(np.array([0, 1999], dtype=np.int64)), cp.ones(2, dtype=cp.uint16))
    on_host = served.view(torch.uint16).cpu().numpy()
    assert backend.fingerprint(bits) == (before + change) % (1 << 64) == twin.fingerprint(on_host)
    assert bulletin_kernels.dtype_name(served) == "BF16"


@pytest.mark.skipif(not golden_cases(), reason="no golden patch files under tests/golden")
@pytest.mark.parametrize("case", sorted(golden_cases()))
def test_golden_patches_apply_the_same_on_both_paths(case: str) -> None:
    patch = golden_patch(case)
    rng = np.random.default_rng(8)
    for td in patch:
        idx_d, delta_d = cp.asarray(td.indices), cp.asarray(td.delta)
        gaps = np.diff(td.indices, prepend=-1)
        np.testing.assert_array_equal(host(cuda.decode_gaps(cp.asarray(gaps), 0)), td.indices)
        if td.spec.numel <= 1 << 26:
            base = random_bits(rng, td.spec.dtype, td.spec.shape)
            on_host = base.copy()
            device = on_device(base, 3)
            assert cuda.apply_delta(device, idx_d, delta_d) == twin.apply_delta(on_host, td.indices, td.delta)
            np.testing.assert_array_equal(host(device), on_host, err_msg=td.spec.name)
            continue
        # Past 2**31 elements (the 16 GiB sparse case): zeros on both sides; NumPy's
        # zeros are lazily mapped, so the host twin touches only the changed pages.
        if td.spec.nbytes * 1.25 > cp.cuda.Device().mem_info[0]:
            pytest.skip(f"{td.spec.name}: {td.spec.nbytes} bytes do not fit on this device")
        on_host = np.zeros(td.spec.shape, dtype=td.spec.bits_dtype)
        device = cp.zeros(td.spec.shape, dtype=td.spec.bits_dtype)
        assert cuda.apply_delta(device, idx_d, delta_d) == twin.apply_delta(on_host, td.indices, td.delta)
        flat = device.reshape(-1)
        np.testing.assert_array_equal(host(flat[idx_d]), on_host.reshape(-1)[td.indices])
        assert int(cp.count_nonzero(flat)) == int(np.count_nonzero(td.delta))
        del device, flat


STILE = cuda.SELECT_TILE_ELEMENTS


@pytest.mark.parametrize("dtype,shift,width", SELECT_FIELDS)
def test_select_ranks(dtype: str, shift: int, width: int) -> None:
    rng = np.random.default_rng(shift + width)
    for n in [1, 100, STILE - 1, STILE, STILE + 1, 7 * STILE + 5, 1_000_003]:
        for classes in [1, 5, 16] if width else [1]:
            for density in [1e-4, 0.01, 0.5, 1.0]:
                case = select_case(rng, dtype, shift, width, n, classes, density)
                window = ClassWindow(case.lo, case.classes)
                args = (case.start, case.stop, case.query_classes, case.ranks)
                want = twin.select_ranks(case.base, dtype, window, *args)
                base = on_device(case.base, int(rng.integers(0, 8)))
                queries = cp.asarray(case.query_classes), cp.asarray(case.ranks)
                got = cuda.select_ranks(base, dtype, window, case.start, case.stop, *queries)
                where = f"n={n} classes={classes} m={case.ranks.size}"
                np.testing.assert_array_equal(host(got), want, err_msg=where)
                np.testing.assert_array_equal(host(base), case.base, err_msg=where)


def test_select_ranks_refuses_ranks_past_their_class() -> None:
    case = select_case(np.random.default_rng(9), "BF16", 7, 8, 50_000, 6, 0.05)
    window = ClassWindow(case.lo, case.classes)
    ranks = case.ranks.copy()
    ranks[-1] += 50_000
    classes, device_ranks = cp.asarray(case.query_classes), cp.asarray(ranks)
    with pytest.raises(FormatError):
        cuda.select_ranks(cp.asarray(case.base), "BF16", window, case.start, case.stop, classes, device_ranks)
    with pytest.raises(FormatError):
        twin.select_ranks(case.base, "BF16", window, case.start, case.stop, case.query_classes, ranks)


@pytest.mark.parametrize("dtype,shift,width", SELECT_FIELDS)
def test_apply_ranks(dtype: str, shift: int, width: int) -> None:
    rng = np.random.default_rng(shift + width + 1)
    for n in [1, STILE + 1, 1_000_003]:
        for classes in [1, 16] if width else [1]:
            for density in [0.0035, 1.0]:
                case = select_case(rng, dtype, shift, width, n, classes, density)
                window = ClassWindow(case.lo, case.classes)
                delta = random_bits(rng, dtype, (case.ranks.size,))
                held = case.base.copy()
                args = (case.start, case.stop)
                want = twin.apply_ranks(held, dtype, window, *args, case.query_classes, case.ranks, delta)
                bits = on_device(case.base, int(rng.integers(0, 8)))
                queries = cp.asarray(case.query_classes), cp.asarray(case.ranks), cp.asarray(delta)
                assert cuda.apply_ranks(bits, dtype, window, *args, *queries) == want
                np.testing.assert_array_equal(host(bits), held)
