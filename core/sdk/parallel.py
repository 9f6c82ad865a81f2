"""The parallel layout a model is built for: which tensor-parallel rank this process is, of how
many, and the collectives its layers need (`--tensor-parallel-size`).

srv hands a `ParallelContext` to a model implementation before `build` (`ModelImpl.parallel`).
With one rank (`ParallelContext()`), every collective returns its input: a model written on
`srv.sdk.layers` runs unchanged at tp=1. With more, the ranks form a torch.distributed group
(gloo on CPU): rank 0 schedules and samples, every rank computes its share of each layer.

Work is split in units that must stay together (a key/value head and the query heads that
share it, a block of quantized columns): `partition` gives the first ranks one unit more where
the count does not divide, so a model of 9 query heads in 3 groups runs on two ranks as groups
{0, 1} and {2}.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None   # the tensor-parallel ranks' torch.distributed ProcessGroup (None at tp=1)
    # Seconds this process has spent in the collectives below (what benchmarks report as their share).
    collective_seconds: float = 0.0
    # A faster path for ranks that share a machine (shared memory), used instead of the group's
    # collectives when set: `all_reduce(float32 tensor)` in place, `gather(tensor)` -> every
    # rank's on rank 0.
    local: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def partition(self, total: int, unit: int = 1) -> tuple[int, int]:
        """(start, size) of this rank's share of `total` items cut in units of `unit`."""
        starts = self.partition_starts(total, unit)
        return starts[self.tp_rank], starts[self.tp_rank + 1] - starts[self.tp_rank]

    def partition_starts(self, total: int, unit: int = 1) -> list[int]:
        """Every rank's start, and `total` last: rank r holds [starts[r], starts[r + 1])."""
        if total % unit:
            raise ValueError(f"{total} items do not cut into units of {unit}")
        units = total // unit
        if units < self.tp_size:
            raise ValueError(f"{units} units of {unit} cannot be shared by {self.tp_size} tensor-parallel ranks")
        base, extra = divmod(units, self.tp_size)
        starts = [0]
        for rank in range(self.tp_size):
            starts.append(starts[-1] + (base + (rank < extra)) * unit)
        return starts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (the partial products of a row-parallel layer). Summed in
        float32 whatever x's dtype, and returned in x's."""
        if not self.is_parallel:
            return x
        import torch.distributed as dist

        started = time.perf_counter()
        total = x.float() if x.dtype != torch.float32 else x.contiguous()
        if self.local is not None:
            self.local.all_reduce(total)
        else:
            dist.all_reduce(total, group=self.group)
        total = total.to(x.dtype)
        self.collective_seconds += time.perf_counter() - started
        return total

    def gather(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, on rank 0 (rank r holds
        columns [starts[r], starts[r + 1])); other ranks get their own x back. For the
        vocabulary head, whose logits only rank 0 samples."""
        if not self.is_parallel:
            return x
        import torch.distributed as dist

        started = time.perf_counter()
        width = max(b - a for a, b in zip(starts, starts[1:]))
        padded = torch.zeros(*x.shape[:-1], width, dtype=x.dtype)
        padded[..., :x.shape[-1]] = x
        if self.local is not None:
            parts = self.local.gather(padded)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(padded, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        self.collective_seconds += time.perf_counter() - started
        if self.tp_rank != 0:
            return x
        return torch.cat([part[..., :b - a] for part, a, b in zip(parts, starts, starts[1:])], dim=-1)
