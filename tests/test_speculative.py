"""Speculative decoding: greedy output with each algorithm is the output without it (and
transformers'), token for token; sampling keeps the target's distribution; rejected drafts
leave nothing behind in the KV memory or the prefix cache."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import srv
from srv.sdk.speculative import accept_drafts
from srv.sdk.testing import SpeculativeAlgorithmKit, hf_greedy, random_prompts, tiny_llama, write_tiny_llama
from srv.sdk.testing.speculative import repeating_prompts
from test_engine import assert_all_kv_returned, assert_matches_hf, make_engine
from test_engine import random_prompts as vocab_prompts

GREEDY = {"max_new_tokens": 32, "temperature": 0}

CODE = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n")
EDIT = [{"role": "user", "content": "Rename the function fibonacci to fib and repeat the whole code:\n\n" + CODE}]


class TestNgramKit(SpeculativeAlgorithmKit):
    backend_name = "NGRAM"


class TestStandaloneKit(SpeculativeAlgorithmKit):
    """The target as its own draft model."""

    backend_name = "STANDALONE"

    @classmethod
    def launch_flags(cls, model_dir: Path) -> dict:
        return {"speculative_draft_model_path": str(model_dir)}


class TestEagleKit(SpeculativeAlgorithmKit):
    """A random EAGLE head (see write_eagle_head)."""

    backend_name = "EAGLE"

    @classmethod
    def launch_flags(cls, model_dir: Path) -> dict:
        head = model_dir.parent / f"head-{cls.backend_name}"
        if not head.exists():
            write_eagle_head(head, eagle3=cls.backend_name == "EAGLE3")
        return {"speculative_draft_model_path": str(head)}


class TestEagle3Kit(TestEagleKit):
    backend_name = "EAGLE3"


class TestNextnKit(TestEagleKit):
    backend_name = "NEXTN"


def test_accept_drafts_keeps_the_agreeing_prefix_and_the_targets_token():
    assert accept_drafts([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert accept_drafts([5, 9, 7], [5, 6]) == [5, 9]
    assert accept_drafts([4, 6, 7], [5, 6]) == [4]
    assert accept_drafts([3], []) == [3]
    with pytest.raises(ValueError):
        accept_drafts([1, 2], [1, 2])


def test_ngram_drafts_read_on_past_the_end_of_text_repeating_a_short_cycle():
    """A match at the end of the sequence continues into its own drafts: a word said over and
    over (or a two-token cycle) is offered a full run of drafts, not the one or two tokens the
    sequence holds after the match."""
    from types import SimpleNamespace

    from srv.plugins.speculative.ngram import INITIAL_DRAFTS, NgramAlgorithm
    from srv.sdk.speculative import SpeculativeConfig, SpeculativeContext

    for match_type in ("BFS", "PROB"):
        config = SpeculativeConfig("NGRAM", num_draft_tokens=8, num_steps=1)
        config = dataclasses.replace(config, ngram=dataclasses.replace(config.ngram, match_type=match_type))
        algorithm = NgramAlgorithm(SpeculativeContext(config, 100))
        word = SimpleNamespace(rid="word", token_ids=[5, 6, 7, 9, 9, 9], prompt_len=3, params=None)
        cycle = SimpleNamespace(rid="cycle", token_ids=[5, 6, 7, 1, 2, 1, 2], prompt_len=3, params=None)
        assert algorithm.propose([word, cycle], [7, 7]) == [[9] * INITIAL_DRAFTS, [1, 2, 1, 2][:INITIAL_DRAFTS]]


def test_ngram_default_model_matches_hf(default_model_dir):
    """The default model with NGRAM: a code edit (drafts that hold) and ordinary prompts, alone and
    batched, each HF's greedy output; most proposed drafts hold on the edit."""
    from test_engine import PROMPTS

    with make_engine(default_model_dir, speculative_algorithm="NGRAM") as engine:
        edit = engine.tokenizer.apply_chat_template(EDIT, add_generation_prompt=True, tokenize=False)
        prompts = [edit] + PROMPTS[:3]
        ids = [engine.tokenizer.encode(p) for p in prompts]
        single = engine.generate(input_ids=ids[0], sampling_params=GREEDY)
        stats = engine.scheduler.stats
        assert stats.spec_accept_length > 1.5, vars(stats)
        batched = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert_matches_hf(engine, default_model_dir, [ids[0]] + ids, [single] + batched)
        assert_all_kv_returned(engine)


