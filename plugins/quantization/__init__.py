"""Built-in quantization plugin: `--quantization gguf`, a GGUF file's 4-bit and 8-bit weights
computed by srv's C kernels (AVX2), compiled on first use."""

from srv.sdk import all_of, hookimpl, requires_c_compiler, requires_cpu_flags

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_quantization_methods(register):
    register("gguf", "srv.plugins.quantization.gguf:GGUFQuantization",
             description="a .gguf file's Q4_1 and Q8_0 weights as they are, on srv's C kernels for "
                         "decode batches",
             available=all_of(requires_cpu_flags("avx2", "fma"), requires_c_compiler), priority=10)
