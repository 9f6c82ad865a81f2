"""The all-to-all token exchange (`--moe-a2a-backend all_to_all`) on torch.distributed.

Each rank of the tensor-parallel group takes its share of the batch's tokens, sends each of
their routes (the token's row, the route's weight and expert) to the rank that holds the expert,
runs the routes it receives through its own experts, and sends the results back, where each
token's routes are added up; an all-gather then gives every rank the whole batch again, as the
attention layers that follow expect. A route crosses the group once each way, instead of every
rank running every token. Each expert must be whole on one rank: --ep-size equals
--tensor-parallel-size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from srv.sdk.moe import DispatchedTokens, ExpertWeights, MoEDispatcher
from srv.sdk.parallel import ParallelContext, partition_starts


@dataclass
class Exchange:
    """What `combine` needs to bring a dispatch's results back."""

    tokens: int            # the batch's
    start: int             # this rank's share of it: [start, start + count)
    count: int
    token_of_route: torch.Tensor   # the share's token of each sent route, in the order sent
    sent: list[int]        # routes sent to each rank
    received: list[int]    # routes received from each rank


class AllToAllDispatcher(MoEDispatcher):
    def __init__(self, server_args=None) -> None:
        super().__init__(server_args)
        self.ep_size = int(getattr(server_args, "expert_parallel_size", 1) or 1)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
                 parallel: ParallelContext) -> DispatchedTokens:
        ranks = parallel.tp_size
        if ranks == 1:
            return DispatchedTokens(x, weights, ids)
        if self.ep_size != ranks:
            raise ValueError(f"--moe-a2a-backend all_to_all needs --ep-size equal to --tensor-parallel-size "
                             f"({self.ep_size} and {ranks}): each expert whole on one rank")
        import torch.distributed as dist

        tokens, top_k = ids.shape
        base, extra = divmod(tokens, ranks)
        count = base + (parallel.tp_rank < extra)
        start = parallel.tp_rank * base + min(parallel.tp_rank, extra)
        expert_starts = torch.tensor(partition_starts(experts.num_experts, ranks, what="expert-parallel ranks")[1:-1])
        share_ids = ids[start:start + count].flatten()
        owner = torch.bucketize(share_ids, expert_starts, right=True)
        order = owner.argsort(stable=True)
        sent = torch.bincount(owner, minlength=ranks)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=parallel.group)
        sent_list, received_list = sent.tolist(), received.tolist()
        token_of_route = order // top_k
        hidden = x.shape[1]
        # One message per pair of ranks: the row, the route's weight and its expert id (exact as a
        # float32 below 2**24).
        payload = torch.empty(order.shape[0], hidden + 2)
        payload[:, :hidden] = x[start:start + count][token_of_route]
        payload[:, hidden] = weights[start:start + count].flatten()[order]
        payload[:, hidden + 1] = share_ids[order].float()
        inbox = torch.empty(sum(received_list), hidden + 2)
        started = time.perf_counter()
        dist.all_to_all_single(inbox, payload, received_list, sent_list, group=parallel.group)
        parallel.collective_seconds += time.perf_counter() - started
        return DispatchedTokens(inbox[:, :hidden].to(x.dtype), inbox[:, hidden:hidden + 1],
                                inbox[:, hidden + 1:].long(),
                                Exchange(tokens, start, count, token_of_route, sent_list, received_list))

    def combine(self, out: torch.Tensor, dispatched: DispatchedTokens, parallel: ParallelContext) -> torch.Tensor:
        exchange: Exchange | None = dispatched.state
        if exchange is None:
            return out
        import torch.distributed as dist

        started = time.perf_counter()
        returned = torch.empty(sum(exchange.sent), out.shape[1])
        dist.all_to_all_single(returned, out.float().contiguous(), exchange.sent, exchange.received,
                               group=parallel.group)
        ranks = parallel.tp_size
        width = -(-exchange.tokens // ranks)
        share = torch.zeros(width, out.shape[1])
        share.index_add_(0, exchange.token_of_route, returned)
        shares = [torch.empty_like(share) for _ in range(ranks)]
        dist.all_gather(shares, share, group=parallel.group)
        parallel.collective_seconds += time.perf_counter() - started
        base, extra = divmod(exchange.tokens, ranks)
        whole = torch.cat([part[:base + (rank < extra)] for rank, part in enumerate(shares)])
        return whole.to(out.dtype)

