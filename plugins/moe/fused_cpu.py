"""srv's fused CPU MoE runner (`--moe-runner-backend fused_cpu`): moe_kernels.c runs a layer's
routes in one call. Batches with many rows an expert are bound by arithmetic, where torch's
matrix products (oneDNN, AMX for bf16) beat the C loops: those go to the reference's grouped
products instead (`TORCH_ROWS_PER_EXPERT`)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from srv.sdk.moe import ExpertWeights, MoERunner, run_experts_reference
from srv.sdk.native import optional_c_library

# Routes an expert (on average) from which a batch runs on torch's products (int8 weights
# widened to the rows' dtype an expert at a time): decode batches stay below it, prefill chunks
# are far above it.
TORCH_ROWS_PER_EXPERT = 8
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
ISAS = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3, "amx": 4}


class MoEArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("tokens", "top_k", "hidden", "inter", "local", "start", "weight_type", "activation")] + \
               [(name, ctypes.c_void_p) for name in
                ("w13", "w2", "w13_scale", "w2_scale", "x", "ids", "weights", "out")]


@functools.cache
def kernels() -> ctypes.CDLL | None:
    library = optional_c_library(Path(__file__).with_name("moe_kernels.c"), ("-lm",),
                                 "the fused_cpu MoE runner runs the reference's torch products")
    if library is None:
        return None
    library.srv_moe_run.argtypes = [ctypes.c_void_p]
    library.srv_moe_run.restype = ctypes.c_int
    library.srv_moe_set_isa.argtypes = [ctypes.c_int]
    return library


def set_isa(name: str | None) -> None:
    """Force the kernels' instruction set ("portable", "avx2", "avx512", "avx512_bf16", "amx"; None:
    the CPU's best)."""
    kernels().srv_moe_set_isa(-1 if name is None else ISAS[name])


class FusedCPURunner(MoERunner):
    weight_formats = frozenset({"float", "int8"})

    def prepare(self, experts: ExpertWeights) -> None:
        # The kernel reads float32, bf16 and int8 rows as they are; other float types (fp16)
        # are widened once.
        w13, w2 = experts.w13, experts.w2
        if w13.dtype not in WEIGHT_TYPES:
            w13, w2 = w13.float(), w2.float()
        experts.packed["fused_cpu"] = (w13.contiguous(), w2.contiguous())

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        library = kernels()
        if library is None or x.shape[0] == 0 or \
                ids.numel() >= TORCH_ROWS_PER_EXPERT * experts.local_experts:
            return run_experts_reference(x, weights, ids, experts)
        if "fused_cpu" not in experts.packed:
            self.prepare(experts)
        w13, w2 = experts.packed["fused_cpu"]
        rows = x.float().contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.float().contiguous()
        out = torch.zeros(rows.shape)
        scales = (experts.w13_scale.float().contiguous(), experts.w2_scale.float().contiguous()) \
            if experts.is_int8 else None
        args = MoEArgs(rows.shape[0], ids.shape[1], experts.hidden_size, experts.intermediate_size,
                       experts.local_experts, experts.start, WEIGHT_TYPES[w13.dtype],
                       0 if experts.activation == "silu" else 1, w13.data_ptr(), w2.data_ptr(),
                       scales[0].data_ptr() if scales else None, scales[1].data_ptr() if scales else None,
                       rows.data_ptr(), ids.data_ptr(), weights.data_ptr(), out.data_ptr())
        if library.srv_moe_run(ctypes.addressof(args)) != 0:
            raise MemoryError("the fused MoE kernel could not allocate its scratch rows")
        return out.to(x.dtype)
