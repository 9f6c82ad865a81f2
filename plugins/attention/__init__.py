"""Attention backends (`--attention-backend`, `--prefill-attention-backend`, `--decode-attention-backend`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_attention_backends(register):
    register("torch_native", "srv.plugins.attention.torch_native:TorchNativeAttention",
             description="reference: one SDPA per request over its gathered KV cache")
    register("intel_amx", "srv.plugins.attention.padded_sdpa:PaddedSDPAAttention",
             description="batched CPU backend: the ragged batch as one padded SDPA (bf16 runs on AMX via oneDNN)",
             priority=10)
