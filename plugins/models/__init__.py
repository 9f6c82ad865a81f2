"""Model plugins: srv's native architectures (`--model-impl`) and weight loaders (`--load-format`)."""

from __future__ import annotations

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_model_impls(register):
    description = "srv's native layers (Llama, Qwen2, Qwen3; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on srv's KV cache"
    register("srv", "srv.plugins.models.impls:NativeModels", description=description, priority=10)
    register("sglang", "srv.plugins.models.impls:NativeModels",
             description="SGLang's name for the native implementation: same as srv")
    register("transformers", "srv.plugins.models.impls:TransformersModels", priority=0,
             description="any Hugging Face causal LM through transformers' AttentionInterface on srv's KV cache; "
                         "encoders (BERT and the like) for embeddings")


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
