"""Mixture-of-experts layers: routing, the expert runner (`--moe-runner-backend`) and the token
exchange between expert-parallel ranks (`--moe-a2a-backend`).

A model implementation builds a `FusedMoE` for each sparse block and calls it with the block's
input and its router's logits:

    router logits --select_experts--> top-k weights and expert ids per token
                  --dispatcher.dispatch--> the rows this rank computes
                  --runner.run--> the weighted sum of the chosen experts this rank holds
                  --dispatcher.combine--> every expert's sum for every token

Expert parallelism (`--ep-size` E, which divides `--tensor-parallel-size` T) gives each of E
groups of T/E ranks a contiguous range of the experts; within a group each expert's
intermediate features are split as a tensor-parallel MLP's are. With the `none` dispatcher every
rank sees every token, and the ranks' partial sums are added up by one all-reduce.

The expert weights are an `ExpertWeights`: gate and up projections fused ([experts, 2 *
intermediate, hidden], gate rows first) and the down projection ([experts, hidden,
intermediate]), in the served dtype, or int8 with per-output-channel float32 scales where a
quantization method claims the layer (`FusedMoE.quantize_int8`). A runner may repack them once in
`prepare`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from srv.sdk.linear import load_weight
from srv.sdk.native import in_huge_pages
from srv.sdk.parallel import ParallelContext, partition_starts

ACTIVATIONS = ("silu", "gelu")


def config_num_experts(config: Any) -> int:
    """The routed experts a model's config declares (0 for a dense model), whichever of the
    published spellings it uses (Mixtral's, Qwen-MoE's and OLMoE's, DeepSeek's)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 0


