"""Greedy output of srv.Engine equals HF transformers' on the same weights, token for token."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import srv
from srv.engine.default_model import default_model_path
from srv.plugins.attention import cpu_attention
from srv.plugin_manager import load_plugins
from srv.plugins.quantization.gguf import GGUFLinear
from srv.sdk.layers import Float32Head

NEW_TOKENS = 32
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "In a distant galaxy, a small robot named Pip discovered that the stars were singing. Every night it",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time",
    "The three primary colors are red, yellow and",
]


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_greedy(path: str, prompt_ids: tuple[int, ...]) -> list[int]:
    model = hf_model(path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 17, 30, 41, 5, 64, 12][:count]
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]


def assert_matches_hf(engine: srv.Engine, model_dir: Path, prompt_ids: list[list[int]], results: list[dict]) -> None:
    for ids, result in zip(prompt_ids, results):
        assert result["output_ids"] == hf_greedy(str(model_dir), tuple(ids)), f"prompt {ids[:8]}..."


def assert_all_kv_returned(engine: srv.Engine) -> None:
    assert engine.flush_cache()
    assert engine.status()["kv_tokens_in_use"] == 0


def make_engine(model_dir: Path, **flags) -> srv.Engine:
    return srv.Engine(model_path=str(model_dir), dtype="float32", **flags)


# ---- the default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_engine(default_model_dir):
    with make_engine(default_model_path()) as engine:
        yield engine


def test_default_model_single_request(default_engine, default_model_dir):
    ids = default_engine.tokenizer.encode(PROMPTS[0])
    result = default_engine.generate(PROMPTS[0], GREEDY)
    assert_matches_hf(default_engine, default_model_dir, [ids], [result])
    assert result["meta_info"]["prompt_tokens"] == len(ids)
    assert result["text"] == default_engine.tokenizer.decode(result["output_ids"], skip_special_tokens=True)


def test_default_model_batch_of_8(default_engine, default_model_dir):
    ids = [default_engine.tokenizer.encode(p) for p in PROMPTS]
    results = default_engine.generate(PROMPTS, GREEDY)
    assert_matches_hf(default_engine, default_model_dir, ids, results)
    assert_all_kv_returned(default_engine)


def test_default_model_prefix_cache_hit(default_engine, default_model_dir):
    default_engine.flush_cache()
    shared = PROMPTS[4]
    first = default_engine.generate(shared + " sang back.", GREEDY)
    second_prompt = shared + " listened closely."
    second = default_engine.generate(second_prompt, GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= len(default_engine.tokenizer.encode(shared)) - 2
    assert default_engine.scheduler.stats.cached_prompt_tokens >= second["meta_info"]["cached_tokens"]
    assert_matches_hf(default_engine, default_model_dir, [default_engine.tokenizer.encode(second_prompt)], [second])
    assert_all_kv_returned(default_engine)


def test_default_model_requests_sharing_a_cached_prompt_decode_together(default_engine, default_model_dir,
                                                                        monkeypatch):
    """Requests whose prompts begin with the same cached 100-odd tokens decode in one batch, and
    their attention reads the shared keys and values once a group: still HF's tokens."""
    shares = []
    grouped = cpu_attention.decode_context

    def recording(*args, **kwargs):
        context, groups = grouped(*args, **kwargs)
        shares.extend(int(shared) for shared in groups[:context.group_count, 2])
        return context, groups

    monkeypatch.setattr(cpu_attention, "decode_context", recording)
    default_engine.flush_cache()
    shared = " ".join(PROMPTS)
    default_engine.generate(shared, {"max_new_tokens": 1, "temperature": 0})
    prompts = [shared + ending for ending in (" The end.", " And then", " Why?", " 42")]
    results = default_engine.generate(prompts, GREEDY)
    assert all(r["meta_info"]["cached_tokens"] >= 64 for r in results)
    assert max(shares) >= 64, "no decode step grouped the requests over their shared prompt"
    assert_matches_hf(default_engine, default_model_dir, [default_engine.tokenizer.encode(p) for p in prompts], results)
    assert_all_kv_returned(default_engine)


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_default_model_gguf_kernels_match_hf(default_model_dir, model_impl):
    """`--quantization gguf` multiplies the file's own blocks into float32 activations: HF on
    the same (dequantized) weights gives the same greedy tokens, for a batch of 8 decoding on
    the kernels, in srv's own Llama and in transformers' model class."""
    with srv.Engine(quantization="gguf", dtype="float32", model_impl=model_impl) as engine:
        assert isinstance(engine.runner.model.get_submodule(QKV_PROJ[model_impl]), GGUFLinear)
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        assert_matches_hf(engine, default_model_dir, ids, engine.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("flags", [{"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "gguf"},
                                   {"dtype": "bfloat16", "quantization": "gguf", "enable_fp32_lm_head": True}],
                         ids=["bfloat16", "gguf-bfloat16", "gguf-bfloat16-fp32-head"])
def test_default_model_bfloat16_within_tolerance(default_model_dir, flags):
    """bf16 arithmetic against the fp32 reference: every prompt's first token is one the reference
    ranks within BF16_LOGPROB_TOLERANCE of its best, and the top-5 next-token log-probabilities
    differ by at most that, with the file's own blocks (`--quantization gguf`) too."""
    model = hf_model(str(default_model_dir))
    with srv.Engine(**flags) as engine:
        results = engine.generate(PROMPTS, {"max_new_tokens": 1, "temperature": 0, "top_logprobs": 5})
        for prompt, result in zip(PROMPTS, results):
            ids = engine.tokenizer.encode(prompt)
            with torch.inference_mode():
                reference = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            # bf16 rounding can tie or swap the reference's top two when they are this close.
            assert float(reference.max() - reference[result["output_ids"][0]]) <= BF16_LOGPROB_TOLERANCE, prompt
            for token, logprob in result["meta_info"]["output_top_logprobs"][0]:
                assert abs(logprob - float(reference[token])) <= BF16_LOGPROB_TOLERANCE, (prompt, token)


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_fp32_lm_head_computes_the_logits_in_float32(tiny_models, model_impl):
    """--enable-fp32-lm-head: a bf16 model's head takes its rows and (a copy of) its weights in
    float32, and its logits are not rounded to bf16; at float32 it has nothing to do."""
    path = tiny_models["llama"]
    with srv.Engine(model_path=str(path), dtype="bfloat16", model_impl=model_impl, enable_fp32_lm_head=True) as engine:
        model = engine.runner.model
        head = model.lm_head if model_impl == "auto" else model.hf.lm_head
        assert isinstance(head, Float32Head) and head.head.weight.dtype == torch.bfloat16
        x = torch.randn(3, head.weight.shape[1], dtype=torch.bfloat16)
        logits = head(x)
        assert logits.dtype == torch.float32 and torch.equal(logits, F.linear(x.float(), head.head.weight.float()))
        assert not torch.equal(logits, head.head(x).float())   # the bf16 product rounds
        results = engine.generate(input_ids=random_prompts(2), sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert [len(r["output_ids"]) for r in results] == [4, 4]
    with srv.Engine(model_path=str(path), dtype="float32", enable_fp32_lm_head=True) as engine:
        assert not isinstance(engine.runner.model.lm_head, Float32Head)


# bfloat16 keeps 8 bits of mantissa through 30 layers: the top-5 log-probabilities move by up to
# a few tenths, and by how much depends on how the prompts are batched (the step a prompt
# prefills in changes the matmuls' blocking), which a loaded machine changes from run to run.
BF16_LOGPROB_TOLERANCE = 0.5
QKV_PROJ = {"auto": "layers.0.self_attn.qkv_proj", "transformers": "hf.model.layers.0.self_attn.q_proj"}


# ---- tiny random models, every feature --------------------------------------------------------

ATTENTION_BACKENDS = load_plugins()[1].names("attention")
SCHEDULE_POLICIES = load_plugins()[1].names("schedule_policy")


def test_engine_builds_and_steps_the_model_in_its_scheduler_thread(tiny_models, monkeypatch):
    """Torch's and srv's kernels run in one thread of the engine: each thread that starts OpenMP
    work gets a team of its own, and past one thread per core the runtime's threads sleep
    between parallel regions (a decode step ran 2.5 times slower with the model built in the
    caller's thread)."""
    from srv.engine import engine as engine_module
    from srv.engine.worker import Worker

    threads: dict[str, set[str]] = {"build": set(), "step": set()}
    build, run = engine_module.build_scheduler, Worker.run

    def recording_build(*args, **kwargs):
        threads["build"].add(threading.current_thread().name)
        return build(*args, **kwargs)

    def recording_run(self, *args, **kwargs):
        threads["step"].add(threading.current_thread().name)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(engine_module, "build_scheduler", recording_build)
    monkeypatch.setattr(Worker, "run", recording_run)
    with make_engine(tiny_models["llama"]) as engine:
        engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
    assert threads == {"build": {"srv-scheduler"}, "step": {"srv-scheduler"}}


def test_engine_that_fails_to_build_raises_in_the_caller(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        srv.Engine(model_path=str(tmp_path / "missing"))


@pytest.mark.parametrize("attention", ATTENTION_BACKENDS)
def test_tiny_never_reads_unwritten_kv_slots(tiny_models, attention):
    """The KV cache is allocated unwritten: poison every slot but 0 with NaN, and a batch of
    uneven prompts in pages of 16 (slots reserved past each request's tokens) still matches HF."""
    prompts = random_prompts(8)
    with make_engine(tiny_models["llama"], attention_backend=attention, page_size=16) as engine:
        for buffer in engine.runner.kv_cache.k_buffers + engine.runner.kv_cache.v_buffers:
            buffer[1:] = float("nan")
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, tiny_models["llama"], prompts, results)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attention", ATTENTION_BACKENDS)
def test_tiny_batched_every_attention_backend(tiny_models, kind, attention):
    prompts = random_prompts(8)
    with make_engine(tiny_models[kind], attention_backend=attention) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, tiny_models[kind], prompts, results)
        assert_all_kv_returned(engine)


@pytest.mark.parametrize("flags", [
    {"chunked_prefill_size": 16},
    {"page_size": 1},
    {"page_size": 16},
    {"page_size": 16, "chunked_prefill_size": 16},
    {"disable_radix_cache": True},
    {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_tiny_llama_memory_layouts(tiny_models, flags):
    prompts = random_prompts(8, seed=1)
    with make_engine(tiny_models["llama"], **flags) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, tiny_models["llama"], prompts, results)
        assert_all_kv_returned(engine)


@pytest.mark.parametrize("policy", SCHEDULE_POLICIES)
def test_tiny_llama_every_schedule_policy(tiny_models, policy):
    prompts = random_prompts(6, seed=2)
    with make_engine(tiny_models["llama"], schedule_policy=policy, max_running_requests=3) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_matches_hf(engine, tiny_models["llama"], prompts, results)


def test_tiny_llama_prefix_cache_hits_are_counted(tiny_models):
    shared = random_prompts(1, seed=3)[0] * 3
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    with make_engine(tiny_models["llama"], page_size=4) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        second = engine.generate(input_ids=prompts[1], sampling_params=GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0
        assert second["meta_info"]["cached_tokens"] == len(shared) // 4 * 4
        assert_matches_hf(engine, tiny_models["llama"], prompts, [first, second])
        assert_all_kv_returned(engine)


def test_tiny_llama_retraction_keeps_outputs(tiny_models):
    prompts = random_prompts(8, seed=4)
    with make_engine(tiny_models["llama"], max_total_tokens=200, chunked_prefill_size=64,
                     schedule_conservativeness=0) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert engine.scheduler.stats.retractions > 0
        assert_matches_hf(engine, tiny_models["llama"], prompts, results)
        assert_all_kv_returned(engine)


def test_tiny_llama_requests_join_a_running_batch(tiny_models):
    prompts = random_prompts(4, seed=5)
    with make_engine(tiny_models["llama"]) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=GREEDY, stream=True)
        chunks = [next(first), next(first)]  # the first request is decoding now
        results: dict[int, dict] = {}

        def run(i: int) -> None:
            results[i] = engine.generate(input_ids=prompts[i], sampling_params=GREEDY)

        threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 3)]
        for thread in threads:
            thread.start()
        chunks += list(first)
        for thread in threads:
            thread.join()
        steps_with_company = engine.scheduler.stats.forward_steps
        assert len(chunks[0]["output_ids"]) == 1
        assert_matches_hf(engine, tiny_models["llama"], prompts, [chunks[-1]] + [results[i] for i in (1, 2, 3)])
        assert steps_with_company < 4 * NEW_TOKENS  # decodes of different requests shared steps


def test_continuous_decode_steps_stream_tokens_in_groups_and_keep_the_output(tiny_models):
    """--num-continuous-decode-steps 4: while the running requests decode and none waits, a loop
    step runs four decode steps, so a stream's updates come four tokens at a time."""
    prompts = random_prompts(3, seed=11)
    with make_engine(tiny_models["llama"], num_continuous_decode_steps=4) as engine:
        lengths = [len(chunk["output_ids"]) for chunk in engine.generate(
            input_ids=prompts[0], sampling_params={**GREEDY, "ignore_eos": True}, stream=True)]
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    steps = [b - a for a, b in zip(lengths, lengths[1:])]
    assert lengths[0] == 1 and lengths[-1] == NEW_TOKENS and set(steps[:-1]) == {4}, lengths
    assert_matches_hf(engine, tiny_models["llama"], prompts, results)


def test_scheduler_recv_interval_takes_messages_every_nth_step_while_working(tiny_models):
    from srv.engine.scheduler_loop import SchedulerLoop

    class Working(SchedulerLoop):
        has_work = True

    prompts = random_prompts(2, seed=12)
    with make_engine(tiny_models["llama"], scheduler_recv_interval=3) as engine:
        loop, taken = Working(engine.scheduler), []
        for _ in range(7):
            taken.append(loop.receives_now())
            loop._steps_since_receive += 1   # as a step counts
        assert taken == [False, False, False, True, False, False, True]
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert_matches_hf(engine, tiny_models["llama"], prompts, results)


def test_sleep_on_idle_waits_longer_once_settled_and_a_request_still_ends_the_wait(tiny_models, monkeypatch):
    """--sleep-on-idle: an idle scheduler with nothing left for its pauses waits up to a second
    for a message (a tenth without the flag); a request arriving meanwhile is served at once."""
    import time

    from srv.engine.scheduler_loop import IDLE_SLEEP_S, SchedulerLoop

    monkeypatch.setattr("srv.engine.scheduler.PAUSE_S", 0.05)
    def settle(engine: srv.Engine) -> SchedulerLoop:
        engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 1})
        deadline = time.monotonic() + 30
        while not engine.scheduler.settled and time.monotonic() < deadline:
            time.sleep(0.05)
        return SchedulerLoop(engine.scheduler)

    with make_engine(tiny_models["llama"], sleep_on_idle=True) as engine:
        assert settle(engine).wait_s == IDLE_SLEEP_S
        time.sleep(0.3)   # the scheduler thread is in its long wait now
        started = time.monotonic()
        engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 1})
        assert time.monotonic() - started < IDLE_SLEEP_S / 2
    with make_engine(tiny_models["llama"]) as engine:
        assert settle(engine).wait_s == 0.1
