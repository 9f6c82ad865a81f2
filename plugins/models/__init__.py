"""Model plugins: srv's native architectures (`--model-impl`) and weight loaders (`--load-format`)."""

from __future__ import annotations

from typing import Any

from srv.sdk import hookimpl
from srv.sdk.models import ModelImpl

SRV_SDK_VERSION = ">=0.1,<0.2"


class NativeModels(ModelImpl):
    """srv's own implementations of the Llama family (Llama, SmolLM2, Qwen2, Qwen3)."""

    def supports(self, config: Any) -> bool:
        from srv.plugins.models.llama import supports

        return supports(config)

    def build(self, config: Any):
        from srv.plugins.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config)

    def finalize(self, model) -> None:
        from srv.plugins.models.packed_linear import pack_linear_layers

        pack_linear_layers(model)


class TransformersModels(ModelImpl):
    """Any Hugging Face causal LM, as transformers builds it, with its attention on srv's KV cache."""

    def supports(self, config: Any) -> bool:
        from srv.plugins.models.transformers_impl import supports

        return supports(config)

    def build(self, config: Any):
        from srv.plugins.models.transformers_impl import TransformersModel

        return TransformersModel(config)


@hookimpl
def srv_register_model_impls(register):
    description = "srv's native layers (Llama, Qwen2, Qwen3) on srv's KV cache"
    register("srv", NativeModels, description=description, priority=10)
    register("sglang", NativeModels, description="SGLang's name for the native implementation: same as srv")
    register("transformers", TransformersModels, priority=0,
             description="any Hugging Face causal LM through transformers' AttentionInterface on srv's KV cache")


@hookimpl
def srv_register_load_formats(register):
    register("safetensors", "srv.plugins.models.loaders:SafetensorsLoader",
             description="*.safetensors files of a Hugging Face directory", priority=30)
    register("gguf", "srv.plugins.models.loaders:GGUFLoader",
             description="a .gguf file, dequantized once into a cache keyed by the file's hash", priority=20)
    register("pt", "srv.plugins.models.loaders:PtLoader",
             description="*.bin / *.pt PyTorch files, read with torch.load(weights_only=True)", priority=10)
    register("dummy", "srv.plugins.models.loaders:DummyLoader",
             description="random weights from config.json (profiling, tests)")
