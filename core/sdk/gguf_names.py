"""How a GGUF file names a model's tensors, against Hugging Face's names: what a GGUF loader and
a quantization method reading the file's blocks both need."""

from __future__ import annotations

from typing import Any

# GGUF name (before ".weight" or ".bias") -> Hugging Face module
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts (Qwen2-MoE, Qwen3-MoE): the router, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# GGUF's stacked experts ([experts, rows, columns] in one tensor) -> each expert's projection
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
SKIPPED = {"rope_freqs"}  # llama.cpp's precomputed rotary factors: no HF parameter


def hf_expert_name(gguf_name: str, expert: int) -> str | None:
    """`blk.3.ffn_gate_exps.weight`, expert 5 -> `model.layers.3.mlp.experts.5.gate_proj.weight`;
    None for a tensor that holds no stacked experts."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{expert}.{EXPERT_NAMES[parts[2]]}.{suffix}"
    return None


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors HF lacks
    (and for stacked experts, which `hf_expert_name` names one by one)."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in EXPERT_NAMES:
        return None
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{suffix}"
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    if base in SKIPPED:
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def hf_row_order(gguf_name: str, rows: Any, arch: str, config: dict[str, Any]) -> Any:
    """A GGUF tensor's rows (an array, first dimension the outputs: floats, or the bytes of each
    row's blocks) in Hugging Face's order: llama.cpp stores Llama's query and key projections
    with each head's rotary pairs interleaved, which transformers' GGUF loader undoes into two
    halves (biases too)."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if arch != "llama" or kind not in ("attn_q", "attn_k"):
        return rows
    heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def hf_names(gguf_names: Any) -> dict[str, str]:
    """Hugging Face name -> GGUF name, for the tensors that have one."""
    names = {}
    for gguf_name in gguf_names:
        try:
            hf = hf_name(gguf_name)
        except ValueError:
            continue
        if hf is not None:
            names[hf] = gguf_name
    return names
