"""Mixtures of experts: routing as HF transformers routes, experts split across expert-parallel
ranks, and tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE models whose greedy tokens equal
HF transformers' for every runner, batched, with prefix hits and chunked prefill, at ep=1 and
ep=2 (two processes, both token exchanges)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import srv
from conftest import MOE_KINDS, tiny_moe
from srv.args.parser import parse_launch_args
from srv.plugin_manager import load_plugins
from srv.sdk.linear import Linear
from srv.sdk.moe import FusedMoE, MoEBackends, Routing, run_experts_reference, select_experts
from srv.sdk.testing import EPLBAlgorithmKit
from srv.sdk.testing.registry import registration
from srv.sdk.parallel import ParallelContext
from test_engine import GREEDY, assert_all_kv_returned, assert_matches_hf, random_prompts
from test_server import AUTH, Server

RUNNERS = ["fused_cpu", "torch"]


def test_softmax_routing_is_hf_transformers_router():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(33, 16)
    for renormalize in (False, True):
        config = Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=renormalize)
        router = Qwen2MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(x @ router.weight.t(), Routing(3, renormalize=renormalize))
        assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_weights, rtol=1e-6)


def test_grouped_sigmoid_routing_with_correction_bias_is_deepseek_v3s():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    config = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(40, 16)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(x @ router.weight.t(), Routing(4, "sigmoid", True, 4, 2, 2.5),
                                  router.e_score_correction_bias)
    hf_order, order = hf_ids.sort(dim=-1), ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    assert torch.allclose(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices), rtol=1e-5)


def test_routing_refuses_more_experts_than_there_are():
    with pytest.raises(ValueError, match="top_k 3 exceeds the 2 experts"):
        select_experts(torch.randn(4, 2), Routing(3))


def test_experts_split_across_expert_parallel_ranks_and_features_within_a_group():
    # tp=4, ep=2: ranks 0-1 hold experts 0-3, ranks 2-3 experts 4-7; within a pair each holds half
    # of every expert's intermediate features.
    layers = [FusedMoE(8, 16, 24, Routing(2), ParallelContext(rank, 4), MoEBackends(ep_size=2)) for rank in range(4)]
    assert [(m.expert_start, m.local_experts, m.inter_start, m.inter_local) for m in layers] == \
        [(0, 4, 0, 12), (0, 4, 12, 12), (4, 4, 0, 12), (4, 4, 12, 12)]
    gate = torch.randn(24, 16)
    assert layers[3].load_expert("gate", 5, 0, gate) and not layers[3].load_expert("gate", 3, 0, gate)
    assert torch.equal(layers[3].w13_weight.data[1, :12], gate[12:])
    with pytest.raises(ValueError, match="--ep-size 3 must divide --tensor-parallel-size 4"):
        FusedMoE(8, 16, 24, Routing(2), ParallelContext(0, 4), MoEBackends(ep_size=3))


def test_int8_experts_stay_within_their_rounding_of_the_float_ones():
    torch.manual_seed(0)
    layer = FusedMoE(4, 32, 48, Routing(2))
    layer.w13_weight.data.normal_()
    layer.w2_weight.data.normal_()
    x, logits = torch.randn(10, 32), torch.randn(10, 4)
    expected = layer(x, logits)
    layer.quantize_int8()
    assert layer.experts().is_int8 and not hasattr(layer, "w13_weight")
    # Each weight moves by at most half a step (its row's largest magnitude / 254).
    assert (layer(x, logits) - expected).abs().max() <= 0.02 * expected.abs().max()


def test_a_route_to_another_ranks_expert_adds_nothing():
    layer = FusedMoE(8, 8, 8, Routing(1), ParallelContext(1, 2), MoEBackends(ep_size=2))
    layer.w13_weight.data.normal_()
    layer.w2_weight.data.normal_()
    x = torch.randn(3, 8)
    out = run_experts_reference(x, torch.ones(3, 1), torch.tensor([[0], [5], [3]]), layer.experts())
    assert torch.equal(out[0], torch.zeros(8)) and torch.equal(out[2], torch.zeros(8)) and out[1].abs().sum() > 0


@pytest.mark.parametrize("flags,reason", [
    (["--moe-runner-backend", "no_such_runner"], "unknown moe_runner backend 'no_such_runner'"),
    (["--moe-runner-backend", "triton"], "triton: SGLang's Triton fused MoE kernels need a GPU"),
    (["--moe-a2a-backend", "deepep"], "deepep: DeepEP's NVLink/RDMA all-to-all kernels need a GPU"),
    (["--tp-size", "2", "--ep-size", "3"], "--ep-size 3 must divide --tensor-parallel-size 2"),
    (["--eplb-algorithm", "no_such"], "unknown eplb_algorithm backend 'no_such'"),
    (["--eplb-min-rebalancing-utilization-threshold", "1.5"], "must be in [0.0, 1.0]"),
    (["--eplb-rebalance-layers-per-chunk", "0"], "--eplb-rebalance-layers-per-chunk must be at least 1"),
])
def test_unusable_moe_flags_fail_at_launch_with_their_reasons(flags, reason, capsys):
    with pytest.raises(SystemExit):
        parse_launch_args(flags, *load_plugins())
    assert reason in capsys.readouterr().err


def test_deepseek_latent_attention_is_refused_with_its_reason(tmp_path):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, n_routed_experts=4, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(Exception, match="multi-head latent attention"):
        srv.Engine(model_path=str(tmp_path), load_format="dummy")


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_greedy_tokens_match_hf_batched_with_prefix_hits_and_chunked_prefill(tiny_moe_models, kind, runner):
    path = tiny_moe_models[kind]
    prompts = random_prompts(4)
    # The same prompts again after the first round: their prefixes are in the cache.
    with srv.Engine(model_path=str(path), dtype="float32", moe_runner_backend=runner,
                    chunked_prefill_size=16) as engine:
        assert type(engine.runner.model).__name__ == "MoEForCausalLM"   # native, not transformers'
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, path, prompts, results)
        again = engine.generate(input_ids=[p + [7] for p in prompts[:2]], sampling_params=GREEDY)
        assert all(r["meta_info"]["cached_tokens"] > 0 for r in again)
        assert_matches_hf(engine, path, [p + [7] for p in prompts[:2]], again)
        assert_all_kv_returned(engine)


@pytest.mark.parametrize("kind,flags", [
    ("qwen2_moe", {"ep_size": 2, "moe_dense_tp_size": 1}),          # experts split; dense layer 1 whole
    ("olmoe", {}),                                                  # every expert's features split
    ("mixtral", {"ep_size": 2, "moe_a2a_backend": "all_to_all"}),   # tokens sent to their experts
    ("qwen3_moe", {"ep_size": 2, "moe_a2a_backend": "all_to_all"}),
])
def test_moe_tp2_greedy_tokens_match_hf(tiny_moe_models, kind, flags, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # two ranks on two cores
    path = tiny_moe_models[kind]
    prompts = random_prompts(4)
    with srv.Engine(model_path=str(path), dtype="float32", tp_size=2, **flags) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, path, prompts, results)
        assert_all_kv_returned(engine)
        if flags.get("moe_dense_tp_size") == 1:   # --moe-dense-tp-size 1: the dense layer is not split
            layers = engine.runner.model.layers
            assert layers[1].mlp.parallel.tp_size == 1 and layers[0].mlp.experts.parallel.tp_size == 2


def test_transformers_5_stacked_expert_layout_loads(tmp_path, default_model_dir):
    # transformers 5 keeps every expert of a layer in one tensor in memory; a state dict saved
    # from it has experts.gate_up_proj and experts.down_proj instead of one tensor an expert.
    from transformers import AutoTokenizer

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    torch.manual_seed(1)
    model = tiny_moe("qwen3_moe", common)
    model.config.architectures = [type(model).__name__]   # save_pretrained would write it
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    torch.save(state, tmp_path / "pytorch_model.bin")
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(tmp_path)
    prompts = random_prompts(2)
    with srv.Engine(model_path=str(tmp_path), dtype="float32") as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert_matches_hf(engine, tmp_path, prompts, results)


def test_w8a8_int8_quantizes_experts_and_keeps_the_router_float(tiny_moe_models):
    # A float checkpoint quantized at load: linear layers int8 (activations too), experts int8
    # weight-only; the greedy tokens of this tiny model stay those of the float model for a while.
    path = tiny_moe_models["qwen2_moe"]
    prompts = random_prompts(2)
    # In float32, as the reference: bf16 would move this random model's near-ties on its own.
    with srv.Engine(model_path=str(path), dtype="float32", quantization="w8a8_int8",
                    moe_runner_backend="torch") as engine:
        model = engine.runner.model
        block = model.layers[0].mlp
        assert block.experts.experts().is_int8
        assert not isinstance(block.gate, Linear) and not isinstance(block.shared_expert_gate, Linear)
        assert isinstance(block.shared_expert.down_proj, Linear)   # a quantization slot
        results = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 4})
    with srv.Engine(model_path=str(path), dtype="float32", moe_runner_backend="torch") as engine:
        expected = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 4})
    agree = sum(a == b for r, e in zip(results, expected) for a, b in zip(r["output_ids"], e["output_ids"]))
    assert agree >= 6, (results, expected)


def test_expert_distribution_recorder_routes_and_metrics(tiny_moe_models, tmp_path):
    path = tiny_moe_models["mixtral"]
    server = Server("--model-path", str(path), "--enable-metrics", "--enable-expert-distribution-metrics",
                    "--expert-distribution-recorder-mode", "per_pass", "--moe-runner-backend", "torch",
                    "--skip-server-warmup")
    try:
        def post(route: str, **body) -> dict:
            response = httpx.post(server.base + route, json=body or None, headers=AUTH, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        assert post("/start_expert_distribution_record")["success"]
        post("/generate", input_ids=[5, 6, 7, 8], sampling_params=GREEDY)
        assert post("/stop_expert_distribution_record")["success"]
        dump = post("/dump_expert_distribution_record", output_dir=str(tmp_path))
        # Each of the 3 layers sent each token to two of the four experts: the 4 prompt tokens,
        # then one a step.
        tokens = 4 + GREEDY["max_new_tokens"] - 1
        assert [sum(layer) for layer in dump["logical_count"]] == [2 * tokens] * 3
        assert dump["mode"] == "per_pass" and dump["passes"] == GREEDY["max_new_tokens"]
        assert len(torch.load(dump["path"])["logical_count_of_pass"]) == dump["passes"]
        assert 0.25 <= dump["balancedness"] <= 1.0
        assert "# TYPE srv:expert_balancedness gauge" in httpx.get(server.base + "/metrics", headers=AUTH).text
    finally:
        server.stop()


def test_expert_distribution_routes_refuse_a_dense_model(default_model_dir):
    with srv.Engine(dtype="float32") as engine:
        with pytest.raises(Exception, match="mixture-of-experts models; this one is dense"):
            engine._run(engine.frontend.control("start_expert_distribution_record"))


class TestDeepSeekBalancerKit(EPLBAlgorithmKit):
    backend_name = "deepseek"


class TestDeepSeekHierarchicalBalancerKit(EPLBAlgorithmKit):
    backend_name = "deepseek_hierarchical"


def test_placement_copies_the_busiest_experts_and_spreads_the_load():
    counts = torch.tensor([[100, 10, 10, 40], [1, 1, 1, 1]])
    layers = registration("eplb_algorithm", "deepseek").create(None).plan(counts, 6, 2)
    # Expert 0 gets two extra copies (100/3 per copy beats 40), spread over both ranks.
    assert sorted(layers[0]) == [0, 0, 0, 1, 2, 3]
    assert 0 in layers[0][:3] and 0 in layers[0][3:]
    assert sorted(set(layers[1])) == [0, 1, 2, 3] and len(layers[1]) == 6


def test_hierarchical_placement_keeps_each_expert_group_on_one_node():
    counts = torch.arange(16).repeat(2, 1) * 10   # groups of 4 experts, the last the busiest
    hierarchical = registration("eplb_algorithm", "deepseek_hierarchical").create(None)
    for row in hierarchical.plan(counts, 24, 4, nodes=2, groups=4):
        for node in (row[:12], row[12:]):   # two ranks a node, six slots a rank
            groups = {expert // 4 for expert in node}
            assert len(groups) == 2 and set(node) == {e for g in groups for e in range(4 * g, 4 * g + 4)}
        assert {e // 4 for e in row[:12]} in ({0, 3}, {1, 2})   # busiest beside the idlest
    with pytest.raises(ValueError, match="3 expert groups do not split over 2 nodes"):
        hierarchical.plan(torch.ones(1, 12), 12, 2, nodes=2, groups=3)


@pytest.mark.parametrize("tp,flags", [(1, ["trivial", 3]), (2, ["dump", 2])])
def test_redundant_experts_keep_hf_greedy_tokens(tiny_moe_models, tmp_path, tp, flags, monkeypatch):
    # Copies of experts share their routes by token row: the sums are the same routes'.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    location, redundant = flags
    if location == "dump":   # a recorder dump's counts, as the workflow records them
        location = str(tmp_path / "counts.json")
        (tmp_path / "counts.json").write_text(json.dumps({"logical_count": [[9, 1, 1, 5]] * 3}))
    path = tiny_moe_models["mixtral"]
    prompts = random_prompts(4)
    with srv.Engine(model_path=str(path), dtype="float32", tp_size=tp, ep_size=tp, init_expert_location=location,
                    ep_num_redundant_experts=redundant) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        if tp == 1:
            layer = engine.runner.model.layers[0].mlp.experts
            assert layer.local_experts == 4 + redundant and layer.slot_logical == [0, 1, 2, 3, 0, 1, 2]
    assert_matches_hf(engine, path, prompts, results)


@pytest.mark.parametrize("tp", [1, 2])
def test_eplb_rebalances_while_serving_and_keeps_hf_greedy_tokens(tiny_moe_models, tp, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tiny_moe_models["mixtral"]
    prompts = random_prompts(4)
    with srv.Engine(model_path=str(path), dtype="float32", tp_size=tp, ep_size=tp, enable_eplb=True,
                    eplb_rebalance_num_iterations=2, ep_num_redundant_experts=2) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        again = engine.generate(input_ids=prompts, sampling_params=GREEDY)   # on the new placements
        layers = [layer.mlp.experts for layer in engine.runner.model.layers]
        assert any(layer.slot_logical != [0, 1, 2, 3, 0, 1] for layer in layers)   # rebalanced
        assert all(sorted(set(layer.slot_logical)) == [0, 1, 2, 3] for layer in layers)
    assert_matches_hf(engine, path, prompts, results)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in results]


def test_eplb_places_a_chunk_of_layers_a_step(tiny_moe_models, monkeypatch):
    path = tiny_moe_models["mixtral"]
    prompts = random_prompts(4)
    with srv.Engine(model_path=str(path), dtype="float32", enable_eplb=True, eplb_rebalance_num_iterations=2,
                    ep_num_redundant_experts=2, eplb_rebalance_layers_per_chunk=1,
                    eplb_algorithm="deepseek_hierarchical") as engine:
        placed, place = [], engine.runner.set_expert_placement
        monkeypatch.setattr(engine.runner, "set_expert_placement", lambda rows: (placed.append(sorted(rows)),
                                                                                place(rows)))
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        layers = len(engine.runner.model.layers)
    assert len(placed) >= layers and all(len(rows) == 1 for rows in placed)
    assert [rows[0] for rows in placed[:layers]] == list(range(layers))
    assert_matches_hf(engine, path, prompts, results)


def test_eplb_keeps_a_placement_whose_ranks_are_busy_enough(tiny_moe_models):
    # One rank is always fully used (utilization 1.0): above any threshold under 1.0.
    with srv.Engine(model_path=str(tiny_moe_models["mixtral"]), dtype="float32", enable_eplb=True,
                    eplb_rebalance_num_iterations=2, ep_num_redundant_experts=2,
                    eplb_min_rebalancing_utilization_threshold=0.9) as engine:
        engine.generate(input_ids=random_prompts(2), sampling_params=GREEDY)
        assert all(layer.mlp.experts.slot_logical == [0, 1, 2, 3, 0, 1] for layer in engine.runner.model.layers)


def test_a_moe_draft_model_runs_on_the_speculative_moe_runner(tiny_moe_models):
    """--speculative-moe-runner-backend picks the draft model's runner; the target keeps
    --moe-runner-backend's, and the output is still the target's greedy output."""
    path = tiny_moe_models["qwen3_moe"]
    prompts = random_prompts(3)
    with srv.Engine(model_path=str(path), dtype="float32", moe_runner_backend="fused_cpu",
                    speculative_algorithm="STANDALONE", speculative_draft_model_path=str(path),
                    speculative_moe_runner_backend="torch", speculative_num_draft_tokens=4) as engine:
        def runners(model):
            return {type(m.backends.runner).__name__ for m in model.modules() if isinstance(m, FusedMoE)}

        assert runners(engine.runner.model) == {"FusedCPURunner"}
        assert runners(engine.scheduler.worker.algorithm.draft.runner.model) == {"ReferenceRunner"}
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert engine.scheduler.stats.spec_accepted_tokens > engine.scheduler.stats.spec_verifies
        assert_matches_hf(engine, path, prompts, results)
        assert_all_kv_returned(engine)
