"""Per-request behaviour of srv.Engine: stops, sampling seeds, n > 1, logprobs, priorities,
admission conservativeness, and the dfs-weight policy."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import srv
from srv.engine.default_model import default_model_path
from srv.plugin_manager import load_plugins
from srv.plugins.scheduling.policies import DFSWeightPolicy
from test_engine import (GREEDY, assert_all_kv_returned, assert_matches_hf, hf_greedy, hf_model, make_engine,
                         random_prompts)

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine():
    with make_engine(default_model_path()) as engine:
        yield engine


def test_stop_string_ends_and_trims_the_text(engine):
    full = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 16, "temperature": 0})
    assert " 7," in full["text"]
    result = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 16, "temperature": 0, "stop": " 7"})
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 7"}
    assert result["text"] == full["text"][: full["text"].index(" 7")]


def test_stop_token_ids_and_eos(engine):
    answer = engine.generate(CHAT, {"max_new_tokens": 32, "temperature": 0})
    eos = engine.scheduler.eos_ids
    assert answer["meta_info"]["finish_reason"]["type"] == "stop" and answer["output_ids"][-1] in eos
    stop_id = answer["output_ids"][2]
    stopped = engine.generate(CHAT, {"max_new_tokens": 32, "temperature": 0, "stop_token_ids": [stop_id]})
    assert stopped["output_ids"] == answer["output_ids"][: answer["output_ids"].index(stop_id) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_ignore_eos_and_min_new_tokens(engine):
    natural = len(engine.generate(CHAT, {"max_new_tokens": 32, "temperature": 0})["output_ids"])
    longer = engine.generate(CHAT, {"max_new_tokens": natural + 6, "temperature": 0, "ignore_eos": True})
    assert len(longer["output_ids"]) == natural + 6
    assert longer["meta_info"]["finish_reason"]["type"] == "length"
    at_least = engine.generate(CHAT, {"max_new_tokens": 40, "temperature": 0, "min_new_tokens": natural + 3})
    assert len(at_least["output_ids"]) >= natural + 3
    assert not set(at_least["output_ids"][: natural + 2]) & set(engine.scheduler.eos_ids)


def test_seeded_sampling_ignores_the_rest_of_the_batch(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234}
    alone = engine.generate("Once upon a time", params)
    crowd = engine.generate(["Write a poem.", "Once upon a time", "Hello"],
                            [{"max_new_tokens": 20, "temperature": 0.8}, params, {"max_new_tokens": 5}])
    assert crowd[1]["output_ids"] == alone["output_ids"]
    other = engine.generate("Once upon a time", {**params, "seed": 4321})
    assert other["output_ids"] != alone["output_ids"]


def test_logprobs_are_the_models(engine):
    prompt = "The capital of France is"
    result = engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 3})
    ids = engine.tokenizer.encode(prompt)
    model = hf_model(str(engine.runner.model_dir))
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    [(logprob, token)] = result["meta_info"]["output_token_logprobs"]
    assert token == int(reference.argmax()) and logprob == pytest.approx(float(reference[token]), abs=1e-4)
    top = result["meta_info"]["output_top_logprobs"][0]
    assert [t for t, _ in top] == reference.topk(3).indices.tolist()


def test_n_copies_share_the_prompt_kv(engine):
    prompt = "In a distant galaxy, a small robot named Pip discovered that the stars were singing."
    prompt_len = len(engine.tokenizer.encode(prompt))
    engine.flush_cache()
    results = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 1.0, "n": 3})
    assert len(results) == 3
    for result in results:
        assert result["meta_info"]["cached_tokens"] == prompt_len - 1
        assert len(result["output_ids"]) == 8
    greedy = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "n": 2})
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"] == engine.generate(prompt, GREEDY)["output_ids"][:8]
    assert_all_kv_returned(engine)


def test_priority_needs_the_flag(engine):
    with pytest.raises(ValueError, match="--enable-priority-scheduling"):
        engine.generate("hi", {"max_new_tokens": 1}, priority=5)


def test_random_seed_fixes_unseeded_sampling(tiny_models):
    outputs = []
    for _ in range(2):
        with make_engine(tiny_models["llama"], random_seed=7) as engine:
            outputs.append(engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8})["output_ids"])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("priority, preempts", [(100, True), (10, False)])
def test_higher_priority_preempts_and_both_outputs_stay_exact(tiny_models, priority, preempts):
    prompts = random_prompts(2, seed=6)
    with make_engine(tiny_models["llama"], enable_priority_scheduling=True, max_running_requests=1) as engine:
        # Long enough that the high-priority request arrives while it runs.
        long_greedy = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
        low = engine.generate(input_ids=prompts[0], sampling_params=long_greedy, stream=True, priority=0)
        first = next(low)
        finished: list[str] = []
        high: dict = {}

        def run_high() -> None:
            high["result"] = engine.generate(input_ids=prompts[1], sampling_params=GREEDY, priority=priority)
            finished.append("high")

        # Preemption needs a gap above --priority-scheduling-preemption-threshold (default 10).
        thread = threading.Thread(target=run_high)
        thread.start()
        low_result = [first, *low][-1]
        finished.append("low")
        thread.join()
        assert finished == (["high", "low"] if preempts else ["low", "high"])
        assert (engine.scheduler.stats.retractions >= 1) == preempts
        assert_matches_hf(engine, tiny_models["llama"], prompts[1:], [high["result"]])
        reference = hf_greedy(str(tiny_models["llama"]), tuple(prompts[0]))
        assert low_result["output_ids"][: len(reference)] == reference


@pytest.mark.parametrize("conservativeness, retracts", [(0.0, True), (10.0, False)])
def test_schedule_conservativeness_trades_admission_for_retractions(tiny_models, conservativeness, retracts):
    prompts = random_prompts(8, seed=4)
    with make_engine(tiny_models["llama"], max_total_tokens=200, schedule_conservativeness=conservativeness) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert (engine.scheduler.stats.retractions > 0) == retracts
        assert_matches_hf(engine, tiny_models["llama"], prompts, results)
        assert_all_kv_returned(engine)


def test_dfs_weight_runs_requests_of_the_heaviest_prefix_first():
    root = SimpleNamespace(parent=None)
    shared = SimpleNamespace(parent=root)
    deeper = SimpleNamespace(parent=shared)
    lonely = SimpleNamespace(parent=root)

    def req(i, node):
        return SimpleNamespace(arrival_index=i, prefix_node=node, priority=0, prompt_len=1, max_new_tokens=1,
                               cached_prefix_len=0)

    waiting = [req(0, lonely), req(1, deeper), req(2, root), req(3, shared), req(4, deeper)]
    order = [r.arrival_index for r in DFSWeightPolicy().order(waiting)]
    assert order == [2, 3, 1, 4, 0]


@pytest.mark.parametrize("policy", load_plugins()[1].names("eviction_policy"))
def test_eviction_under_memory_pressure_keeps_outputs_exact(tiny_models, policy):
    rounds = [random_prompts(4, seed=10), random_prompts(4, seed=11), random_prompts(4, seed=10)]
    with make_engine(tiny_models["llama"], max_total_tokens=320, radix_eviction_policy=policy) as engine:
        for prompts in rounds:
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert_matches_hf(engine, tiny_models["llama"], prompts, results)
        assert engine.scheduler.tree.evicted_tokens > 0
        assert_all_kv_returned(engine)


@pytest.mark.parametrize("policy, hot_survives", [("lfu", True), ("lru", False)])
def test_eviction_order_follows_the_policy(tiny_models, policy, hot_survives):
    generator = torch.Generator().manual_seed(12)
    hot, cold, filler = (torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (40, 40, 60))
    short = {"max_new_tokens": 1, "temperature": 0}
    with make_engine(tiny_models["llama"], max_total_tokens=120, radix_eviction_policy=policy) as engine:
        for _ in range(3):
            engine.generate(input_ids=hot, sampling_params=short)
        engine.generate(input_ids=cold, sampling_params=short)
        engine.generate(input_ids=filler, sampling_params=short)  # needs room: one prefix must go
        assert engine.scheduler.tree.evicted_tokens > 0
        cached = engine.generate(input_ids=hot, sampling_params=short)["meta_info"]["cached_tokens"]
        assert (cached == len(hot) - 1) == hot_survives


@pytest.mark.anyio
async def test_async_generate_and_async_stream(tiny_models):
    prompt = random_prompts(1, seed=14)[0]
    with make_engine(tiny_models["llama"]) as engine:
        result = await engine.async_generate(input_ids=prompt, sampling_params=GREEDY)
        chunks = [chunk async for chunk in await engine.async_generate(input_ids=prompt, sampling_params=GREEDY,
                                                                        stream=True)]
        assert chunks[-1]["output_ids"] == result["output_ids"] == hf_greedy(str(tiny_models["llama"]), tuple(prompt))
        assert [len(c["output_ids"]) for c in chunks] == list(range(1, len(chunks) + 1))


def test_model_overrides_and_context_length(tiny_models, default_model_dir):
    with make_engine(tiny_models["llama"], context_length=48, json_model_override_args='{"rms_norm_eps": 0.5}') as engine:
        assert engine.runner.context_len == 48 and engine.runner.config.rms_norm_eps == 0.5
        # max_new_tokens left to its default is cut to what the context holds; one asked for is refused.
        result = engine.generate(input_ids=list(range(3, 40)), sampling_params={"ignore_eos": True})
        assert result["meta_info"]["finish_reason"]["type"] == "length" and len(result["output_ids"]) == 48 - 37
        with pytest.raises(ValueError, match="maximum context length of 48 tokens. You requested a total of 67 tokens"):
            engine.generate(input_ids=list(range(3, 40)), sampling_params={"max_new_tokens": 30})
        with pytest.raises(ValueError, match=r"The input \(57 tokens\) is longer than the model's context length"):
            engine.generate(input_ids=list(range(3, 60)), sampling_params=GREEDY)
    with make_engine(tiny_models["llama"], context_length=48, allow_auto_truncate=True) as engine:
        result = engine.generate(input_ids=list(range(3, 40)), sampling_params={"max_new_tokens": 30, "ignore_eos": True})
        assert len(result["output_ids"]) == 48 - 37
        result = engine.generate(input_ids=list(range(3, 60)), sampling_params={"max_new_tokens": 5, "ignore_eos": True})
        assert result["meta_info"]["prompt_tokens"] == 47 and len(result["output_ids"]) == 1


def test_tokenizer_workers_give_the_same_tokens(tiny_models):
    prompts = ["Hello there, how are you?", "Ünïcödé and emoji 🚀 tokenize the same", "x" * 500]
    with make_engine(tiny_models["llama"], tokenizer_worker_num=2) as engine:
        results = engine.generate(prompts, GREEDY)
        ids = [engine.tokenizer.encode(p) for p in prompts]
        assert [r["meta_info"]["prompt_tokens"] for r in results] == [len(i) for i in ids]
        assert_matches_hf(engine, tiny_models["llama"], ids, results)
