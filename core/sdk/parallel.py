"""The parallel layout a model is built for: which tensor-parallel rank this process is, of how
many, and the collectives its layers need (`--tensor-parallel-size`).

srv hands a `ParallelContext` to a model implementation before `build` (`ModelImpl.parallel`).
With one rank (`ParallelContext()`), every collective returns its input: a model written on
`srv.sdk.layers` runs unchanged at tp=1. With more, the ranks form a torch.distributed group
(gloo on CPU): rank 0 schedules and samples, every rank computes its share of each layer.

Under `--enable-dp-attention` (`attention_data_parallel`), each rank is also a scheduler of its
own requests: attention, its KV cache, the embeddings (and the head, with `--enable-dp-lm-head`)
are whole on every rank (`attention` is the one-rank context they are built with), and the
feed-forward blocks split across the ranks as at tensor parallelism, run on every rank's rows
gathered (`all_gather_rows`). The ranks run their passes in lockstep: a rank with nothing to
compute runs an IDLE pass (`ForwardMode.IDLE`), which takes part in the same collectives.

Work is split in units that must stay together (a key/value head and the query heads that
share it, a block of quantized columns): `partition` gives the first ranks one unit more where
the count does not divide, so a model of 9 query heads in 3 groups runs on two ranks as groups
{0, 1} and {2}.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class CollectiveFailed(RuntimeError):
    """A collective that cannot finish: a rank did not arrive in time, or is gone."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a failed collective: srv's own, or gloo's (which raises a plain
    RuntimeError naming its transport)."""
    return isinstance(exc, CollectiveFailed) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None   # this stage's tensor-parallel ranks' torch.distributed ProcessGroup (None at tp=1)
    # Pipeline parallelism (--pipeline-parallel-size): this process's stage, of how many. A stage
    # holds a range of the layers (`layer_range`); each stage has tp_size ranks, and the rank of
    # stage p and tensor-parallel rank t is p * tp_size + t in the whole group.
    pp_rank: int = 0
    pp_size: int = 1
    # Seconds this process has spent in the collectives below (what benchmarks report as their share).
    collective_seconds: float = 0.0
    # A faster path for ranks that share a machine (shared memory), used instead of the group's
    # collectives when set: `all_reduce(float32 tensor)` in place, `gather(tensor)` -> every
    # rank's on rank 0; and, where it has one, `native_all_reduce` (see that method) with the
    # `native_seconds` spent in it.
    local: Any = None
    # --enable-dp-attention: every rank schedules its own requests; attention is not split.
    attention_data_parallel: bool = False
    # --enable-dp-lm-head, with it: the vocabulary head is whole on every rank too.
    dp_lm_head: bool = False
    # Point-to-point sends still in flight, with their tensors (kept alive until sent).
    _sends: list = field(default_factory=list, repr=False)

    @property
    def attention(self) -> ParallelContext:
        """The context attention layers, the KV cache and the embeddings are built with: a
        rank of its own under data-parallel attention, else this one."""
        return ParallelContext() if self.attention_data_parallel else self

    @property
    def head(self) -> ParallelContext:
        """The context the vocabulary head is built with."""
        return self.attention if self.dp_lm_head else self

    @property
    def samples(self) -> bool:
        """Whether this process samples (and so needs the whole logits of its rows): rank 0, or
        every rank under data-parallel attention."""
        return self.rank == 0 or self.attention_data_parallel

    @property
    def is_parallel(self) -> bool:
        """Whether layers are split across tensor-parallel ranks (and need their collectives)."""
        return self.tp_size > 1

    @property
    def is_pipelined(self) -> bool:
        return self.pp_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def rank(self) -> int:
        """This process's rank in the whole group (0 schedules and samples)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the layers this stage holds: the first stages one more where the
        count does not divide."""
        starts = partition_starts(num_layers, self.pp_size, 1, "pipeline stages")
        return starts[self.pp_rank], starts[self.pp_rank + 1]

    @property
    def last_stage_rank(self) -> int:
        """The rank that holds the last stage's logits (its tensor-parallel rank 0)."""
        return (self.pp_size - 1) * self.tp_size

    def expect_logits(self, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        """Rank 0 under pipeline parallelism: post the receive of one micro-batch's float32
        logits (or hidden states) from the last stage before computing; the returned call waits
        for them."""
        import torch.distributed as dist

        logits = torch.empty(shape)
        work = dist.irecv(logits, self.last_stage_rank)

        def wait() -> torch.Tensor:
            started = time.perf_counter()
            work.wait()
            self.collective_seconds += time.perf_counter() - started
            return logits

        return wait

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage: a micro-batch's logits (or hidden states) to rank 0, from the rank
        that holds them."""
        import torch.distributed as dist

        if self.rank == self.last_stage_rank:
            started = time.perf_counter()
            dist.send(logits.float().contiguous(), 0)
            self.collective_seconds += time.perf_counter() - started

    def send_to_next_stage(self, *tensors: torch.Tensor) -> None:
        """A stage's output rows (the hidden states and the residual stream) to the same
        tensor-parallel rank of the next stage, point to point. Sent in the background: the
        stage goes on to its next micro-batch (`finish_sends` waits for them)."""
        import torch.distributed as dist

        for tensor in tensors:
            tensor = tensor.contiguous()
            self._sends.append((dist.isend(tensor, self.rank + self.tp_size), tensor))

    def finish_sends(self) -> None:
        started = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self.collective_seconds += time.perf_counter() - started

    def receive_from_previous_stage(self, count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        import torch.distributed as dist

        started = time.perf_counter()
        tensors = [torch.empty(shape, dtype=dtype) for _ in range(count)]
        for tensor in tensors:
            dist.recv(tensor, self.rank - self.tp_size)
        self.collective_seconds += time.perf_counter() - started
        return tensors

    def partition(self, total: int, unit: int = 1) -> tuple[int, int]:
        """(start, size) of this rank's share of `total` items cut in units of `unit`."""
        starts = self.partition_starts(total, unit)
        return starts[self.tp_rank], starts[self.tp_rank + 1] - starts[self.tp_rank]

    def partition_starts(self, total: int, unit: int = 1) -> list[int]:
        """Every rank's start, and `total` last: rank r holds [starts[r], starts[r + 1])."""
        return partition_starts(total, self.tp_size, unit, "tensor-parallel ranks")

    def native_all_reduce(self) -> Any:
        """The all-reduce C decode layers call without Python, or None (then `all_reduce`).

        A srv.sdk.native.NativeKernel of signature `void f(const void *context, float *x, int64_t
        count)`: x summed over the ranks in place, the same bits as `all_reduce`. None at one rank,
        and where the ranks do not share memory."""
        return getattr(self.local, "native_all_reduce", None) if self.is_parallel else None

    @property
    def collective_time(self) -> float:
        """Seconds spent in collectives, the C decode layers' included.

        This context's own (`collective_seconds`) and those run through `native_all_reduce`."""
        return self.collective_seconds + getattr(self.local, "native_seconds", 0.0)

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

    def all_gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """Data-parallel attention: every rank's rows of x ([rows, features], a count of rows
        per rank, none on a rank in an IDLE pass) in rank order, on every rank, and where this
        rank's are in them. Two all-reduces: the counts, then the rows in zeroed blocks."""
        if not self.is_parallel:
            return x, slice(0, x.shape[0])
        counts = torch.zeros(self.tp_size)
        counts[self.tp_rank] = x.shape[0]
        counts = self.all_reduce(counts).long().tolist()
        widest = max(counts)
        blocks = x.new_zeros(self.tp_size, widest, *x.shape[1:])
        blocks[self.tp_rank, :x.shape[0]] = x
        blocks = self.all_reduce(blocks)   # a sum of one block and zeros: each row unchanged
        rows = torch.cat([blocks[r, :n] for r, n in enumerate(counts)])
        start = sum(counts[:self.tp_rank])
        return rows, slice(start, start + x.shape[0])

    def run_gathered(self, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """block(x) for a block whose weights split across the ranks (a feed-forward block).
        Under data-parallel attention every rank's rows are gathered, the block runs on all of
        them (adding up its partial products as at tensor parallelism) and this rank keeps its
        own; a rank in an IDLE pass brings none and still takes part."""
        if not self.attention_data_parallel:
            return block(x)
        rows, mine = self.all_gather_rows(x)
        return block(rows)[mine]

    def all_gather_columns(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, on every rank (rank r holds
        columns [starts[r], starts[r + 1])): the vocabulary head's logits, where every rank samples."""
        if not self.is_parallel:
            return x
        whole = x.new_zeros(*x.shape[:-1], starts[-1])
        whole[..., starts[self.tp_rank]:starts[self.tp_rank + 1]] = x
        return self.all_reduce(whole)

    def vocab_logits(self, head: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     starts: list[int]) -> torch.Tensor:
        """float32 logits of x's rows by the vocabulary head `head`, built with this context
        (its vocabulary ranges `starts`): whole on rank 0 (on every rank under data-parallel
        attention), each rank's own vocabulary range elsewhere."""
        if not self.attention_data_parallel:
            return self.gather(head(x).float(), starts)
        if len(starts) == 2:   # the whole vocabulary on this rank (--enable-dp-lm-head)
            return head(x).float()
        rows, mine = self.all_gather_rows(x)
        return self.all_gather_columns(head(rows).float(), starts)[mine]


def partition_starts(total: int, parts: int, unit: int = 1, what: str = "parts") -> list[int]:
    """Where each of `parts` shares of `total` items cut in units of `unit` starts, and `total`
    last; the first shares take one unit more where the count does not divide."""
    if total % unit:
        raise ValueError(f"{total} items do not cut into units of {unit}")
    units = total // unit
    if units < parts:
        raise ValueError(f"{units} units of {unit} cannot be shared by {parts} {what}")
    base, extra = divmod(units, parts)
    starts = [0]
    for part in range(parts):
        starts.append(starts[-1] + (base + (part < extra)) * unit)
    return starts
