"""srv's expert-parallel load balancing algorithms (`--eplb-algorithm`), after DeepSeek's
published EPLB policies.

`deepseek` balances over every rank at once: the extra copies go one at a time to the expert
with the most tokens per copy, then the copies, busiest first, to the rank with the fewest
tokens that has a free slot (preferring one without a copy of that expert).

`deepseek_hierarchical` keeps each expert group on one node, so a grouped router's tokens stay
within it: the groups, busiest first, go to the node with the fewest tokens that has room for
a group, then each node balances its own experts over its own slots and ranks as `deepseek`
does.
"""

from __future__ import annotations

from srv.sdk.moe import EPLBAlgorithm
from srv.sdk.parallel import partition_starts


def balance_layer(load: list[float], num_physical: int, ranks: int) -> list[int]:
    """physical_to_logical of one layer for tokens per expert `load`, over every rank."""
    experts = len(load)
    if num_physical < experts:
        raise ValueError(f"{num_physical} expert slots cannot hold {experts} experts")
    starts = partition_starts(num_physical, ranks, what="expert-parallel ranks")
    capacity = [b - a for a, b in zip(starts, starts[1:])]
    load = [value + 1e-9 for value in load]   # an expert no token chose still needs its slot
    copies = [1] * experts
    for _ in range(num_physical - experts):
        busiest = max(range(experts), key=lambda e: load[e] / copies[e])
        copies[busiest] += 1
    slots = sorted(((load[e] / copies[e], e) for e in range(experts) for _ in range(copies[e])),
                   key=lambda slot: (-slot[0], slot[1]))
    held: list[list[int]] = [[] for _ in range(ranks)]
    totals = [0.0] * ranks
    for share, expert in slots:
        # Prefer a rank without a copy of this expert, then the least loaded.
        rank = min((r for r in range(ranks) if len(held[r]) < capacity[r]),
                   key=lambda r: (expert in held[r], totals[r], r))
        held[rank].append(expert)
        totals[rank] += share
    return [e for rank_slots in held for e in rank_slots]


class GlobalBalancer(EPLBAlgorithm):
    def plan(self, counts, num_physical, ranks, nodes=1, groups=1):
        return [balance_layer(counts[layer].double().tolist(), num_physical, ranks) for layer in range(counts.shape[0])]


class HierarchicalBalancer(EPLBAlgorithm):
    def plan(self, counts, num_physical, ranks, nodes=1, groups=1):
        layers, experts = counts.shape
        for what, value in (("expert groups", groups), ("physical expert slots", num_physical),
                            ("expert-parallel ranks", ranks)):
            if value % nodes:
                raise ValueError(f"--eplb-algorithm deepseek_hierarchical: {value} {what} do not split over "
                                 f"{nodes} nodes (--eplb-algorithm deepseek balances over all ranks)")
        if experts % groups:
            raise ValueError(f"--eplb-algorithm deepseek_hierarchical: {experts} experts do not form {groups} groups")
        group_size, node_slots, node_ranks = experts // groups, num_physical // nodes, ranks // nodes
        if node_slots < (groups // nodes) * group_size:
            raise ValueError(f"{num_physical} expert slots cannot hold {experts} experts")
        placement = []
        for layer in range(layers):
            load = counts[layer].double().tolist()
            group_load = [sum(load[g * group_size:(g + 1) * group_size]) for g in range(groups)]
            members: list[list[int]] = [[] for _ in range(nodes)]
            totals = [0.0] * nodes
            for group in sorted(range(groups), key=lambda g: (-group_load[g], g)):
                node = min((n for n in range(nodes) if len(members[n]) < groups // nodes),
                           key=lambda n: (totals[n], n))
                members[node].append(group)
                totals[node] += group_load[group]
            row = []
            for node in range(nodes):
                logical = [g * group_size + i for g in sorted(members[node]) for i in range(group_size)]
                local = balance_layer([load[e] for e in logical], node_slots, node_ranks)
                row += [logical[e] for e in local]
            placement.append(row)
        return placement
