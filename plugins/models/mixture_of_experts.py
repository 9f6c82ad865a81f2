"""Mixture-of-experts decoders on srv's Llama layers: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Their attention is the Llama family's (Qwen2-MoE with Qwen2's biases, Qwen3-MoE with Qwen3's
per-head norms, OLMoE with norms over the whole query and key projections); their feed-forward
blocks are sparse: a router scores the experts, each token runs through its top-k
(srv.sdk.moe.FusedMoE, on the runner the launch chose), Qwen2-MoE adds a shared expert scaled by
a sigmoid gate of its own. Qwen's configs may keep some layers dense (`mlp_only_layers`,
`decoder_sparse_step`); `--moe-dense-tp-size 1` keeps those whole on every rank.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from srv.sdk.moe import FusedMoE, MoEBackends, Routing, config_num_experts
from srv.sdk.parallel import ParallelContext
from srv.plugins.models.llama import MLP, LlamaForCausalLM

ARCHITECTURES = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"}
# An expert's projections as checkpoints name them -> FusedMoE's shard (0 gate, 1 up, 2 down).
EXPERT_SHARDS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}
# (A quantized checkpoint adds each projection's scales: `weight_scale`, `weight_scale_inv`,
# `input_scale`.)
PER_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale\w*|input_scale)$")
# transformers 5's in-memory layout: every expert's gate and up rows in one tensor, its downs in another.
STACKED = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def supports(config: Any) -> bool:
    return any(a in ARCHITECTURES for a in (getattr(config, "architectures", None) or []))


def routing(config: Any) -> Routing:
    # Mixtral always rescales its top-k weights to one; the others as their config says.
    renormalize = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
    return Routing(top_k=config.num_experts_per_tok, renormalize=renormalize)


def is_sparse(config: Any, layer: int) -> bool:
    """Qwen-MoE's dense layers: those in mlp_only_layers, and all but every decoder_sparse_step-th."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


class SparseMoeBlock(nn.Module):
    """The router, the routed experts and (Qwen2-MoE) the gated shared expert."""

    def __init__(self, config: Any, layer: int, parallel: ParallelContext, backends: MoEBackends) -> None:
        super().__init__()
        # The router (and the shared expert's gate) is replicated on every rank, and stays in the
        # served dtype under any quantization (`unquantized`): its scores pick the experts.
        self.gate = nn.Linear(config.hidden_size, config_num_experts(config), bias=False)
        self.gate.unquantized = True
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        activation = getattr(config, "hidden_act", "silu")
        self.experts = FusedMoE(config_num_experts(config), config.hidden_size, intermediate, routing(config), parallel,
                                backends, "gelu" if activation.startswith("gelu") else activation, layer)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = MLP(config, parallel, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None
        if shared:
            self.shared_expert_gate.unquantized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers' feed-forward blocks are SparseMoeBlocks."""

    def __init__(self, config: Any, parallel: ParallelContext | None = None, moe: MoEBackends | None = None) -> None:
        self.moe = moe or MoEBackends()   # read by build_mlp, which the base constructor calls
        super().__init__(config, parallel)

    def build_mlp(self, config: Any, layer: int, parallel: ParallelContext) -> nn.Module:
        if is_sparse(config, layer):
            return SparseMoeBlock(config, layer, parallel, self.moe)
        return MLP(config, ParallelContext() if self.moe.dense_tp_size == 1 else parallel)

    def rename(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")   # Mixtral's checkpoint names

    def load_other(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        match = PER_EXPERT.match(name)
        if match is not None and match.group(3) in EXPERT_SHARDS:
            prefix, expert, projection, kind = match.groups()
            layer: FusedMoE = self.get_submodule(prefix)
            layer.load_expert(name, int(expert), EXPERT_SHARDS[projection], tensor)
            if kind != "weight":
                return []
            return [f"{prefix}.w13_weight" if EXPERT_SHARDS[projection] < 2 else f"{prefix}.w2_weight"]
        match = STACKED.match(name)
        if match is not None:
            prefix, projection = match.groups()
            layer = self.get_submodule(prefix)
            for expert in range(tensor.shape[0]):
                if projection == "down_proj":
                    layer.load_expert(name, expert, 2, tensor[expert])
                else:
                    gate, up = tensor[expert].chunk(2, dim=0)
                    layer.load_expert(name, expert, 0, gate)
                    layer.load_expert(name, expert, 1, up)
            return [f"{prefix}.w13_weight" if projection == "gate_up_proj" else f"{prefix}.w2_weight"]
        return None
