"""Built-in quantization plugins: `--quantization gguf` (a GGUF file's own blocks),
`w8a8_int8` (int8 weights and activations, int32 accumulation), `fp8` and `w8a8_fp8` (float8
weights, computed weight-only), `gptq` and `awq` (int32-packed integer groups), all on srv's C
kernels compiled on first use, and the GPU-only
methods of SGLang's list, registered with what they need."""

from srv.sdk import (Availability, all_of, hookimpl, requires_c_compiler, requires_cpu_flags, requires_cuda,
                     requires_packages)

SRV_SDK_VERSION = ">=0.1,<0.2"

# SGLang's methods whose kernels exist only for NVIDIA or AMD GPUs (Marlin, CUTLASS, Triton
# fp8 and fp4 GEMMs): selectable by name, refused with what they need.
GPU_ONLY = {
    "marlin": "Marlin int4 GEMM kernels (CUDA, compute capability 8.0+)",
    "modelopt": "NVIDIA ModelOpt fp8 kernels (CUDA, compute capability 8.9+)",
    "modelopt_fp4": "NVIDIA fp4 tensor cores (CUDA, compute capability 10.0+)",
    "petit_nvfp4": "Petit's nvfp4 kernels for AMD Instinct GPUs (ROCm, MI200 or MI300)",
    "mxfp4": "mxfp4 GEMM kernels (CUDA compute capability 9.0+, or ROCm MI300+)",
    "qoq": "QoQ's W4A8 CUDA kernels (compute capability 8.0+)",
    "w4afp8": "W4A8-fp8 CUTLASS kernels (CUDA, compute capability 9.0+)",
    "moe_wna16": "fused MoE WNA16 Triton kernels (CUDA)",
}


def needs_gpu(name: str, what: str):
    def check() -> Availability:
        if not requires_cuda().ok:
            return Availability.no(f"needs {what}; torch sees no GPU")
        return Availability.no(f"needs {what}; srv has no {name} kernels yet")
    return check


@hookimpl
def srv_register_quantization_methods(register):
    register("gguf", "srv.plugins.quantization.gguf:GGUFQuantization",
             description="a .gguf file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K) read from the file, "
                         "on srv's C kernels for decode batches",
             available=all_of(requires_cpu_flags("avx2", "fma"), requires_c_compiler), priority=10)
    register("w8a8_int8", "srv.plugins.quantization.w8a8_int8:W8A8Int8Quantization",
             description="int8 weights per channel, int8 activations per token, int32 products "
                         "(AVX512-VNNI, AVX2 or portable C; oneDNN for large batches); reads SGLang's "
                         "and compressed-tensors' int8 checkpoints, quantizes float ones at load",
             available=requires_c_compiler, priority=5)
    register("fp8", "srv.plugins.quantization.fp8:Fp8Quantization",
             description="float8 e4m3 weights (per-tensor, per-channel or block scales) computed weight-only: "
                         "Fp8Config and compressed-tensors checkpoints, float ones quantized at load",
             available=requires_c_compiler, priority=4)
    register("w8a8_fp8", "srv.plugins.quantization.fp8:W8A8Fp8Quantization",
             description="SGLang's w8a8_fp8 checkpoints (per-channel float8 weights), computed weight-only: "
                         "no CPU has float8 arithmetic, so activations stay in the served dtype",
             available=requires_c_compiler)
    for name, factory in (("gptq", "GPTQQuantization"), ("awq", "AWQQuantization")):
        what = {"gptq": "GPTQ (2, 4 and 8 bits, desc_act included) and compressed-tensors pack-quantized",
                "awq": "AutoAWQ's 4-bit GEMM"}[name]
        register(name, f"srv.plugins.quantization.packed_int:{factory}",
                 description=f"{what} checkpoints, int32-packed groups; decode on gguf's Q4_1/Q8_0 AVX2 kernels, "
                             "larger batches dequantized; float checkpoints quantized at load (4-bit groups)",
                 available=requires_c_compiler, priority=3 if name == "gptq" else 0)
        register(f"{name}_marlin", f"srv.plugins.quantization.packed_int:{factory}",
                 description=f"SGLang's name for {name} on Marlin's CUDA kernels: here the same CPU code as {name}",
                 available=requires_c_compiler)
    register("bitsandbytes", "srv.plugins.quantization.bitsandbytes_method:BitsAndBytesQuantization",
             description="bitsandbytes' 4-bit checkpoints (NF4, FP4, double quantization), or a float one made NF4 "
                         "at load, on bitsandbytes' own (CPU) kernels",
             available=requires_packages("bitsandbytes"))
    register("torchao", "srv.plugins.quantization.torchao_configs:TorchAOQuantization",
             description="--torchao-config int8wo, int8dq, int4wo-<group>, fp8wo: torchao's CPU kernels on a float "
                         "checkpoint quantized at load (chosen by the flag)",
             priority=100)   # no availability check: with the flag set, a missing torchao must fail loudly
    for name, what in GPU_ONLY.items():
        register(name, "srv.plugins.quantization.gpu_only:GPUOnlyQuantization",
                 description=f"SGLang's {name}: GPU kernels only",
                 available=needs_gpu(name, what))
