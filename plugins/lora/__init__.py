"""LoRA backends (`--lora-backend`)."""

from srv.sdk import Availability, hookimpl, requires_c_compiler, requires_cuda

SRV_SDK_VERSION = ">=0.1,<0.2"


def needs_gpu(name: str):
    def check() -> Availability:
        cuda = requires_cuda()
        return Availability.no(f"{name} runs SGLang's CUDA kernels: {cuda.reason}") if not cuda.ok else cuda
    return check


@hookimpl
def srv_register_lora_backends(register):
    register("cpu", "srv.plugins.lora.cpu_backend:CPULoRABackend", priority=20, available=requires_c_compiler,
             description="srv's C kernel: a layer's adapters in one call, and a C kernel per layer for the fused "
                         "decode steps")
    register("torch", "srv.plugins.lora.torch_backend:TorchLoRABackend", priority=10,
             description="each adapter's rows gathered, two matmuls, added back (segmented grouped products)")
    for name in ("triton", "csgmv"):
        register(name, "srv.plugins.lora.torch_backend:GPUOnlyLoRABackend",
                 description=f"SGLang's {name} LoRA kernels: GPU only", available=needs_gpu(name))
