# Stub of the compiled fast path (patcher/_speedups.c); patcher/native.py is its only user.
from typing import Any, TypeAlias

from _typeshed import ReadableBuffer, WriteableBuffer
from numpy.typing import NDArray

# NumPy's stubs give ndarray no __buffer__ before Python 3.12, though it has one.
In: TypeAlias = ReadableBuffer | NDArray[Any]
Out: TypeAlias = WriteableBuffer | NDArray[Any]

def diff(
    old: In, new: In, width: int, pos: int, indices_out: Out, was_out: Out, delta_out: Out, first: int = 0, /
) -> tuple[int, int, int]: ...
def fingerprint(bits: In, width: int, first_index: int, vector: bool = True, /) -> int: ...
def fingerprint_change(indices: In, old: In, new: In, width: int, /) -> int: ...
def scatter_add(target: Out, width: int, indices: In, delta: In, old_out: Out, after: int, /) -> tuple[int, int]: ...
def scatter(target: Out, width: int, indices: In, values: In, /) -> None: ...
def cast(src: In, dst: Out, kind: int, widest: int = 2, /) -> None: ...
def cast_diff(
    old: In,
    src: In,
    kind: int,
    pos: int,
    first: int,
    indices_out: Out,
    was_out: Out,
    delta_out: Out,
    widest: int = 2,
    /,
) -> tuple[int, int, int]: ...
def check_changes(indices: In, delta: In, width: int, numel: int, /) -> int: ...
def decode_gaps(
    low: In,
    codes: In,
    planes: In,
    plane_width: int,
    escapes: int,
    count: int,
    start: int,
    stop: int,
    indices_out: Out,
    /,
) -> bool: ...
def decode_deltas(
    codes: In, planes: In, plane_width: int, escapes: int, count: int, width: int, delta_out: Out, /
) -> bool: ...
def encode_gaps(indices: In, start: int, low_out: Out, codes_out: Out, escaped_out: Out, /) -> int: ...
def encode_deltas(delta: In, width: int, codes_out: Out, escaped_out: Out, /) -> int: ...
def apply_entry(
    target: Out,
    width: int,
    low: In,
    gap_codes: In,
    gap_planes: In,
    gap_plane_width: int,
    gap_escapes: int,
    delta_codes: In,
    delta_planes: In,
    delta_plane_width: int,
    delta_escapes: int,
    count: int,
    start: int,
    stop: int,
    subtract: bool,
    limit: int,
    /,
) -> tuple[int, int, bool]: ...
def ctx_encode(meta: In, classes: In, ranks: In, deltas: In, budget: int, /) -> tuple[int, bytes | None]: ...
def ctx_decode(stream: In, meta: In, classes_out: Out, ranks_out: Out, deltas_out: Out, /) -> bool: ...
def ctx_ranks(
    base: In,
    width: int,
    shift: int,
    ebits: int,
    lo: int,
    classes: int,
    start: int,
    indices: In,
    classes_out: Out,
    ranks_out: Out,
    /,
) -> None: ...
def ctx_select(
    base: In,
    width: int,
    shift: int,
    ebits: int,
    lo: int,
    classes: int,
    start: int,
    stop: int,
    cls: In,
    ranks: In,
    overlay_idx: In,
    overlay_val: In,
    idx_out: Out,
    /,
) -> bool: ...
def ctx_apply(
    target: Out,
    width: int,
    shift: int,
    ebits: int,
    lo: int,
    classes: int,
    start: int,
    stop: int,
    cls: In,
    ranks: In,
    delta: In,
    idx_out: Out,
    pos_out: Out,
    /,
) -> tuple[int, int, bool]: ...
def ctx_histogram(
    base: In,
    width: int,
    shift: int,
    ebits: int,
    start: int,
    stop: int,
    stride: int,
    run: int,
    counts_out: Out,
    indices: In,
    changed_out: Out,
    /,
) -> None: ...
def ctx_sample(
    base: In,
    new: In,
    width: int,
    shift: int,
    ebits: int,
    start: int,
    stop: int,
    stride: int,
    run: int,
    counts_out: Out,
    changed_out: Out,
    /,
) -> None: ...
def ctx_window(sampled: In, changed: In, scale: int, /) -> tuple[int, int]: ...
def ctx_diff(
    old: In,
    new: In,
    width: int,
    shift: int,
    ebits: int,
    lo: int,
    classes: int,
    pos: int,
    totals: Out,
    changed: Out,
    indices_out: Out,
    was_out: Out,
    delta_out: Out,
    classes_out: Out,
    ranks_out: Out,
    /,
) -> tuple[int, int, int]: ...
