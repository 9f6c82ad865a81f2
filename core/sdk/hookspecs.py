"""The hooks a plugin may implement.

Every backend family has one registration hook, `srv_register_<family>(register)`. A plugin
calls `register(name, factory, description=..., available=..., priority=...)` once per
backend it provides; see `srv.sdk.Registration` for what each argument means. Two lifecycle
hooks let a plugin bring its own launch flags and HTTP routes.

Implement a hook with the `srv.sdk.hookimpl` decorator in a module named by an entry point
in the `srv` group of your package's pyproject.toml.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import pluggy

PROJECT_NAME = "srv"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[..., None]


@dataclass(frozen=True)
class Family:
    """One kind of backend a launch flag chooses between."""

    name: str
    hook: str
    description: str
    flags: tuple[str, ...]


FAMILIES: tuple[Family, ...] = (
    Family("attention", "srv_register_attention_backends", "attention kernels",
           ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")),
    Family("sampling", "srv_register_sampling_backends", "token samplers", ("--sampling-backend",)),
    Family("quantization", "srv_register_quantization_methods", "weight quantization methods",
           ("--quantization",)),
    Family("kv_cache_dtype", "srv_register_kv_cache_dtypes", "KV cache storage formats",
           ("--kv-cache-dtype",)),
    Family("moe_runner", "srv_register_moe_runner_backends", "MoE expert runners",
           ("--moe-runner-backend", "--speculative-moe-runner-backend")),
    Family("moe_a2a", "srv_register_moe_a2a_backends", "MoE all-to-all communication",
           ("--moe-a2a-backend", "--speculative-moe-a2a-backend")),
    Family("eplb_algorithm", "srv_register_eplb_algorithms", "expert-parallel load balancing algorithms",
           ("--eplb-algorithm",)),
    Family("grammar", "srv_register_grammar_backends", "constrained decoding engines",
           ("--grammar-backend",)),
    Family("eviction_policy", "srv_register_eviction_policies", "prefix-cache eviction policies",
           ("--radix-eviction-policy",)),
    Family("hicache_storage", "srv_register_hicache_storage_backends",
           "hierarchical-cache storage backends", ("--hicache-storage-backend",)),
    Family("kv_events_publisher", "srv_register_kv_events_publishers",
           "KV cache event publishers (the \"publisher\" of the JSON config)", ("--kv-events-config",)),
    Family("speculative_algorithm", "srv_register_speculative_algorithms",
           "speculative decoding algorithms", ("--speculative-algorithm",)),
    Family("model_impl", "srv_register_model_impls", "model implementations", ("--model-impl",)),
    Family("load_format", "srv_register_load_formats", "model weight loaders", ("--load-format",)),
    Family("schedule_policy", "srv_register_schedule_policies", "request scheduling policies",
           ("--schedule-policy",)),
    Family("lora_backend", "srv_register_lora_backends", "multi-LoRA kernels", ("--lora-backend",)),
    Family("warmup", "srv_register_warmups", "server warm-ups run before it listens", ("--warmups",)),
    Family("tool_call_parser", "srv_register_tool_call_parsers", "tool-call formats in model output",
           ("--tool-call-parser",)),
    Family("reasoning_parser", "srv_register_reasoning_parsers", "reasoning formats in model output",
           ("--reasoning-parser",)),
)

FAMILIES_BY_NAME = {family.name: family for family in FAMILIES}


@hookspec
def srv_register_attention_backends(register: Register) -> None:
    """Register attention backends (`--attention-backend` and its per-phase variants).

    factory(num_heads, num_kv_heads, head_dim, scale) -> srv.sdk.attention.AttentionBackend
    """


@hookspec
def srv_register_sampling_backends(register: Register) -> None:
    """Register samplers (`--sampling-backend`).

    factory(server_args) -> srv.sdk.sampling.Sampler
    """


@hookspec
def srv_register_quantization_methods(register: Register) -> None:
    """Register weight quantization methods (`--quantization`).

    factory(server_args) -> srv.sdk.quantization.QuantizationMethod
    """


@hookspec
def srv_register_kv_cache_dtypes(register: Register) -> None:
    """Register KV cache storage formats (`--kv-cache-dtype`).

    factory(server_args) -> srv.sdk.attention.KVCacheDtype
    """


@hookspec
def srv_register_moe_runner_backends(register: Register) -> None:
    """Register MoE expert runners (`--moe-runner-backend`).

    factory(server_args) -> srv.sdk.moe.MoERunner
    """


@hookspec
def srv_register_moe_a2a_backends(register: Register) -> None:
    """Register MoE all-to-all dispatchers (`--moe-a2a-backend`).

    factory(server_args) -> srv.sdk.moe.MoEDispatcher
    """


@hookspec
def srv_register_kv_events_publishers(register: Register) -> None:
    """Register KV cache event publishers (`--kv-events-config '{"publisher": NAME, ...}'`).

    factory(config: dict, data_parallel_rank: int) -> srv.sdk.kv_events.KVEventPublisher
    """


@hookspec
def srv_register_warmups(register: Register) -> None:
    """Register warm-ups (`--warmups a,b`, run in order before the server listens).

    factory(server_args) -> srv.sdk.warmup.Warmup
    """


@hookspec
def srv_register_eplb_algorithms(register: Register) -> None:
    """Register expert-parallel load balancing algorithms (`--eplb-algorithm`).

    factory(server_args) -> srv.sdk.moe.EPLBAlgorithm
    """


@hookspec
def srv_register_grammar_backends(register: Register) -> None:
    """Register constrained-decoding engines (`--grammar-backend`).

    factory(vocabulary: GrammarVocabulary, options: GrammarOptions) -> srv.sdk.grammar.GrammarBackend
    """


@hookspec
def srv_register_eviction_policies(register: Register) -> None:
    """Register prefix-cache eviction policies (`--radix-eviction-policy`).

    factory() -> srv.sdk.cache.EvictionPolicy
    """


@hookspec
def srv_register_hicache_storage_backends(register: Register) -> None:
    """Register hierarchical-cache storage backends (`--hicache-storage-backend`).

    factory(config: srv.sdk.cache.HiCacheStorageConfig) -> srv.sdk.cache.HiCacheStorage
    """


@hookspec
def srv_register_speculative_algorithms(register: Register) -> None:
    """Register speculative decoding algorithms (`--speculative-algorithm`).

    factory(context: srv.sdk.speculative.SpeculativeContext) -> srv.sdk.speculative.SpeculativeAlgorithm
    """


@hookspec
def srv_register_model_impls(register: Register) -> None:
    """Register model implementations (`--model-impl`).

    factory(server_args) -> srv.sdk.models.ModelImpl
    """


@hookspec
def srv_register_load_formats(register: Register) -> None:
    """Register model weight loaders (`--load-format`).

    factory(server_args) -> srv.sdk.models.ModelLoader
    """


@hookspec
def srv_register_schedule_policies(register: Register) -> None:
    """Register request scheduling policies (`--schedule-policy`).

    factory(server_args) -> srv.sdk.scheduling.SchedulePolicy
    """


@hookspec
def srv_register_lora_backends(register: Register) -> None:
    """Register multi-LoRA kernels (`--lora-backend`).

    factory(server_args) -> srv.sdk.lora.LoRABackend
    """


@hookspec
def srv_register_tool_call_parsers(register: Register) -> None:
    """Register tool-call formats (`--tool-call-parser`) for /v1/chat/completions with `tools`.

    factory() -> srv.sdk.tools.ToolCallParser
    """


@hookspec
def srv_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning formats (`--reasoning-parser`): `reasoning_content` of chat responses
    and /separate_reasoning.

    factory() -> srv.sdk.reasoning.ReasoningParser
    """


@hookspec
def srv_add_launch_arguments(parser: argparse._ArgumentGroup) -> None:
    """Add a plugin's own flags to `srv launch`.

    `parser` is an argparse argument group titled after the plugin; call `add_argument` on it.
    The parsed values reach every factory through `server_args`.
    """


@hookspec
def srv_register_routes(register: Register) -> None:
    """Add HTTP routes to the server.

    Call `register(path, endpoint, methods=["GET"])` where `endpoint` is a Starlette endpoint
    (an async function taking a Request and returning a Response).
    """
