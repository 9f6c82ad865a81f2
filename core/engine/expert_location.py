"""Where a MoE model's experts live across expert-parallel ranks: `--ep-num-redundant-experts`
copies of the busiest experts, placed by `--init-expert-location` (SGLang's flags).

`trivial` keeps expert e in slot e and gives the redundant slots experts 0, 1, ... in turn. A
file (a `/dump_expert_distribution_record` dump, or JSON) gives either the placement itself
(`physical_to_logical_map`, one list of slots a layer) or the tokens each expert of each layer
received (`logical_count`, or the `logical_count_of_pass` of a per_pass dump), from which srv
plans one: the extra copies go one at a time to the expert with the most tokens per copy, then
the copies, busiest first, to the rank with the fewest tokens that has a free slot.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from srv.sdk.moe import ExpertPlacement, config_num_experts
from srv.sdk.parallel import partition_starts

logger = logging.getLogger("srv.engine")


def plan_placement(counts: torch.Tensor, num_physical: int, ranks: int) -> list[list[int]]:
    """physical_to_logical of each layer, for tokens per expert `counts` [layers, experts]."""
    layers, experts = counts.shape
    if num_physical < experts:
        raise ValueError(f"{num_physical} expert slots cannot hold {experts} experts")
    starts = partition_starts(num_physical, ranks, what="expert-parallel ranks")
    capacity = [b - a for a, b in zip(starts, starts[1:])]
    placement = []
    for layer in range(layers):
        load = counts[layer].double() + 1e-9   # an expert no token chose still needs its slot
        copies = [1] * experts
        for _ in range(num_physical - experts):
            busiest = max(range(experts), key=lambda e: float(load[e]) / copies[e])
            copies[busiest] += 1
        slots = sorted(((float(load[e]) / copies[e], e) for e in range(experts) for _ in range(copies[e])),
                       key=lambda slot: (-slot[0], slot[1]))
        held: list[list[int]] = [[] for _ in range(ranks)]
        totals = [0.0] * ranks
        for share, expert in slots:
            # Prefer a rank without a copy of this expert, then the least loaded.
            rank = min((r for r in range(ranks) if len(held[r]) < capacity[r]),
                       key=lambda r: (expert in held[r], totals[r], r))
            held[rank].append(expert)
            totals[rank] += share
        placement.append([e for rank_slots in held for e in rank_slots])
    return placement


def read_location(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    record = torch.load(path, weights_only=True)
    if not isinstance(record, dict):
        raise ValueError(f"--init-expert-location {path}: not a dict of placements or counts")
    return record


def expert_placement(args: Any, config: Any) -> ExpertPlacement | None:
    """The placement the launch asks for, or None for one copy of each expert in order."""
    redundant, location = args.ep_num_redundant_experts or 0, args.init_expert_location or "trivial"
    if redundant < 0:
        raise ValueError(f"--ep-num-redundant-experts must be at least 0, not {redundant}")
    if not redundant and location == "trivial":
        return None
    experts, layers = config_num_experts(config), config.num_hidden_layers
    num_physical = experts + redundant
    if location == "trivial":
        placement = [list(range(experts)) + [i % experts for i in range(redundant)] for _ in range(layers)]
    else:
        record = read_location(Path(location))
        if "physical_to_logical_map" in record:
            placement = [list(map(int, row)) for row in torch.as_tensor(record["physical_to_logical_map"]).tolist()]
            if len(placement) != layers or any(len(row) != num_physical for row in placement):
                raise ValueError(f"--init-expert-location {location}: physical_to_logical_map must be {layers} layers "
                                 f"of {num_physical} slots (experts + --ep-num-redundant-experts)")
        else:
            if "logical_count" in record:
                counts = torch.as_tensor(record["logical_count"])
            elif record.get("logical_count_of_pass"):
                counts = torch.stack([torch.as_tensor(p) for p in record["logical_count_of_pass"]]).sum(0)
            else:
                raise ValueError(f"--init-expert-location {location}: has neither physical_to_logical_map nor "
                                 "logical_count")
            if tuple(counts.shape) != (layers, experts):
                raise ValueError(f"--init-expert-location {location}: logical_count is {list(counts.shape)}, "
                                 f"not [{layers}, {experts}]")
            placement = plan_placement(counts, num_physical, args.expert_parallel_size)
    if any(not 0 <= e < experts for row in placement for e in row):
        raise ValueError(f"--init-expert-location {location}: names an expert outside 0..{experts - 1}")
    logger.info("expert placement: %d slots for %d experts a layer (%s)", num_physical, experts, location)
    return ExpertPlacement(placement)
