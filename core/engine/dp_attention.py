"""Data-parallel attention (`--enable-dp-attention`): each data-parallel group's scheduler
process is one rank of a torch.distributed group (gloo on CPU, shared memory between ranks on
one machine). Each rank schedules its own requests, with its own KV cache and prefix cache, and
computes attention whole; the feed-forward blocks split across the ranks and run on every rank's
rows (see srv.sdk.parallel).

The ranks' passes must pair up, collective for collective, so they go in rounds: before each
pass a rank says whether it computes (`agree`), and a rank that ran no pass in a scheduler step
ends the step with a round of its own (`ModelRunner.idle_round`). Where any rank computes, the
others run an IDLE pass beside it; where none does, nobody runs one. A rank that shuts down says
so in a last round, and the others exit when they see it (the server is stopping them too).
"""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from datetime import timedelta

import torch

from srv.engine.shm_collectives import SharedMemoryCollectives, create_segment
from srv.sdk.parallel import ParallelContext

logger = logging.getLogger("srv.dp_attention")

# A scheduler whose group idles waits for a message between rounds, twice as long after each
# round in which no rank computed, from the first to the last: how long a rank that gets a
# request may wait for the others to join its first pass, against the CPU an idle group spends.
FIRST_IDLE_POLL_S, LAST_IDLE_POLL_S = 0.001, 0.05


class DataParallelAttention:
    """This scheduler's rank among the data-parallel attention ranks, and the rounds they keep."""

    def __init__(self, args: Namespace, rank: int, address: str) -> None:
        import torch.distributed as dist

        size = args.data_parallel_size
        timeout = timedelta(seconds=args.dist_timeout) if args.dist_timeout else timedelta(minutes=10)
        logger.info("data-parallel attention rank %d of %d: joining the group at %s", rank, size, address)
        shared = not args.disable_custom_all_reduce
        segment = address.replace(":", "-") + "-dp-attention"
        if shared and rank == 0:   # before the group forms: the others map it once it has
            create_segment(segment, size)
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=timeout)
        local = SharedMemoryCollectives(segment, rank, size, timeout.total_seconds()) if shared else None
        if shared:
            dist.barrier()
            if rank == 0:
                SharedMemoryCollectives.unlink(segment)
        self.rank, self.size = rank, size
        self.context = ParallelContext(rank, size, dist.group.WORLD, local=local, attention_data_parallel=True,
                                       dp_lm_head=bool(args.enable_dp_lm_head))
        self.others_compute = False   # in the last round: whether another rank ran a pass
        self.idle_rounds = 0   # rounds in a row in which no rank computed
        self.closed = False

    def agree(self, computes: bool, stopping: bool = False) -> bool:
        """One round: whether any rank computes a pass now. A rank that sees another stopping
        exits."""
        flags = torch.zeros(2, self.size)
        flags[0, self.rank], flags[1, self.rank] = float(computes), float(stopping)
        flags = self.context.all_reduce(flags)
        if not stopping and flags[1].sum() > 0:
            logger.info("data-parallel attention rank %d: another rank stopped; exiting", self.rank)
            os._exit(0)
        computing = int(flags[0].sum())
        self.others_compute = computing > int(computes)
        self.idle_rounds = 0 if computing else self.idle_rounds + 1
        return computing > 0

    @property
    def poll_s(self) -> float:
        """How long this scheduler may wait for a message before its next round."""
        if self.others_compute:
            return 0.0
        return min(LAST_IDLE_POLL_S, FIRST_IDLE_POLL_S * 2 ** min(self.idle_rounds, 16))

    def send(self, name: str, **payload: object) -> None:
        """No commands travel between these ranks: each runs its own scheduler."""

    def close(self) -> None:
        """The last round: the other ranks learn that this one stops."""
        if self.closed:
            return
        self.closed = True
        import torch.distributed as dist

        self.agree(False, stopping=True)
        dist.destroy_process_group()