@pytest.mark.parametrize("attention", ["torch_native", "intel_amx"])
def test_ngram_tiny_llama_chunked_prefill_and_prefix_hits(tiny_models, attention):
    prompts = [p + p for p in vocab_prompts(4, seed=7)]
    with make_engine(tiny_models["llama"], speculative_algorithm="NGRAM", attention_backend=attention,
                     chunked_prefill_size=16, page_size=4) as engine:
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        again = engine.generate(input_ids=[p + [5] for p in prompts], sampling_params=GREEDY)
        assert sum(r["meta_info"]["cached_tokens"] for r in again) > 0
        assert engine.scheduler.stats.spec_draft_tokens > 0
        assert_matches_hf(engine, tiny_models["llama"], prompts + [p + [5] for p in prompts], first + again)
        assert_cache_holds_only_verified_tokens(engine, prompts + [p + [5] for p in prompts], first + again)
        assert_all_kv_returned(engine)


def assert_cache_holds_only_verified_tokens(engine: srv.Engine, prompts: list[list[int]], results: list[dict]) -> None:
    """Every path of the prefix cache is a prefix of some request's prompt and output."""
    sequences = [p + r["output_ids"] for p, r in zip(prompts, results)]
    tree = engine.scheduler.tree
    stack = [(tree.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            tokens = path + list(child.key)
            assert any(s[:len(tokens)] == tokens for s in sequences), f"cached tokens {tokens[-8:]} no request verified"
            stack.append((child, tokens))


def test_ngram_retraction_under_memory_pressure(tiny_models):
    prompts = [p + p for p in vocab_prompts(8, seed=4)]
    with make_engine(tiny_models["llama"], speculative_algorithm="NGRAM", max_total_tokens=260,
                     chunked_prefill_size=64, schedule_conservativeness=0) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert engine.scheduler.stats.retractions > 0
        assert_matches_hf(engine, tiny_models["llama"], prompts, results)
        assert_all_kv_returned(engine)


def test_standalone_draft_of_other_weights_is_still_exact(tiny_models):
    """A draft with unrelated weights (same vocabulary): few drafts hold, the output is unchanged."""
    prompts = vocab_prompts(4, seed=8)
    with make_engine(tiny_models["llama"], speculative_algorithm="STANDALONE",
                     speculative_draft_model_path=str(tiny_models["qwen2"]), speculative_num_steps=3) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        stats = engine.scheduler.stats
        assert stats.spec_draft_tokens > 0
        assert (stats.spec_accepted_tokens - stats.spec_verifies) < 0.3 * stats.spec_draft_tokens, vars(stats)
        assert_matches_hf(engine, tiny_models["llama"], prompts, results)
        assert_all_kv_returned(engine)


def test_standalone_target_as_draft_accepts_every_draft(srv_tiny_model_dir):
    with srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=str(srv_tiny_model_dir), speculative_num_draft_tokens=4) as engine:
        prompts = random_prompts([5, 12, 30])
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                                       "ignore_eos": True})
        stats = engine.scheduler.stats
        assert stats.spec_accepted_tokens - stats.spec_verifies == stats.spec_draft_tokens > 0, vars(stats)
        for prompt, result in zip(prompts, results):
            assert result["output_ids"] == hf_greedy(tiny_llama(), prompt, 24)


def chi_square_homogeneity(a: list[int], b: list[int], bins: int = 6) -> tuple[float, int]:
    """Pearson's statistic that samples a and b come from one distribution, over the most common
    values (the rest pooled), and its degrees of freedom."""
    from collections import Counter

    common = [v for v, _ in Counter(a + b).most_common(bins - 1)]
    def counts(xs):
        c = Counter(x if x in common else -1 for x in xs)
        return [c[v] for v in common + [-1]]
    ca, cb = counts(a), counts(b)
    stat = 0.0
    for x, y in zip(ca, cb):
        total = x + y
        if total:
            for observed, n in ((x, len(a)), (y, len(b))):
                expected = total * n / (len(a) + len(b))
                stat += (observed - expected) ** 2 / expected
    return stat, sum(1 for x, y in zip(ca, cb) if x + y) - 1


