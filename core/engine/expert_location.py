"""Where a MoE model's experts live across expert-parallel ranks: `--ep-num-redundant-experts`
copies of the busiest experts, placed by `--init-expert-location` (SGLang's flags).

`trivial` keeps expert e in slot e and gives the redundant slots experts 0, 1, ... in turn. A
file (a `/dump_expert_distribution_record` dump, or JSON) gives either the placement itself
(`physical_to_logical_map`, one list of slots a layer) or the tokens each expert of each layer
received (`logical_count`, or the `logical_count_of_pass` of a per_pass dump), from which the
`--eplb-algorithm` plugin plans one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from srv.sdk.moe import EPLBAlgorithm, ExpertPlacement, config_num_experts

logger = logging.getLogger("srv.engine")


def placement_span(args: Any, config: Any) -> tuple[int, int]:
    """(nodes the expert-parallel ranks span, expert groups of the model's grouped routing)."""
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    nodes = max(1, args.expert_parallel_size * args.nnodes // world)
    return nodes, int(getattr(config, "n_group", None) or 1)


def read_location(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    record = torch.load(path, weights_only=True)
    if not isinstance(record, dict):
        raise ValueError(f"--init-expert-location {path}: not a dict of placements or counts")
    return record


def expert_placement(args: Any, config: Any, algorithm: EPLBAlgorithm) -> ExpertPlacement | None:
    """The placement the launch asks for, or None for one copy of each expert in order; one
    planned from a dump's counts is `algorithm`'s (--eplb-algorithm)."""
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
            placement = algorithm.plan(counts, num_physical, args.expert_parallel_size, *placement_span(args, config))
    if any(not 0 <= e < experts for row in placement for e in row):
        raise ValueError(f"--init-expert-location {location}: names an expert outside 0..{experts - 1}")
    logger.info("expert placement: %d slots for %d experts a layer (%s)", num_physical, experts, location)
    return ExpertPlacement(placement)
