"""Conformance kits for plugin authors: srv's checks, run on your backend in your test suite.

Subclass the kit of your backend's family in a test module (a class named Test...), name your
backend, and pytest runs every check of the kit on it::

    from srv.sdk.testing import SchedulePolicyKit

    class TestShortestJobFirst(SchedulePolicyKit):
        backend_name = "sjf"         # as registered by your plugin (found like `srv launch` does)

| kit | family | set | compares with |
| --- | --- | --- | --- |
| AttentionBackendKit | attention | backend_name or backend_factory | torch_native |
| SamplerKit | sampling | backend_name or sampler_factory | pytorch |
| EvictionPolicyKit | eviction_policy | backend_name or policy_factory | (contract only) |
| HiCacheStorageKit | hicache_storage | backend_name or storage_factory, make_config | (contract only) |
| KVEventPublisherKit | kv_events_publisher | backend_name or publisher_factory, make_config | (contract only) |
| GrammarBackendKit | grammar | backend_name or backend_factory | the grammar (jsonschema, re) |
| ToolCallParserKit | tool_call_parser | backend_name or parser_factory | its own format_calls |
| ReasoningParserKit | reasoning_parser | backend_name or parser_factory | its own format |
| LoRABackendKit | lora_backend | backend_name or backend_factory | the plain products (float64) |
| MoERunnerKit | moe_runner | backend_name or backend_factory | srv.sdk.moe.run_experts_reference |
| EPLBAlgorithmKit | eplb_algorithm | backend_name or backend_factory | srv.sdk.moe.rank_utilization |
| SchedulePolicyKit | schedule_policy | backend_name or policy_factory | (contract only) |
| ModelLoaderKit | load_format | backend_name or loader_factory, make_checkpoint | transformers |
| ModelImplKit | model_impl | backend_name or impl_factory, make_model_dir | transformers |
| QuantizationMethodKit | quantization | backend_name or method_factory, make_weight | the float32 layer |
| SpeculativeAlgorithmKit | speculative_algorithm | backend_name or algorithm_factory, engine_flags | transformers (greedy) |
| WarmupKit | warmup | warmup_name or warmup_factory | (contract only) |

Installing srv also installs a pytest plugin (`srv.sdk.testing.pytest_plugin`) with the
fixtures `srv_tiny_model_dir` and `srv_engine_factory`. This package needs pytest (and torch).
"""

from __future__ import annotations

import pytest

# The kits' plain `assert`s get pytest's detailed messages (registered before they are imported).
pytest.register_assert_rewrite(*(f"{__name__}.{m}" for m in ("attention", "cache", "grammar", "hicache_storage",
                                                             "models", "lora", "moe", "quantization", "reasoning",
                                                             "sampling", "scheduling", "speculative", "tools",
                                                             "warmup")))

from srv.sdk.testing.attention import AttentionBackendKit  # noqa: E402
from srv.sdk.testing.cache import EvictionPolicyKit  # noqa: E402
from srv.sdk.testing.grammar import GrammarBackendKit  # noqa: E402
from srv.sdk.testing.hicache_storage import HiCacheStorageKit  # noqa: E402
from srv.sdk.testing.kv_events import KVEventPublisherKit  # noqa: E402
from srv.sdk.testing.lora import LoRABackendKit  # noqa: E402
from srv.sdk.testing.models import ModelImplKit, ModelLoaderKit  # noqa: E402
from srv.sdk.testing.moe import EPLBAlgorithmKit, MoERunnerKit  # noqa: E402
from srv.sdk.testing.quantization import QuantizationMethodKit  # noqa: E402
from srv.sdk.testing.reasoning import ReasoningParserKit  # noqa: E402
from srv.sdk.testing.registry import registered_temporarily  # noqa: E402
from srv.sdk.testing.sampling import SamplerKit  # noqa: E402
from srv.sdk.testing.scheduling import SchedulePolicyKit  # noqa: E402
from srv.sdk.testing.speculative import SpeculativeAlgorithmKit  # noqa: E402
from srv.sdk.testing.tools import ToolCallParserKit  # noqa: E402
from srv.sdk.testing.warmup import WarmupKit  # noqa: E402
from srv.sdk.testing.tiny_model import (hf_greedy, random_prompts, save_tiny_tokenizer, tiny_llama,  # noqa: E402
                                        write_tiny_llama)

__all__ = [
    "AttentionBackendKit",
    "EPLBAlgorithmKit",
    "EvictionPolicyKit",
    "GrammarBackendKit",
    "HiCacheStorageKit",
    "KVEventPublisherKit",
    "LoRABackendKit",
    "ModelImplKit",
    "ModelLoaderKit",
    "MoERunnerKit",
    "QuantizationMethodKit",
    "ReasoningParserKit",
    "SamplerKit",
    "SchedulePolicyKit",
    "SpeculativeAlgorithmKit",
    "ToolCallParserKit",
    "WarmupKit",
    "hf_greedy",
    "random_prompts",
    "registered_temporarily",
    "save_tiny_tokenizer",
    "tiny_llama",
    "write_tiny_llama",
]