# The chi-square distribution's 0.999 quantiles, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def test_sampling_keeps_the_targets_distribution(srv_tiny_model_dir):
    """Temperature 1: the token at a position drafts are verified for is distributed as without
    speculation (chi-square, a fixed seed: the same draw every run). The drafts are the target's
    own greedy tokens (STANDALONE, the target as draft), so they are accepted often and rejected
    often."""
    prompt = random_prompts([6], seed=3)[0] * 3
    params = {"max_new_tokens": 4, "temperature": 1.0, "top_k": 8, "ignore_eos": True}
    samples = {}
    for spec in (None, "STANDALONE"):
        flags = {"speculative_algorithm": spec, "speculative_draft_model_path": str(srv_tiny_model_dir)} if spec else {}
        with srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", **flags) as engine:
            torch.manual_seed(0)
            results = engine.generate(input_ids=[prompt] * 300, sampling_params=params)
            samples[spec] = [r["output_ids"][3] for r in results]
            if spec:
                stats = engine.scheduler.stats
                accepted = stats.spec_accepted_tokens - stats.spec_verifies
                assert 0.2 * stats.spec_draft_tokens < accepted < 0.8 * stats.spec_draft_tokens, vars(stats)
    stat, df = chi_square_homogeneity(samples[None], samples["STANDALONE"])
    assert stat < CHI2_999[df], (stat, df)


def test_seeded_sampling_is_the_same_with_and_without_speculation(srv_tiny_model_dir):
    """A seeded request draws each position's token from (seed, position): drafts or not, the
    same tokens."""
    prompt = random_prompts([6], seed=3)[0] * 3
    params = [{"max_new_tokens": 12, "temperature": 0.8, "seed": s, "ignore_eos": True} for s in range(8)]
    outputs = []
    for flags in ({}, {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(srv_tiny_model_dir)}):
        with srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", **flags) as engine:
            outputs.append([r["output_ids"] for r in engine.generate(input_ids=[prompt] * 8, sampling_params=params)])
    assert outputs[0] == outputs[1]


