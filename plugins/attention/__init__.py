"""Attention backends (`--attention-backend`, `--prefill-attention-backend`, `--decode-attention-backend`)."""

from srv.sdk import all_of, hookimpl, requires_c_compiler, requires_cpu_flags

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_attention_backends(register):
    register("torch_native", "srv.plugins.attention.torch_native:TorchNativeAttention",
             description="reference: one SDPA per request over its gathered KV cache")
    register("intel_amx", "srv.plugins.attention.cpu_attention:CPUAttention",
             description="batched CPU backend: prefill and decode in C kernels that read the KV cache in "
                         "place, a KV head's keys once for all its query heads",
             available=all_of(requires_cpu_flags("avx2", "fma", "f16c"), requires_c_compiler), priority=10)
