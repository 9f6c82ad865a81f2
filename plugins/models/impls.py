"""srv's model implementations (`--model-impl`), built lazily from the plugin's registrations."""

from __future__ import annotations

from srv.sdk.models import ModelConfig, ModelImpl


class NativeModels(ModelImpl):
    """srv's own implementations of the Llama family (Llama, SmolLM2, Qwen2, Qwen3) and its
    mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""

    tensor_parallel = True

    def supports(self, config: ModelConfig) -> bool:
        from srv.plugins.models import llama, mixture_of_experts

        return llama.supports(config) or mixture_of_experts.supports(config)

    def build(self, config: ModelConfig):
        from srv.plugins.models import mixture_of_experts

        if mixture_of_experts.supports(config):
            return mixture_of_experts.MoEForCausalLM(config, self.parallel, self.moe)
        from srv.plugins.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config, self.parallel)

    def finalize(self, model) -> None:
        from srv.sdk.moe import FusedMoE
        from srv.sdk.packed_linear import pack_linear_layers

        pack_linear_layers(model)
        for module in model.modules():
            if isinstance(module, FusedMoE):
                module.experts()   # the experts in their memory and the runner's layout now, while loading


class TransformersModels(ModelImpl):
    """Any Hugging Face causal LM, as transformers builds it, with its attention on srv's KV
    cache; and encoder models (BERT and the like), served for their embeddings."""

    def supports(self, config: ModelConfig) -> bool:
        from srv.plugins.models import transformers_encoder, transformers_impl

        return self.is_generation(config) or transformers_encoder.supports(config.hf())

    def is_generation(self, config: ModelConfig) -> bool:
        from srv.plugins.models import transformers_impl

        return transformers_impl.supports(config.hf(), config.trust_remote_code)

    def build(self, config: ModelConfig):
        if self.is_generation(config):
            from srv.plugins.models.transformers_impl import TransformersModel

            return TransformersModel(config.hf(), config.trust_remote_code)
        from srv.plugins.models.transformers_encoder import TransformersEncoder

        return TransformersEncoder(config.hf())