def test_speculative_flags_refused_by_name():
    from conftest import run_srv

    for flags, message in [(["--speculative-accept-threshold-acc", "0.5"], "--speculative-accept-threshold-acc"),
                           (["--speculative-num-draft-tokens", "1"], "at least 2")]:
        result = run_srv("launch", "--speculative-algorithm", "NGRAM", *flags)
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_logprobs_stop_strings_and_n_are_as_without_speculation(default_model_dir):
    """What a request asks beside its tokens (log-probabilities, a stop string met in the middle
    of a verified chunk, min_tokens, n > 1) comes out as without speculation."""
    results = []
    for flags in ({}, {"speculative_algorithm": "NGRAM"}):
        with make_engine(default_model_dir, **flags) as engine:
            edit = engine.tokenizer.apply_chat_template(EDIT, add_generation_prompt=True, tokenize=False)
            asks = [
                {"max_new_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 3},
                {"max_new_tokens": 64, "temperature": 0, "stop": ["return result"]},
                {"max_new_tokens": 24, "temperature": 0, "min_new_tokens": 20, "stop_token_ids": [13]},
                {"max_new_tokens": 16, "temperature": 0.7, "seed": 11, "n": 2},
            ]
            results.append([engine.generate(edit, ask) for ask in asks])
            if flags:
                assert engine.scheduler.stats.spec_accept_length > 1.2
    plain, speculative = results
    assert plain[0]["output_ids"] == speculative[0]["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        flat = [torch.tensor(_logprob_values(r[0]["meta_info"][key])) for r in (plain, speculative)]
        torch.testing.assert_close(flat[1], flat[0], atol=1e-4, rtol=0, msg=key)
    assert plain[1]["text"] == speculative[1]["text"] and plain[1]["meta_info"]["finish_reason"] == \
        speculative[1]["meta_info"]["finish_reason"]
    assert plain[2]["output_ids"] == speculative[2]["output_ids"]
    assert [r["output_ids"] for r in plain[3]] == [r["output_ids"] for r in speculative[3]]


def test_server_reports_the_accept_length(default_model_dir):
    from test_server import Server

    import httpx

    server = Server("--speculative-algorithm", "NGRAM", "--enable-metrics", "--skip-server-warmup")
    try:
        body = {"messages": EDIT, "max_tokens": 48, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=120) as response:
            chunks = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 3
        info = httpx.get(f"{server.base}/get_server_info").json()
        assert info["speculative_algorithm"] == "NGRAM"
        assert info["internal_states"][0]["avg_spec_accept_length"] > 1.0
        metrics = httpx.get(f"{server.base}/metrics").text
        line = next(l for l in metrics.splitlines() if l.startswith("sglang:spec_accept_length"))
        assert float(line.split()[-1]) > 1.0
    finally:
        assert server.stop() == 0


def _logprob_values(entries) -> list[float]:
    """The log-probabilities of a meta_info logprob list ((logprob, token id, ...) entries, or
    lists of them a position), flattened."""
    out = []
    for entry in entries:
        if entry and isinstance(entry[0], (list, tuple)):
            out += [e[0] for e in entry]
        else:
            out.append(entry[0])
    return out


def write_eagle_head(path: Path, eagle3: bool, seed: int = 0) -> Path:
    """A random EAGLE (fc, layers.0) or EAGLE3 (fc, midlayer, norm, lm_head over a draft vocabulary,
    d2t) head for the tiny Llama, in the published checkpoints' layout."""
    import json

    from safetensors.torch import save_file

    from srv.sdk.testing.tiny_model import CONFIG

    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv, inter = CONFIG["hidden_size"], 4, 2, 96
    head_dim = hidden // heads
    draft_vocab = 128
    config = {"architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": CONFIG["vocab_size"],
              "max_position_embeddings": 512, "rope_theta": 10000.0}
    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2
    layer = "midlayer." if eagle3 else "layers.0."
    width = 2 * hidden if eagle3 else hidden
    tensors = {f"{layer}self_attn.q_proj.weight": rand(heads * head_dim, width),
               f"{layer}self_attn.k_proj.weight": rand(kv * head_dim, width),
               f"{layer}self_attn.v_proj.weight": rand(kv * head_dim, width),
               f"{layer}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
               f"{layer}mlp.gate_proj.weight": rand(inter, hidden), f"{layer}mlp.up_proj.weight": rand(inter, hidden),
               f"{layer}mlp.down_proj.weight": rand(hidden, inter),
               f"{layer}post_attention_layernorm.weight": torch.ones(hidden)}
    if eagle3:
        config |= {"draft_vocab_size": draft_vocab, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}}
        # Draft id i is target id 2i (d2t holds the offsets), t2d marks the target ids drafted.
        tensors |= {"fc.weight": rand(hidden, 3 * hidden), "midlayer.input_layernorm.weight": torch.ones(hidden),
                    "midlayer.hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden),
                    "lm_head.weight": rand(draft_vocab, hidden), "d2t": torch.arange(draft_vocab),
                    "t2d": torch.arange(CONFIG["vocab_size"]) % 2 == 0}
    else:
        tensors |= {"fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden)}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_heads_draft_and_the_output_is_the_targets(srv_tiny_model_dir, tmp_path, algorithm):
    """A random head in the published layout loads, reads the target's hidden states and drafts;
    greedy output stays the target's, alone, batched and beside a prefix-cache hit."""
    head = write_eagle_head(tmp_path / algorithm.lower(), eagle3=algorithm == "EAGLE3")
    prompts = repeating_prompts(seed=4)
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", speculative_algorithm=algorithm,
                    speculative_draft_model_path=str(head), speculative_num_steps=3) as engine:
        single = engine.generate(input_ids=prompts[0], sampling_params=greedy)
        batched = engine.generate(input_ids=prompts + [prompts[1] + [7, 8]], sampling_params=greedy)
        status = engine.status()
        assert status["spec_draft_tokens"] > 0 and status["spec_verifies"] > 0, status
        for prompt, result in zip([prompts[0]] + prompts + [prompts[1] + [7, 8]], [single] + batched):
            assert result["output_ids"] == hf_greedy(tiny_llama(), prompt, 16)
        assert engine.flush_cache() and engine.status()["kv_tokens_in_use"] == 0


def test_an_eagle_head_of_the_wrong_layout_is_refused(srv_tiny_model_dir, tmp_path):
    head = write_eagle_head(tmp_path / "eagle", eagle3=False)
    with pytest.raises(Exception, match="not an EAGLE3 head"):
        srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=str(head))


def test_accept_tree_follows_the_child_the_target_sampled():
    from srv.sdk.speculative import DraftTree, accept_tree

    # root -> 5 (node 0) and 6 (node 1); node 1 -> 7 (node 2); node 0 -> 8 (node 3)
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 1, 0])
    assert accept_tree([6, 9, 7, 4, 9], tree) == ([6, 7, 4], [1, 2])
    assert accept_tree([5, 8, 9, 9, 3], tree) == ([5, 8, 3], [0, 3])
    assert accept_tree([2, 0, 0, 0, 0], tree) == ([2], [])
    assert DraftTree.chain([4, 5]).is_chain and not tree.is_chain and tree.path(2) == [1, 2]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])


