"""Collectives over shared memory, for tensor-parallel ranks on one machine.

gloo's all-reduce over loopback costs about a millisecond even for a decode step's few rows,
and a decoder layer needs two: over sixty a step on the default model. Ranks that share a
machine instead write into a shared segment and read each other's rows there: each rank has a
slot per operation parity, and a sequence number it publishes when its slot is written (or,
for a command, read). An operation numbered s uses the slots of parity s % 2, last used by s - 2;
a rank publishes s - 1 only after it has read everything of s - 2, so a rank that has seen every
rank at s - 1 may overwrite its slot (see shm_collectives.c for the memory ordering).

Every rank adds the slots in rank order, so all ranks hold the same sum to the bit. Tensors
larger than a slot go through in pieces. The segment's file is unlinked once every rank has
mapped it: nothing is left behind in /dev/shm, whatever way the processes end.
`--disable-custom-all-reduce` keeps every collective on gloo.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import pickle
from pathlib import Path

import torch

from srv.sdk.native import NativeKernel, load_c_library
from srv.sdk.parallel import CollectiveFailed

# Bytes of one rank's slot for one parity: a prefill chunk's residual rows in two or three pieces.
SLOT_BYTES = 4 << 20
HEADER_BYTES = 4096   # each rank's sequence number on its own 64-byte line


@functools.cache
def library() -> ctypes.CDLL:
    lib = load_c_library(Path(__file__).with_name("shm_collectives.c"))
    lib.srv_shm_publish.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.srv_shm_wait.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_double]
    lib.srv_shm_wait.restype = ctypes.c_int
    lib.srv_shm_begin.argtypes = [ctypes.c_void_p]
    lib.srv_shm_begin.restype = ctypes.c_int
    lib.srv_shm_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.srv_shm_all_reduce.restype = ctypes.c_int
    return lib


class ShmGroup(ctypes.Structure):
    """shm_collectives.c's view of the segment; `seq` is the one sequence every collective advances."""
    _fields_ = [("base", ctypes.c_void_p), ("rank", ctypes.c_int64), ("ranks", ctypes.c_int64), ("seq", ctypes.c_int64),
                ("header_bytes", ctypes.c_int64), ("slot_bytes", ctypes.c_int64), ("timeout", ctypes.c_double),
                ("native_seconds", ctypes.c_double)]


def segment_path(name: str) -> Path:
    return Path("/dev/shm") / f"srv-tp-{name}"


def create_segment(name: str, ranks: int) -> None:
    """Rank 0, before the group forms: the zeroed segment the ranks map."""
    with open(segment_path(name), "wb") as f:
        f.truncate(HEADER_BYTES + 2 * ranks * SLOT_BYTES)


class SharedMemoryCollectives:
    def __init__(self, name: str, rank: int, ranks: int, timeout: float) -> None:
        library()   # compiled before the first collective, not inside it
        self.rank, self.ranks, self.timeout = rank, ranks, timeout
        with open(segment_path(name), "r+b") as f:
            self._map = mmap.mmap(f.fileno(), HEADER_BYTES + 2 * ranks * SLOT_BYTES)
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = buffer.data_ptr()
        self._buffer = buffer
        self._slots = [[buffer[HEADER_BYTES + (parity * ranks + r) * SLOT_BYTES:][:SLOT_BYTES] for r in range(ranks)]
                       for parity in range(2)]
        self.group = ShmGroup(self._base, rank, ranks, 0, HEADER_BYTES, SLOT_BYTES, timeout, 0.0)
        # The all-reduce of C decode layers (srv.sdk.parallel.ParallelContext.native_all_reduce).
        self.native_all_reduce = NativeKernel.of(library().srv_shm_native_all_reduce, self.group)

    @property
    def seq(self) -> int:
        return self.group.seq

    @property
    def native_seconds(self) -> float:
        """Seconds the C decode layers have spent in this group's all-reduce."""
        return self.group.native_seconds

    @staticmethod
    def unlink(name: str) -> None:
        """Rank 0, once every rank has mapped the segment."""
        try:
            os.unlink(segment_path(name))
        except FileNotFoundError:
            pass

    def _begin(self) -> list[torch.Tensor]:
        """The slots of the next operation, once every rank has finished reading their last use."""
        if library().srv_shm_begin(ctypes.addressof(self.group)) != 0:
            raise self._timed_out(self.timeout)
        return self._slots[self.seq % 2]

    def _wait(self, first: int, last: int, seq: int, timeout: float) -> None:
        if library().srv_shm_wait(self._base, first, last, seq, timeout) != 0:
            raise self._timed_out(timeout)

    @staticmethod
    def _timed_out(timeout: float) -> CollectiveFailed:
        return CollectiveFailed(f"shared-memory collective timed out: a tensor-parallel rank did not arrive within "
                                f"{timeout:.0f} s")

    def _publish(self) -> None:
        library().srv_shm_publish(self._base, self.rank, self.seq)

    def all_reduce(self, x: torch.Tensor) -> None:
        """x (float32, contiguous) becomes the sum of every rank's x, in place."""
        if library().srv_shm_all_reduce(ctypes.addressof(self.group), x.data_ptr(), x.numel()) != 0:
            raise self._timed_out(self.timeout)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (float32 [rows, width], the same shape on every rank) on rank 0; None elsewhere."""
        width = x.shape[-1]
        rows_per_piece = max(1, SLOT_BYTES // (4 * width))
        pieces: list[list[torch.Tensor]] = []
        for start in range(0, x.shape[0], rows_per_piece):
            piece = x[start:start + rows_per_piece]
            slots = [slot.view(torch.float32)[:piece.numel()].view(piece.shape) for slot in self._begin()]
            slots[self.rank].copy_(piece)
            self._publish()
            if self.rank == 0:
                self._wait(0, self.ranks, self.seq, self.timeout)
                pieces.append([slot.clone() for slot in slots])
        if self.rank != 0:
            return None
        return [torch.cat([piece[r] for piece in pieces]) for r in range(self.ranks)]

    def send(self, message: object) -> None:
        """Rank 0: `message` to every other rank (`receive`)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        step = SLOT_BYTES - 8
        for start in range(0, max(len(data), 1), step):
            piece = data[start:start + step]
            slot = self._begin()[0]
            more = start + step < len(data)
            slot[:8].view(torch.int64)[0] = len(piece) | (int(more) << 62)
            slot[8:8 + len(piece)].copy_(torch.frombuffer(bytearray(piece), dtype=torch.uint8))
            self._publish()

    def receive(self) -> object:
        """The next message rank 0 sent; waits for as long as the server idles."""
        data = bytearray()
        while True:
            slot = self._begin()[0]
            self._wait(0, 1, self.seq, -1.0)
            header = int(slot[:8].view(torch.int64)[0])
            length, more = header & ((1 << 62) - 1), header >> 62
            data += slot[8:8 + length].numpy().tobytes()
            self._publish()
            if not more:
                return pickle.loads(bytes(data))
