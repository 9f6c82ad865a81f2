"""Conformance kits for MoE expert runners (`--moe-runner-backend`) and expert-parallel load
balancing algorithms (`--eplb-algorithm`)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from srv.sdk.moe import (EPLBAlgorithm, ExpertWeights, MoERunner, Routing, rank_utilization, run_experts_reference,
                         select_experts)
from srv.sdk.testing.registry import create

HIDDEN, INTER = 64, 48
# Relative to the largest output: float32 sums in another order, bf16's 8 bits over two products.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, "int8": 1e-5}


def random_experts(generator: torch.Generator, local: int, start: int, total: int, dtype: Any,
                   activation: str = "silu") -> ExpertWeights:
    """`local` experts of `total`, the first being global expert `start`; dtype "int8": int8
    weights with a scale per output row."""
    w13 = torch.randn(local, 2 * INTER, HIDDEN, generator=generator) * 0.2
    w2 = torch.randn(local, HIDDEN, INTER, generator=generator) * 0.2
    if dtype != "int8":
        return ExpertWeights(w13.to(dtype), w2.to(dtype), start, total, activation)
    scales = [w.abs().amax(-1) / 127 for w in (w13, w2)]
    q13, q2 = ((w / s[..., None]).round().to(torch.int8) for w, s in zip((w13, w2), scales))
    return ExpertWeights(q13, q2, start, total, activation, *scales)


class MoERunnerKit:
    """Checks a MoE runner against `srv.sdk.moe.run_experts_reference`: random routes, a token
    routed to no expert this rank holds (zeros), every token to one expert, top-k above the
    experts this rank holds, an expert without tokens, one row and a few hundred, float32,
    bfloat16 and (where `weight_formats` has it) int8 weights, both activations; the output has
    x's shape and dtype and the inputs are left alone.

        class TestMyRunner(MoERunnerKit):
            backend_name = "myrunner"          # the name your plugin registers, or:
            # backend_factory = MyRunner       # (server_args) -> MoERunner
    """

    backend_name: str | None = None
    backend_factory: Callable[[Any], MoERunner] | None = None

    def make_runner(self) -> MoERunner:
        return create(self, "moe_runner", "backend_name", "backend_factory", None)

    def check(self, runner: MoERunner, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              experts: ExpertWeights, dtype: Any) -> torch.Tensor:
        runner.prepare(experts)
        before = (x.clone(), weights.clone(), ids.clone())
        expected = run_experts_reference(x.float() if dtype == "int8" else x, weights, ids, experts)
        out = runner.run(x, weights, ids, experts)
        assert out.shape == x.shape and out.dtype == x.dtype, "the output has x's shape and dtype"
        assert all(torch.equal(a, b) for a, b in zip(before, (x, weights, ids))), "the inputs are left alone"
        scale = float(expected.float().abs().max()) or 1.0
        error = float((out.float() - expected.float()).abs().max())
        assert error <= TOLERANCE[dtype] * scale, f"off the reference by {error:.3g} (largest output {scale:.3g})"
        return out

    def formats(self) -> list[Any]:
        runner = self.make_runner()
        return [torch.float32, torch.bfloat16] + (["int8"] if "int8" in runner.weight_formats else [])

    def x_for(self, dtype: Any, tokens: int, generator: torch.Generator) -> torch.Tensor:
        x = torch.randn(tokens, HIDDEN, generator=generator)
        return x if dtype == "int8" else x.to(dtype)

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("tokens", [1, 7, 300])
    @pytest.mark.parametrize("activation", ["silu", "gelu"])
    def test_random_routes_match_the_reference(self, tokens: int, activation: str) -> None:
        for dtype in self.formats():
            generator = torch.Generator().manual_seed(tokens)
            experts = random_experts(generator, 8, 0, 8, dtype, activation)
            weights, ids = select_experts(torch.randn(tokens, 8, generator=generator), Routing(2, renormalize=True))
            self.check(self.make_runner(), self.x_for(dtype, tokens, generator), weights, ids, experts, dtype)

    def test_routes_to_other_ranks_experts_add_nothing(self) -> None:
        for dtype in self.formats():
            generator = torch.Generator().manual_seed(1)
            # This rank holds experts 4-7 of 8: token 0 chose two of them, token 1 none, token 2 one.
            experts = random_experts(generator, 4, 4, 8, dtype)
            ids = torch.tensor([[5, 7], [0, 3], [2, 6]])
            weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3]])
            out = self.check(self.make_runner(), self.x_for(dtype, 3, generator), weights, ids, experts, dtype)
            assert torch.equal(out[1], torch.zeros_like(out[1])), "a token routed to no local expert gets zeros"
            assert float(out[0].float().abs().sum()) > 0 and float(out[2].float().abs().sum()) > 0

    def test_every_token_to_one_expert_and_experts_without_tokens(self) -> None:
        for dtype in self.formats():
            generator = torch.Generator().manual_seed(2)
            experts = random_experts(generator, 6, 0, 6, dtype)
            ids = torch.full((40, 1), 3)
            self.check(self.make_runner(), self.x_for(dtype, 40, generator), torch.ones(40, 1), ids, experts, dtype)

    def test_top_k_above_the_local_experts(self) -> None:
        for dtype in self.formats():
            generator = torch.Generator().manual_seed(3)
            # Top-4 of 8 experts, of which this rank holds 2 (experts 2 and 3).
            experts = random_experts(generator, 2, 2, 8, dtype)
            weights, ids = select_experts(torch.randn(25, 8, generator=generator), Routing(4))
            self.check(self.make_runner(), self.x_for(dtype, 25, generator), weights, ids, experts, dtype)


class EPLBAlgorithmKit:
    """Checks an expert-parallel load balancing algorithm (`--eplb-algorithm`): every slot of
    every layer holds an expert and every expert has a slot, with and without redundant slots,
    for zero counts and random ones, on one node and (where the algorithm plans it, else a
    ValueError) on two with grouped experts; the counts are left alone; and a placement planned
    for a skewed load spreads it over the ranks at least as evenly as one copy of each expert
    in order (`srv.sdk.moe.rank_utilization`).

        class TestMyBalancer(EPLBAlgorithmKit):
            backend_name = "mybalancer"        # the name your plugin registers, or:
            # backend_factory = MyBalancer     # (server_args) -> EPLBAlgorithm
    """

    backend_name: str | None = None
    backend_factory: Callable[[Any], EPLBAlgorithm] | None = None

    def make_algorithm(self) -> EPLBAlgorithm:
        return create(self, "eplb_algorithm", "backend_name", "backend_factory", None)

    def check(self, counts: torch.Tensor, num_physical: int, ranks: int, nodes: int = 1,
              groups: int = 1) -> list[list[int]]:
        before = counts.clone()
        placement = self.make_algorithm().plan(counts, num_physical, ranks, nodes, groups)
        assert torch.equal(counts, before), "the counts are left alone"
        layers, experts = counts.shape
        assert len(placement) == layers, f"{len(placement)} layers placed of {layers}"
        for layer, slots in enumerate(placement):
            assert len(slots) == num_physical, f"layer {layer}: {len(slots)} slots, not {num_physical}"
            assert all(isinstance(e, int) and 0 <= e < experts for e in slots), f"layer {layer}: {slots}"
            assert set(slots) == set(range(experts)), f"layer {layer} leaves experts out: {slots}"
        return placement

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("experts,redundant,ranks", [(4, 0, 1), (4, 2, 2), (8, 4, 4), (6, 1, 2), (16, 16, 4)])
    def test_every_expert_has_a_slot(self, experts: int, redundant: int, ranks: int) -> None:
        generator = torch.Generator().manual_seed(experts * 100 + redundant)
        counts = torch.randint(0, 1000, (3, experts), generator=generator)
        self.check(counts, experts + redundant, ranks)
        self.check(torch.zeros(2, experts, dtype=torch.int64), experts + redundant, ranks)

    def test_two_nodes_with_grouped_experts(self) -> None:
        counts = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(2))
        try:
            self.check(counts, 24, 4, nodes=2, groups=4)
        except ValueError:   # an algorithm may not plan for nodes; it says so
            pass

    def test_a_skewed_load_is_spread(self) -> None:
        counts = torch.tensor([[5000, 10, 10, 10, 2000, 10, 10, 10], [1, 1, 1, 1, 1, 1, 1, 800]])
        for redundant, ranks in ((0, 2), (4, 4)):
            placement = self.check(counts, 8 + redundant, ranks)
            trivial = [list(range(8)) + list(range(redundant))] * 2
            assert rank_utilization(counts, placement, ranks) >= rank_utilization(counts, trivial, ranks) - 1e-9