def oracle_tree(context):
    """An algorithm whose tree's first child of the root is wrong and whose second branch is the
    target's greedy continuation: verification must follow the second branch and move its KV."""
    from srv.sdk.speculative import DraftTree, SpeculativeAlgorithm

    class Oracle(SpeculativeAlgorithm):
        supports_trees = True

        def propose(self, requests, budgets):
            trees = []
            for req, budget in zip(requests, budgets):
                if budget < 4:
                    trees.append([])
                    continue
                g = hf_greedy(tiny_llama(), req.token_ids, 3)
                wrong = (g[0] + 1) % 250 + 3
                trees.append(DraftTree([wrong, g[0], g[1], g[2]], [-1, -1, 1, 2]))
            return trees

    return Oracle(context)


def test_tree_drafts_move_the_accepted_branch_kv(srv_tiny_model_dir):
    from srv.sdk.testing import registered_temporarily

    prompts = random_prompts([5, 13])
    greedy = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    with registered_temporarily("speculative_algorithm", "oracle-tree", oracle_tree) as name:
        with srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", speculative_algorithm=name,
                        speculative_num_draft_tokens=5, page_size=4) as engine:
            results = engine.generate(input_ids=prompts, sampling_params=greedy)
            status = engine.status()
            # Every verify step accepts the three drafts of the second branch.
            assert status["spec_accepted_tokens"] - status["spec_verifies"] >= 2 * status["spec_verifies"] > 0, status
            for prompt, result in zip(prompts, results):
                assert result["output_ids"] == hf_greedy(tiny_llama(), prompt, 20)
            assert engine.flush_cache() and engine.status()["kv_tokens_in_use"] == 0


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_tree_drafts_keep_the_output(srv_tiny_model_dir, tmp_path, algorithm):
    head = write_eagle_head(tmp_path / algorithm.lower(), eagle3=algorithm == "EAGLE3")
    prompts = repeating_prompts(seed=6)
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", speculative_algorithm=algorithm,
                    speculative_draft_model_path=str(head), speculative_num_steps=3, speculative_eagle_topk=3,
                    speculative_num_draft_tokens=8) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert engine.status()["spec_draft_tokens"] > 0
        for prompt, result in zip(prompts, results):
            assert result["output_ids"] == hf_greedy(tiny_llama(), prompt, 16)


def test_chain_algorithms_refuse_a_topk(srv_tiny_model_dir):
    with pytest.raises(Exception, match="NGRAM drafts chains"):
        srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", speculative_algorithm="NGRAM",
                   speculative_eagle_topk=2)


def test_a_token_map_narrows_eagles_drafts_and_keeps_the_output(srv_tiny_model_dir, tmp_path):
    """--speculative-token-map (a torch file of ids, as SGLang reads it): EAGLE drafts only ids
    in the map, the head's logits over them being the target head's at those ids; a map of the
    whole vocabulary drafts what no map drafts; greedy output stays the target's."""
    head = write_eagle_head(tmp_path / "eagle", eagle3=False)
    prompts = repeating_prompts(seed=4)
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    hot = torch.randperm(256, generator=torch.Generator().manual_seed(3))[:96]
    torch.save(hot, tmp_path / "hot.pt")
    torch.save(torch.arange(255, -1, -1).tolist(), tmp_path / "all.pt")   # a list, in another order
    flags = {"model_path": str(srv_tiny_model_dir), "dtype": "float32", "speculative_algorithm": "EAGLE",
             "speculative_draft_model_path": str(head), "speculative_num_steps": 3}
    drafts = {}
    for name, token_map in [("none", None), ("hot", "hot.pt"), ("all", "all.pt")]:
        extra = {"speculative_token_map": str(tmp_path / token_map)} if token_map else {}
        with srv.Engine(**flags, **extra) as engine:
            algorithm = engine.scheduler.worker.algorithm
            proposed = []
            propose = algorithm.propose
            def recording(requests, budgets, propose=propose):
                out = propose(requests, budgets)
                proposed.extend(t for chain in out for t in chain)
                return out
            algorithm.propose = recording
            results = engine.generate(input_ids=prompts, sampling_params=greedy)
            for prompt, result in zip(prompts, results):
                assert result["output_ids"] == hf_greedy(tiny_llama(), prompt, 16)
            drafts[name] = proposed
            if name == "hot":
                hidden = torch.randn(3, tiny_llama().config.hidden_size)
                assert torch.allclose(algorithm.logits_head(hidden), algorithm.context.target_head(hidden)[:, hot],
                                      atol=1e-5)
    assert drafts["hot"] and set(drafts["hot"]) <= set(hot.tolist())
    assert drafts["all"] == drafts["none"] and drafts["none"]


