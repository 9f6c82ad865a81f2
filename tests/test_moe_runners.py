"""The MoE runners pass srv's conformance kit (srv.sdk.testing.MoERunnerKit); the fused C
runner's portable kernels (no vector instructions) give what the vectorised ones give."""

from __future__ import annotations

import pytest
import torch

import srv.plugins.moe.fused_cpu as fused_cpu
from srv.sdk.moe import Routing, select_experts
from srv.sdk.testing import MoERunnerKit
from srv.sdk.testing.moe import random_experts


class TestTorchRunner(MoERunnerKit):
    backend_name = "torch"


class TestFusedCPURunner(MoERunnerKit):
    backend_name = "fused_cpu"


@pytest.fixture
def c_only(monkeypatch):
    # Every batch through the C kernel (larger ones go to torch's products by default).
    monkeypatch.setattr(fused_cpu, "TORCH_ROWS_PER_EXPERT", 10 ** 9)


class TestFusedCPURunnerInC(MoERunnerKit):
    backend_factory = fused_cpu.FusedCPURunner

    @pytest.fixture(autouse=True)
    def _c_only(self, c_only):
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
def test_portable_kernels_match_the_vectorised_ones(dtype, c_only):
    generator = torch.Generator().manual_seed(0)
    experts = random_experts(generator, 8, 0, 8, dtype)
    x = torch.randn(37, 64, generator=generator)
    x = x if dtype == "int8" else x.to(dtype)
    weights, ids = select_experts(torch.randn(37, 8, generator=generator), Routing(2))
    runner = fused_cpu.FusedCPURunner()
    best = runner.run(x, weights, ids, experts)
    try:
        fused_cpu.set_isa("portable")
        portable = runner.run(x, weights, ids, experts)
    finally:
        fused_cpu.set_isa(None)
    assert (portable.float() - best.float()).abs().max() <= 1e-5 * best.float().abs().max()
