"""MoE expert runners (`--moe-runner-backend`) and token exchanges between expert-parallel ranks
(`--moe-a2a-backend`)."""

from srv.sdk import Availability, hookimpl, requires_c_compiler, requires_cuda

SRV_SDK_VERSION = ">=0.1,<0.2"

# SGLang's GPU runners and what each runs on.
GPU_RUNNERS = {
    "triton": "SGLang's Triton fused MoE kernels",
    "triton_kernel": "OpenAI's triton_kernels MoE",
    "deep_gemm": "DeepGEMM's grouped FP8 GEMMs (Hopper)",
    "cutlass": "CUTLASS grouped GEMMs",
    "flashinfer_trtllm": "FlashInfer's TensorRT-LLM MoE kernels (Blackwell)",
    "flashinfer_cutlass": "FlashInfer's CUTLASS MoE kernels",
    "flashinfer_mxfp4": "FlashInfer's MXFP4 MoE kernels (Blackwell)",
    "flashinfer_cutedsl": "FlashInfer's CuTe DSL MoE kernels (Blackwell)",
}
GPU_EXCHANGES = {
    "deepep": "DeepEP's NVLink/RDMA all-to-all kernels",
    "mooncake": "Mooncake's RDMA expert-parallel transfer engine",
    "ascend_fuseep": "Huawei Ascend's fused expert-parallel operators",
}


def needs_gpu(what: str):
    def check() -> Availability:
        cuda = requires_cuda()
        return Availability.no(f"{what} need a GPU: {cuda.reason}") if not cuda.ok else \
            Availability.no(f"{what} are not ported to srv yet")
    return check


def needs_ascend(what: str):
    def check() -> Availability:
        return Availability.no(f"{what} need an Ascend NPU (torch_npu)")
    return check


@hookimpl
def srv_register_moe_runner_backends(register):
    register("fused_cpu", "srv.plugins.moe.fused_cpu:FusedCPURunner", priority=20, available=requires_c_compiler,
             description="srv's C runner: routes grouped by expert, gate/up, activation, down and the weighted "
                         "scatter of every expert in one call (float32, bf16, int8)")
    register("torch", "srv.sdk.moe:ReferenceRunner", priority=10,
             description="the reference: tokens sorted by expert, one grouped product per expert (torch matmul)")
    for name, what in GPU_RUNNERS.items():
        register(name, "srv.plugins.moe.gpu_only:GPUOnlyRunner", description=f"{what}: GPU only",
                 available=needs_gpu(what))


@hookimpl
def srv_register_moe_a2a_backends(register):
    register("none", "srv.sdk.moe:AllReduceDispatcher", priority=10,
             description="every rank runs every token through its experts; one all-reduce adds the parts")
    register("all_to_all", "srv.plugins.moe.all_to_all:AllToAllDispatcher", priority=5,
             description="each rank sends its share of the tokens to the ranks holding their experts and back "
                         "(torch.distributed all_to_all_single), then all-gathers the batch")
    for name, what in GPU_EXCHANGES.items():
        register(name, "srv.plugins.moe.gpu_only:GPUOnlyDispatcher", description=f"{what}: accelerator only",
                 available=needs_ascend(what) if name == "ascend_fuseep" else needs_gpu(what))


@hookimpl
def srv_register_eplb_algorithms(register):
    register("deepseek", "srv.plugins.moe.eplb:GlobalBalancer", priority=20,
             description="copies for the busiest experts, then the copies spread over all expert-parallel ranks, "
                         "busiest first to the least loaded")
    register("deepseek_hierarchical", "srv.plugins.moe.eplb:HierarchicalBalancer", priority=10,
             description="each expert group kept on one node (groups balanced over nodes), then each node "
                         "balanced as deepseek over its own ranks")