@dataclass(frozen=True)
class Routing:
    """How a block's router picks each token's experts, as the model's config says.

    scoring: "softmax" (Mixtral, Qwen-MoE, OLMoE) or "sigmoid" (DeepSeek-V3) of the logits, in
    float32. `num_expert_group` and `topk_group`: grouped top-k (the experts in groups, the best
    `topk_group` groups by their two best scores with a correction bias, or their best without,
    and the top-k within those). `renormalize`: the chosen weights rescaled to sum to one.
    `routed_scaling_factor` multiplies the final weights."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"routing scoring must be softmax or sigmoid, not {self.scoring!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, not {self.top_k}")


def select_experts(router_logits: torch.Tensor, routing: Routing,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, expert ids [tokens, top_k] int64) for router logits
    [tokens, experts]; the ids of a token are in descending order of score. The correction bias
    (DeepSeek-V3's) steers which experts are chosen, not their weights."""
    num_experts = router_logits.shape[-1]
    if routing.top_k > num_experts:
        raise ValueError(f"top_k {routing.top_k} exceeds the {num_experts} experts")
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_expert_group:
        groups = routing.num_expert_group
        grouped = choice.view(choice.shape[0], groups, num_experts // groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if correction_bias is not None \
            else grouped.max(dim=-1).values
        best = group_scores.topk(routing.topk_group or groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~mask.repeat_interleave(num_experts // groups, dim=1), float("-inf"))
    weights, ids = choice.topk(routing.top_k, dim=-1)
    if correction_bias is not None:
        weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


@dataclass
class ExpertWeights:
    """One MoE layer's experts as this rank holds them.

    w13: [local experts, 2 * intermediate, hidden], each expert's gate rows then its up rows;
    w2: [local experts, hidden, intermediate]. `start` is the global id of local expert 0 and
    `num_experts` the global count (of physical slots, where a placement replicates some): a
    route to an expert outside [start, start + local) is another rank's. With int8 weights, `w13_scale` [local, 2 * intermediate] and `w2_scale`
    [local, hidden] are each output channel's float32 scale. `packed` is the runner's to fill in
    `prepare` (its own layout of the same weights)."""

    w13: torch.Tensor
    w2: torch.Tensor
    start: int
    num_experts: int
    activation: str = "silu"
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    packed: dict[str, Any] = field(default_factory=dict)

    @property
    def local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def is_int8(self) -> bool:
        return self.w13.dtype == torch.int8

    def dequantized(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of local expert `expert` in float32."""
        w13, w2 = self.w13[expert], self.w2[expert]
        if self.is_int8:
            return w13.float() * self.w13_scale[expert, :, None], w2.float() * self.w2_scale[expert, :, None]
        return w13, w2


def activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of gate-up products [rows, 2 * intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


def run_experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                          experts: ExpertWeights) -> torch.Tensor:
    """The reference sum: tokens sorted by expert, each expert's rows through its gate-up,
    activation and down products in one go, weighted and added back per token (in x's dtype;
    int8 weights' products scaled per output channel). Routes to other ranks' experts add nothing."""
    out = torch.zeros_like(x)
    local = ids - experts.start
    held = (local >= 0) & (local < experts.local_experts)
    if not bool(held.any()):
        return out
    flat = torch.where(held, local, experts.local_experts).flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts.local_experts + 1).tolist()
    token_of = order // ids.shape[1]
    route_weight = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts[:-1]):
        if count:
            rows = token_of[start:start + count]
            gathered = x[rows]
            if x.dtype != torch.float32:
                gathered = F.pad(gathered, (0, 0, 0, padded_rows(count) - count))
            # int8 weights are exact in either float dtype: the products take them as they are,
            # and each output channel's scale multiplies the sums.
            w13, w2 = experts.w13[expert].to(x.dtype), experts.w2[expert].to(x.dtype)
            gate_up = gathered @ w13.t()
            if experts.is_int8:
                gate_up = gate_up * experts.w13_scale[expert].to(x.dtype)
            hidden = activate(gate_up, experts.activation) @ w2.t()
            if experts.is_int8:
                hidden = hidden * experts.w2_scale[expert].to(x.dtype)
            out.index_add_(0, rows, hidden[:count] * route_weight[start:start + count, None].to(x.dtype))
        start += count
    return out


def padded_rows(count: int) -> int:
    """The row count an expert's products run at in a bf16 or fp16 batch: oneDNN compiles a
    kernel for each new shape of such a product (a millisecond or more each), and every expert of
    every prefill chunk has a row count of its own, so the counts are rounded up to a few sizes
    (powers of two to 16, then multiples of 32). Padding rows are zeros and are dropped; float32
    products compile nothing per shape and run unpadded."""
    if count <= 16:
        return 1 << (count - 1).bit_length()
    return -(-count // 32) * 32


class MoERunner(ABC):
    """An expert runner (`--moe-runner-backend`): computes, for each token, the weighted sum of
    its chosen experts' outputs over the experts this rank holds.

    The factory takes the server arguments. `run` is called with x [tokens, hidden] in the
    served dtype, the weights [tokens, top_k] (float32) and global expert ids [tokens, top_k]
    (int64) of `select_experts`, and the layer's `ExpertWeights`; it returns [tokens, hidden] in
    x's dtype. Ids may name experts another rank holds (they add nothing), several tokens may
    choose one expert, an expert may have no token. The kit (`srv.sdk.testing.MoERunnerKit`)
    compares it with `run_experts_reference`."""

    # The weight formats `run` takes: "float" (the served dtype) and "int8" (per-channel scales).
    weight_formats: frozenset[str] = frozenset({"float"})

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    def prepare(self, experts: ExpertWeights) -> None:
        """Called once per layer after the weights are loaded and cast: repack them into
        `experts.packed` (optional)."""

    @abstractmethod
    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        ...


@dataclass
class DispatchedTokens:
    """The rows a rank runs through its experts, with their routes, and what the dispatcher
    needs to bring the results back (`state`)."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    state: Any = None


class MoEDispatcher(ABC):
    """The exchange of tokens between expert-parallel ranks (`--moe-a2a-backend`).

    `dispatch` takes every token of this rank's batch with its routes and returns the rows this
    rank's experts compute; `combine` takes the runner's output for them and returns each of
    the batch's tokens' sum over all the ranks' experts, on every rank of the tensor-parallel
    group. At one rank both are the identity."""

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    @abstractmethod
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
                 parallel: ParallelContext) -> DispatchedTokens:
        ...

    @abstractmethod
    def combine(self, out: torch.Tensor, dispatched: DispatchedTokens, parallel: ParallelContext) -> torch.Tensor:
        ...


class ReferenceRunner(MoERunner):
    """`run_experts_reference` as a runner: what a model uses when srv hands it no runner."""

    weight_formats = frozenset({"float", "int8"})

    def run(self, x, weights, ids, experts):
        return run_experts_reference(x, weights, ids, experts)


class AllReduceDispatcher(MoEDispatcher):
    """Every rank runs every token; the partial sums are added by one all-reduce."""

    def dispatch(self, x, weights, ids, experts, parallel):
        return DispatchedTokens(x, weights, ids)

    def combine(self, out, dispatched, parallel):
        return parallel.all_reduce(out)


@dataclass
class ExpertPlacement:
    """Where each layer's experts live when some are replicated (`--ep-num-redundant-experts`):
    `physical_to_logical[layer][slot]` is the logical expert that physical slot holds. The slots
    split across expert-parallel ranks as experts do without replicas; a route to a replicated
    expert goes to one of its copies, chosen by the token's row (so the copies share the load)."""

    physical_to_logical: list[list[int]]

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical[0])

    def replica_table(self, layer: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [experts, most copies] of each logical expert, padded with its first; copies
        [experts]) of layer `layer`."""
        slots: list[list[int]] = [[] for _ in range(num_experts)]
        for slot, logical in enumerate(self.physical_to_logical[layer]):
            slots[logical].append(slot)
        missing = [e for e, s in enumerate(slots) if not s]
        if missing:
            raise ValueError(f"the expert placement of layer {layer} holds no copy of experts {missing[:8]}")
        width = max(len(s) for s in slots)
        # On the CPU even while a model is built on the meta device: the routes index them.
        table = torch.tensor([s + [s[0]] * (width - len(s)) for s in slots], device="cpu")
        return table, torch.tensor([len(s) for s in slots], device="cpu")


class EPLBAlgorithm(ABC):
    """An expert-parallel load balancing algorithm (`--eplb-algorithm`): where each layer's
    experts go, given the tokens each one received.

    The factory takes the server arguments. `plan` takes counts [layers, experts] (tokens routed
    to each logical expert), the physical slots of a layer (experts plus
    --ep-num-redundant-experts), the expert-parallel ranks (rank r holds the r-th run of
    consecutive slots, split as `partition_starts` splits them), the nodes those ranks span
    (consecutive ranks share a node) and the expert groups of the model's grouped routing
    (consecutive experts; 1 where it has none). It returns each layer's physical_to_logical,
    holding every expert at least once. A placement it cannot make for these numbers raises
    ValueError, naming why. The kit (`srv.sdk.testing.EPLBAlgorithmKit`) checks placements and
    that they spread a skewed load."""

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    @abstractmethod
    def plan(self, counts: torch.Tensor, num_physical: int, ranks: int, nodes: int = 1,
             groups: int = 1) -> list[list[int]]:
        ...


def rank_utilization(counts: torch.Tensor, physical_to_logical: list[list[int]], ranks: int) -> float:
    """How evenly a placement spreads the routed tokens over the expert-parallel ranks: the mean
    over the layers that routed any of (mean tokens a rank / most tokens a rank), where an
    expert's tokens split evenly over its copies. 1.0 is perfect balance, 1/ranks one busy rank."""
    starts = partition_starts(len(physical_to_logical[0]), ranks, what="expert-parallel ranks")
    rates = []
    for layer, slots in enumerate(physical_to_logical):
        load = counts[layer].double()
        if float(load.sum()) <= 0:
            continue
        copies = torch.bincount(torch.tensor(slots), minlength=load.numel()).double()
        share = load / copies.clamp(min=1)
        per_rank = torch.stack([share[torch.tensor(slots[a:b], dtype=torch.int64)].sum() for a, b in zip(starts, starts[1:])])
        rates.append(float(per_rank.mean() / per_rank.max()))
    return sum(rates) / len(rates) if rates else 1.0


@dataclass
class MoEBackends:
    """What srv hands a model implementation for its MoE layers (`ModelImpl.moe`): the chosen
    runner and dispatcher and the expert-parallel size. The default (no MoE flags, one rank)
    runs the reference."""

    runner: MoERunner = field(default_factory=ReferenceRunner)
    dispatcher: MoEDispatcher = field(default_factory=AllReduceDispatcher)
    ep_size: int = 1
    placement: ExpertPlacement | None = None
    # --enable-eplb: each layer keeps every expert's weights in host memory, so that a new
    # placement (`FusedMoE.place`) can put any expert in any of its slots without a transfer.
    rebalancing: bool = False
    # Called with (layer id, expert ids [tokens, top_k]) of every MoE layer's forward pass when
    # set: the expert distribution recorder's tap.
    on_routed: Any = None
    # --moe-dense-tp-size 1: the model's dense feed-forward layers are whole on every rank
    # (built with a one-rank ParallelContext), not split; None splits them as the rest.
    dense_tp_size: int | None = None


class FusedMoE(nn.Module):
    """A sparse block's experts, as this rank holds them: `forward(x, router_logits)` returns the
    routed experts' weighted sum for every token (the shared experts, if the model has any, are
    the model's own layers).

    Checkpoint tensors load through `load_expert(expert, shard, tensor)`, shard 0, 1, 2 being the
    expert's gate, up and down projections in Hugging Face's [out, in] layout; it cuts this
    rank's part and returns False for another rank's expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: Routing,
                 parallel: ParallelContext | None = None, backends: MoEBackends | None = None,
                 activation: str = "silu", layer_id: int = 0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {activation!r} is not one of {ACTIVATIONS}")
        self.parallel = parallel = parallel or ParallelContext()
        self.backends = backends = backends or MoEBackends()
        self.routing, self.activation, self.layer_id = routing, activation, layer_id
        self.num_experts, self.hidden_size = num_experts, hidden_size
        placement = backends.placement
        # Physical expert slots: one a logical expert, and the replicas of a placement.
        self.slot_logical = list(placement.physical_to_logical[layer_id]) if placement is not None \
            else list(range(num_experts))
        self.replicas = placement.replica_table(layer_id, num_experts) if placement is not None else None
        ep_size = backends.ep_size
        if parallel.tp_size % ep_size:
            raise ValueError(f"--ep-size {ep_size} must divide --tensor-parallel-size {parallel.tp_size}")
        moe_tp = parallel.tp_size // ep_size
        self.ep_rank, self.moe_tp_rank = divmod(parallel.tp_rank, moe_tp)
        starts = partition_starts(len(self.slot_logical), ep_size, what="experts")
        self.expert_start = starts[self.ep_rank]
        local = starts[self.ep_rank + 1] - self.expert_start
        inter = partition_starts(intermediate_size, moe_tp, what="intermediate features")
        self.inter_start, self.inter_local = inter[self.moe_tp_rank], inter[self.moe_tp_rank + 1] - inter[self.moe_tp_rank]
        self.moe_tp = moe_tp
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * self.inter_local, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, self.inter_local), requires_grad=False)
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        # A quantized checkpoint's tensors beside its experts' weights, by name ("weight_scale",
        # "weight_scale_inv", "input_scale") and (local expert, shard), as stored: the weights'
        # values load into the float weights (exactly: int8 and float8 values are floats), and
        # the quantization method's `quantize_experts` takes both (`take_stored`).
        self.stored: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        self._experts: ExpertWeights | None = None
        # Every logical expert's weights (this rank's features), for a placement to come.
        if backends.rebalancing:
            self.register_buffer("w13_logical", torch.empty(num_experts, 2 * self.inter_local, hidden_size),
                                 persistent=False)
            self.register_buffer("w2_logical", torch.empty(num_experts, hidden_size, self.inter_local),
                                 persistent=False)

    @property
    def local_experts(self) -> int:
        return self.w13_weight.shape[0]

    def load_expert(self, name: str, expert: int, shard: int, tensor: torch.Tensor) -> bool:
        """Load checkpoint tensor `name`, shard `shard` (0 gate, 1 up, 2 down) of logical expert
        `expert` into each of this rank's copies of it; False where it has none. A quantized
        checkpoint's scales (`weight_scale`, `weight_scale_inv`, `input_scale`) are kept in
        `stored`."""
        slots = [slot - self.expert_start for slot in range(self.expert_start, self.expert_start + self.local_experts)
                 if self.slot_logical[slot] == expert]
        inter = slice(self.inter_start, self.inter_start + self.inter_local)
        kind = name.rpartition(".")[2]
        if kind.startswith(("weight_scale", "input_scale")):
            if self.moe_tp > 1 or hasattr(self, "w13_logical"):
                raise ValueError(f"{name}: experts stored quantized are not split across tensor-parallel ranks "
                                 "or placed anew (--enable-eplb) yet")
            for local in slots:
                self.stored.setdefault(kind, {})[local, shard] = tensor
            return bool(slots)
        if hasattr(self, "w13_logical"):
            if shard == 2:
                load_weight(name, self.w2_logical, self.w2_logical[expert], tensor[:, inter])
            else:
                load_weight(name, self.w13_logical,
                            self.w13_logical[expert, shard * self.inter_local:(shard + 1) * self.inter_local],
                            tensor[inter])
        for local in slots:   # each of this rank's copies of the expert
            if shard == 2:
                load_weight(name, self.w2_weight, self.w2_weight.data[local], tensor[:, inter])
            else:
                rows = self.w13_weight.data[local, shard * self.inter_local:(shard + 1) * self.inter_local]
                load_weight(name, self.w13_weight, rows, tensor[inter])
        self._experts = None
        return bool(slots) or hasattr(self, "w13_logical")

    def shard_weight(self, local: int, shard: int) -> torch.Tensor:
        """The float weight rows of local expert `local`'s shard (0 gate, 1 up, 2 down), a view."""
        if shard == 2:
            return self.w2_weight.data[local]
        return self.w13_weight.data[local, shard * self.inter_local:(shard + 1) * self.inter_local]

    def take_stored(self, kind: str) -> dict[tuple[int, int], torch.Tensor] | None:
        """The checkpoint's `kind` tensors by (local expert, shard), every one of them, now
        the method's to apply; None where the checkpoint stored none."""
        tensors = self.stored.pop(kind, None)
        if tensors is not None and len(tensors) != 3 * self.local_experts:
            raise ValueError(f"layer {self.layer_id}: the checkpoint has {kind} for {len(tensors)} of the "
                             f"{3 * self.local_experts} expert projections this rank holds")
        return tensors

    def place(self, slot_logical: list[int]) -> None:
        """Hold the experts of a new placement (--enable-eplb): slot i the copy of logical expert
        `slot_logical[i]`, this rank's slots filled from the host copy of every expert."""
        if not hasattr(self, "w13_logical"):
            raise ValueError("a new expert placement needs every expert's weights: launch with --enable-eplb")
        if len(slot_logical) != len(self.slot_logical):
            raise ValueError(f"a placement of {len(slot_logical)} slots for a layer of {len(self.slot_logical)}")
        self.slot_logical = list(slot_logical)
        self.replicas = ExpertPlacement([self.slot_logical]).replica_table(0, self.num_experts)
        mine = torch.tensor(self.slot_logical[self.expert_start:self.expert_start + self.local_experts])
        if self.w13_scale is not None:
            self.w13_int8, self.w13_scale = self._logical_int8["w13"][0][mine], self._logical_int8["w13"][1][mine]
            self.w2_int8, self.w2_scale = self._logical_int8["w2"][0][mine], self._logical_int8["w2"][1][mine]
        else:
            self.w13_weight.data = self.w13_logical[mine].contiguous()
            self.w2_weight.data = self.w2_logical[mine].contiguous()
        self._experts = None

    def quantize_int8(self, scales: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
        """Store the experts as int8 with a float32 scale per output channel (symmetric, the
        largest magnitude of a row to 127), or as a checkpoint stored them (their integer values
        in the float weights, `scales` [rows, 1] by (local expert, shard) from `take_stored`): a
        quantization method's `apply` calls it."""
        def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            weight = weight.float()
            scale = weight.abs().amax(dim=-1).clamp(min=1e-10) / 127.0
            return (weight / scale[..., None]).round().clamp(-127, 127).to(torch.int8), scale

        if scales is not None:
            rows = [torch.stack([torch.cat([scales[local, shard].float().reshape(-1) for shard in shards])
                                 for local in range(self.local_experts)]) for shards in ((0, 1), (2,))]
        for index, name in enumerate(("w13", "w2")):
            weight = getattr(self, f"{name}_weight").data
            if scales is not None:
                quantized, scale = weight.round().clamp(-128, 127).to(torch.int8), rows[index]
                if scale.shape != weight.shape[:2]:
                    raise ValueError(f"{name} scales of shape {list(scale.shape)} for weights {list(weight.shape)}")
            else:
                quantized, scale = quantize(weight)
            # Plain attributes: the cast to the served dtype must leave them as they are.
            delattr(self, f"{name}_weight")
            setattr(self, f"{name}_int8", quantized)
            setattr(self, f"{name}_scale", scale)
        if hasattr(self, "w13_logical"):
            self._logical_int8 = {name: quantize(getattr(self, f"{name}_logical")) for name in ("w13", "w2")}
            del self.w13_logical, self.w2_logical
            self.w13_logical = self.w2_logical = None   # placement reads the int8 copies
        self._experts = None

    def experts(self) -> ExpertWeights:
        """The weights as the runner takes them (built once, then prepared by the runner)."""
        if self._experts is None:
            int8 = self.w13_scale is not None
            if self.stored:
                raise ValueError(f"the checkpoint's experts are stored quantized ({', '.join(sorted(self.stored))} "
                                 "beside them): serve it with the --quantization it was made for")
            # A decode step streams every expert it routes to from memory, faster from huge pages.
            if int8:
                self.w13_int8, self.w2_int8 = in_huge_pages(self.w13_int8), in_huge_pages(self.w2_int8)
            else:
                self.w13_weight.data, self.w2_weight.data = (in_huge_pages(self.w13_weight.data),
                                                             in_huge_pages(self.w2_weight.data))
            experts = ExpertWeights(self.w13_int8 if int8 else self.w13_weight.data,
                                    self.w2_int8 if int8 else self.w2_weight.data, self.expert_start,
                                    len(self.slot_logical), self.activation, self.w13_scale, self.w2_scale)
            runner = self.backends.runner
            if ("int8" if int8 else "float") not in runner.weight_formats:
                raise ValueError(f"the MoE runner {type(runner).__name__} does not take "
                                 f"{'int8' if int8 else 'float'} expert weights")
            runner.prepare(experts)
            self._experts = experts
        return self._experts

    def _apply(self, fn, recurse=True):
        self._experts = None   # a cast or a move makes new tensors: the runner prepares them anew
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.routing, correction_bias)
        backends = self.backends
        if backends.on_routed is not None:
            backends.on_routed(self.layer_id, ids)
        if self.replicas is not None:   # each route to one copy of its expert, by the token's row
            table, copies = self.replicas
            rows = torch.arange(ids.shape[0]).unsqueeze(1)
            ids = table[ids, rows % copies[ids]]
        experts = self.experts()
        dispatched = backends.dispatcher.dispatch(x, weights, ids, experts, self.parallel)
        out = backends.runner.run(dispatched.x, dispatched.weights, dispatched.ids, experts)
        return backends.dispatcher.combine(out, dispatched, self.parallel)