def test_token_map_and_draft_revision_errors_name_the_flag(srv_tiny_model_dir, tmp_path):
    head = write_eagle_head(tmp_path / "eagle", eagle3=False)
    eagle3 = write_eagle_head(tmp_path / "eagle3", eagle3=True)
    torch.save(torch.tensor([1, 2, 2]), tmp_path / "twice.pt")
    torch.save(torch.tensor([1, 256]), tmp_path / "outside.pt")
    torch.save(torch.ones(2, 2), tmp_path / "floats.pt")
    flags = {"model_path": str(srv_tiny_model_dir), "dtype": "float32"}
    eagle = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head)}
    for extra, message in [
        (eagle | {"speculative_token_map": str(tmp_path / "twice.pt")}, "more than once"),
        (eagle | {"speculative_token_map": str(tmp_path / "outside.pt")}, r"\[0, 256\)"),
        (eagle | {"speculative_token_map": str(tmp_path / "floats.pt")}, "1-D list of integer"),
        (eagle | {"speculative_token_map": str(tmp_path / "absent.pt")}, "--speculative-token-map .* does not exist"),
        (eagle | {"speculative_token_map": "srv-test/absent/hot.pt", "download_dir": str(tmp_path / "hub")},
         "never downloads"),
        ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(eagle3),
          "speculative_token_map": str(tmp_path / "twice.pt")}, "EAGLE3 reads no token map"),
        ({"speculative_algorithm": "NGRAM", "speculative_token_map": str(tmp_path / "twice.pt")}, "NGRAM reads no"),
        (eagle | {"speculative_draft_model_revision": "main"}, "--speculative-draft-model-revision main names a"),
        ({"speculative_algorithm": "NGRAM", "speculative_draft_model_revision": "main"},
         "--speculative-draft-model-path is unset"),
    ]:
        with pytest.raises(Exception, match=message):
            srv.Engine(**flags, **extra)


def test_a_draft_model_is_found_in_the_local_hub_cache_at_its_revision(srv_tiny_model_dir, tmp_path):
    """--speculative-draft-model-path org/name with --speculative-draft-model-revision (and a
    token map as org/name/file): the local cache's snapshot, as --model-path and --revision are."""
    cache = tmp_path / "hub"
    repo = cache / "models--srv-test--eagle"
    for commit, seed in (("1" * 40, 0), ("2" * 40, 1)):
        write_eagle_head(repo / "snapshots" / commit, eagle3=False, seed=seed)
    torch.save(torch.arange(128), repo / "snapshots" / ("2" * 40) / "hot.pt")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("2" * 40)
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompt = repeating_prompts(seed=5)[0]
    for revision, expected in ((None, "2" * 40), ("1" * 40, "1" * 40)):
        with srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", download_dir=str(cache),
                        speculative_algorithm="EAGLE", speculative_draft_model_path="srv-test/eagle",
                        speculative_draft_model_revision=revision, speculative_token_map="srv-test/eagle/hot.pt",
                        speculative_num_steps=3) as engine:
            config = engine.scheduler.worker.algorithm.config
            assert Path(config.draft_model_path).name == expected
            assert Path(config.token_map).parent.name == "2" * 40
            assert engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"] == \
                hf_greedy(tiny_llama(), prompt, 12)
    with pytest.raises(FileNotFoundError, match="--speculative-draft-model-path srv-test/eagle: .*revision v9"):
        srv.Engine(model_path=str(srv_tiny_model_dir), dtype="float32", download_dir=str(cache),
                   speculative_algorithm="EAGLE", speculative_draft_model_path="srv-test/eagle",
                   speculative_draft_model_revision="v9")


def test_head_rows_read_a_head_without_a_dense_weight_off_its_products():
    from srv.engine.speculative import head_rows

    linear = torch.nn.Linear(300, 50, bias=False)
    class Quantized(torch.nn.Module):   # a head whose weights are not a dense `weight`
        def forward(self, x):
            return linear(x)
    ids = torch.tensor([49, 3, 17])
    expected = linear.weight[ids].detach()
    assert torch.equal(head_rows(linear, ids, 300, torch.float32), expected)
    assert torch.equal(head_rows(Quantized(), ids, 300, torch.float32), expected)
