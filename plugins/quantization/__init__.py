"""Built-in quantization plugin: `--quantization gguf`, a GGUF file's 4-bit and 8-bit weights
computed by torch's CPU weight-only int4 kernel."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_quantization_methods(register):
    register("gguf", "srv.plugins.quantization.gguf:GGUFQuantization",
             description="a .gguf file's Q4_1 and Q8_0 weights as they are, on torch's int4 CPU kernel for "
                         "batches under 32 rows", priority=10)
