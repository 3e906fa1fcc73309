"""The collectives a sharded publish needs, over a process group of its own.

The publisher makes its own gloo group (``torch.distributed.new_group``) so that its
collectives, run from a background thread by ``publish_async``, never interleave with
the trainer's on the default group; every rank runs the same collectives in the same
order (one version after another), so they cannot deadlock. Each carries a timeout:
a rank that died or hangs makes the others' collective raise, as
:class:`~bulletin.errors.RankFailed`, instead of waiting for ever.

What crosses is small: descriptions and statuses (objects, O(manifest)), one vector of
sums (:meth:`Comm.add_up`, O(tensors)), changed elements of the tensors whose blocks are
not runs (:meth:`Comm.exchange`, O(changed)), and at a keyframe the blocks of tensors no
single rank holds whole (:meth:`Comm.send` / :meth:`Comm.recv`, one block at a time).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bulletin.errors import RankFailed
from bulletin_kernels.dispatch import torch_reading

__all__ = ["Comm"]


class Comm:
    """Collectives over ``group`` (a gloo group of the job's ranks), or none for one rank."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world

    @classmethod
    def create(cls, timeout_s: float) -> Comm:
        """A new gloo group of every rank of the default group (a collective call: every
        rank makes it, in the same order), or a one-rank stand-in without
        ``torch.distributed`` initialised."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return cls(None, 0, 1)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(group, dist.get_rank(), dist.get_world_size())

    def _failed(self, what: str, exc: BaseException) -> RankFailed:
        return RankFailed(
            f"rank {self.rank}: {what} with the other ranks failed ({type(exc).__name__}: {exc}): a rank died, "
            "timed out or left; nothing was committed for this step (restart the job: it resumes from the run)"
        )

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable, small), in rank order."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, value, group=self.group)
        except RuntimeError as exc:
            raise self._failed("a gather", exc) from exc
        return out

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """``value`` of rank ``src``, on every rank."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self.group)
        except RuntimeError as exc:
            raise self._failed("a broadcast", exc) from exc
        return box[0]

    def add_up(self, vector: NDArray[np.int64]) -> NDArray[np.int64]:
        """The sum of every rank's ``vector`` (same length on every rank; int64, whose
        sums the caller keeps from overflowing), on every rank: O(its length) whatever the
        world size."""
        if self.world == 1:
            return vector
        import torch
        import torch.distributed as dist

        summed = torch.from_numpy(np.array(vector, dtype=np.int64))  # a copy of its own, reduced in place
        try:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as exc:
            raise self._failed("a sum", exc) from exc
        return summed.numpy()

    def exchange(self, outgoing: list[Any]) -> list[Any]:
        """All-to-all: ``outgoing[r]`` (picklable, NumPy arrays inside are fine) goes to
        rank ``r``; returns what every rank sent to this one, in rank order (this rank's
        own part as it is, never pickled). Arrays travel out of band (pickle protocol 5):
        each is copied once into the send buffer, and what arrives are views of the
        receive buffer, so the bytes are the payloads themselves (O(what is sent))."""
        if self.world == 1:
            return list(outgoing)
        import torch
        import torch.distributed as dist

        frames = [[] if r == self.rank else _frame(item) for r, item in enumerate(outgoing)]
        sizes = torch.tensor([sum(len(piece) for piece in frame) for frame in frames], dtype=torch.int64)
        incoming = torch.empty(self.world, dtype=torch.int64)
        try:
            dist.all_to_all_single(incoming, sizes, group=self.group)
            send = np.empty(int(sizes.sum()), dtype=np.uint8)
            pos = 0
            for frame in frames:
                for piece in frame:
                    send[pos : pos + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
                    pos += len(piece)
            del frames
            recv = torch.empty(int(incoming.sum()), dtype=torch.uint8)
            dist.all_to_all_single(recv, torch.from_numpy(send), incoming.tolist(), sizes.tolist(), group=self.group)
        except RuntimeError as exc:
            raise self._failed("an exchange of changes", exc) from exc
        data = recv.numpy()
        out: list[Any] = []
        pos = 0
        for source, n in enumerate(incoming.tolist()):
            out.append(outgoing[self.rank] if source == self.rank else _unframe(data[pos : pos + n]))
            pos += n
        return out

    def send(self, bits: NDArray[Any], dst: int) -> None:
        """One block's bytes to rank ``dst`` (which calls :meth:`recv`)."""
        import torch.distributed as dist

        data = np.ascontiguousarray(bits).reshape(-1).view(np.uint8)  # a block of a read-only map, maybe
        try:
            dist.send(torch_reading(data), dst=dst, group=self.group)
        except RuntimeError as exc:
            raise self._failed("sending a keyframe block", exc) from exc

    def recv(self, nbytes: int, src: int) -> NDArray[np.uint8]:
        import torch
        import torch.distributed as dist

        buf = torch.empty(nbytes, dtype=torch.uint8)
        try:
            dist.recv(buf, src=src, group=self.group)
        except RuntimeError as exc:
            raise self._failed("receiving a keyframe block", exc) from exc
        return buf.numpy()

    def destroy(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self.group)
            self.group = None


_COUNT = np.dtype("<i8")


def _frame(item: Any) -> list[memoryview | bytes]:
    """``item`` as the pieces of one message: the count and sizes of what follows (int64),
    the pickle, and the bytes of every array in it (not copied here), each padded to 8
    bytes so that every array arrives aligned."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(item, protocol=5, buffer_callback=buffers.append)
    raws: list[memoryview | bytes] = [head, *(buffer.raw() for buffer in buffers)]
    sizes = np.array([len(raws), *(len(raw) for raw in raws)], dtype=_COUNT)
    pieces: list[memoryview | bytes] = [sizes.tobytes()]
    for raw in raws:
        pieces.append(raw)
        if len(raw) % 8:
            pieces.append(bytes(-len(raw) % 8))
    return pieces


def _unframe(data: NDArray[np.uint8]) -> Any:
    """What :func:`_frame` framed; its arrays are views of ``data``."""
    count = int(data[:8].view(_COUNT)[0])
    sizes = data[8 : 8 * (count + 1)].view(_COUNT).tolist()
    pos = 8 * (count + 1)
    pieces = []
    for size in sizes:
        pieces.append(data[pos : pos + size])
        pos += size + -size % 8
    return pickle.loads(pieces[0].tobytes(), buffers=pieces[1:])  # the job's own ranks' bytes
