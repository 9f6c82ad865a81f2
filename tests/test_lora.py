"""LoRA adapters against PEFT on the same base and adapter: random adapters of different ranks
and target modules on tiny Llama and Qwen3 models, alone and in a batch that mixes adapters and
the base model; the prefix cache never hands one adapter's KV to another; the routes."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch

import srv
from srv.sdk import requires_cpu_flags
from srv.sdk.testing import LoRABackendKit

from test_engine import random_prompts

NEW_TOKENS = 8
ADAPTERS = {"small": (4, ["q_proj", "v_proj"]), "wide": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]),
            "mlp": (2, ["down_proj", "up_proj"])}


class TestTorchLoRA(LoRABackendKit):
    backend_name = "torch"


class TestCPULoRA(LoRABackendKit):
    backend_name = "cpu"


def cpu_backend_on(isa: str | None = None, parallel_work: int | None = None):
    def factory(server_args):
        from srv.plugins.lora.cpu_backend import CPULoRABackend

        backend = CPULoRABackend(server_args)
        if isa is not None:
            backend.isa = isa
        if parallel_work is not None:
            backend.batch.parallel_work = parallel_work
        return backend
    return staticmethod(factory)


class TestCPULoRAThreaded(LoRABackendKit):
    """The passes shared among threads, as a prefill's many rows run them."""
    backend_factory = cpu_backend_on(parallel_work=0)


class TestCPULoRAPortable(LoRABackendKit):
    """The kernel's portable body, which CPUs without AVX2 run."""
    backend_factory = cpu_backend_on("portable")


@pytest.mark.skipif(not requires_cpu_flags("avx2", "fma")().ok, reason="the CPU has no AVX2 and FMA")
class TestCPULoRAAVX2(LoRABackendKit):
    """The AVX2 body on a CPU whose best is AVX-512."""
    backend_factory = cpu_backend_on("avx2")


def make_adapter(base: Path, folder: Path, rank: int, targets: list[str], seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            init_lora_weights=False))   # random A and B, not a no-op
    peft.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tiny_models, tmp_path_factory):
    base = tiny_models[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {name: make_adapter(base, root / name, rank, targets, seed)
                for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items())}
    return base, adapters


@functools.cache
def peft_greedy(base: str, adapter: str | None, prompt: tuple[int, ...]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_mixed_batch_gives_each_request_its_adapters_output(setup, backend, monkeypatch):
    from srv.plugins.models.llama import LlamaForCausalLM

    base, adapters = setup
    paths = [f"{name}={path}" for name, path in adapters.items()]
    prompts = random_prompts(8, seed=7)
    names = [None, "small", "wide", "mlp"] * 2
    params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
               **({"lora_path": name} if name else {})} for name in names]
    native_steps = []
    decode_natively = LlamaForCausalLM._decode_natively

    def counted(self, *args):
        result = decode_natively(self, *args)
        native_steps.append(result is not None)
        return result

    monkeypatch.setattr(LlamaForCausalLM, "_decode_natively", counted)
    with srv.Engine(model_path=str(base), dtype="float32", lora_paths=paths, page_size=4,
                    lora_backend=backend) as engine:
        together = engine.generate(input_ids=prompts, sampling_params=params)
        # The same prompt under each adapter, one after another: the prefix cache holds the KV
        # the batch computed for it under "wide", which only "wide" may take; then again, each
        # adapter (and the base model) finding its own.
        prompt = prompts[6]
        same = [engine.generate(input_ids=prompt, sampling_params=p) for p in params[:4]]
        again = [engine.generate(input_ids=prompt, sampling_params=p) for p in params[:4]]
        with pytest.raises(ValueError, match="no LoRA adapter 'absent'"):
            engine.generate(input_ids=prompts[0], sampling_params={"lora_path": "absent"})
    for ids, name, result in zip(prompts, names, together):
        want = peft_greedy(str(base), str(adapters[name]) if name else None, tuple(ids))
        assert result["output_ids"] == want, name
    whole_pages = (len(prompt) - 1) // 4 * 4   # page size 4: the pages before the last prompt token
    for name, first, second in zip(names[:4], same, again):
        want = peft_greedy(str(base), str(adapters[name]) if name else None, tuple(prompt))
        assert first["output_ids"] == second["output_ids"] == want, name
        assert first["meta_info"]["cached_tokens"] == (whole_pages if name == names[6] else 0), name
        assert second["meta_info"]["cached_tokens"] == whole_pages, name
    # The cpu backend's layer kernels keep the C decode steps (for a model that has them: not
    # Qwen3's, whose query/key norms have no C step); the torch backend's layers have none.
    assert any(native_steps) == (backend == "cpu" and "qwen3" not in base.name), native_steps[:8]


def test_adapters_change_the_output_and_the_routes_select_them(setup):
    from test_server import AUTH, API_KEY, Server, post

    base, adapters = setup
    prompt = random_prompts(1, seed=11)[0]
    outputs = {name: peft_greedy(str(base), str(path), tuple(prompt)) for name, path in adapters.items()}
    assert any(output != peft_greedy(str(base), None, tuple(prompt)) for output in outputs.values())
    server = Server("--api-key", API_KEY, "--model-path", str(base), "--served-model-name", "tiny",
                    "--lora-paths", f"wide={adapters['wide']}", "--max-lora-rank", "8")
    try:
        import httpx

        models = httpx.get(f"{server.base}/v1/models", headers=AUTH).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "wide"] and models[1]["parent"] == "tiny"
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        native = post(server, "/generate", {"input_ids": prompt, "sampling_params": params, "lora_path": "wide"})
        assert native.json()["output_ids"] == outputs["wide"]
        for model in ("tiny:wide", "wide"):
            completion = post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                          "temperature": 0, "ignore_eos": True}).json()
            assert completion["choices"][0]["text"] == native.json()["text"], model
        assert post(server, "/v1/completions", {"model": "tiny:other", "prompt": "x"}).status_code == 404
        assert post(server, "/generate", {"text": "x", "lora_path": "other"}).status_code == 400
    finally:
        server.stop()


def test_lora_flags_are_checked_at_launch(setup, tmp_path):
    base, adapters = setup
    with pytest.raises(ValueError, match="over --max-lora-rank 4"):
        srv.Engine(model_path=str(base), lora_paths=[f"wide={adapters['wide']}"], max_lora_rank=4)
    with pytest.raises(ValueError, match="outside --lora-target-modules"):
        srv.Engine(model_path=str(base), lora_paths=[f"mlp={adapters['mlp']}"], lora_target_modules=["q_proj"])
    with pytest.raises(SystemExit):
        srv.Engine(model_path=str(base), lora_paths=[f"mlp={adapters['mlp']}"], lora_backend="csgmv")


def test_adapters_load_and_unload_at_run_time(setup):
    import threading

    base, adapters = setup
    prompt = random_prompts(1, seed=12)[0]
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with srv.Engine(model_path=str(base), dtype="float32", enable_lora=True, max_loras_per_batch=1,
                    max_loaded_loras=1) as engine:
        assert engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"] == \
            peft_greedy(str(base), None, tuple(prompt))
        assert engine.load_lora_adapter("small", str(adapters["small"])) == ["small"]
        with pytest.raises(ValueError, match="--max-loaded-loras"):
            engine.load_lora_adapter("wide", str(adapters["wide"]))
        with pytest.raises(ValueError, match="already loaded"):
            engine.load_lora_adapter("small", str(adapters["small"]))
        with pytest.raises(ValueError, match="adapter_config.json"):
            engine.load_lora_adapter("missing", "/nonexistent/adapter")
        assert engine.generate(input_ids=prompt, sampling_params={**greedy, "lora_path": "small"})["output_ids"] == \
            peft_greedy(str(base), str(adapters["small"]), tuple(prompt))
        # An adapter in use is not unloaded under its request.
        long = threading.Thread(target=lambda: engine.generate(
            input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 400, "lora_path": "small"}))
        long.start()
        deadline = time.monotonic() + 30
        while not engine.status()["running_requests"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(ValueError, match="serves 1 request"):
            engine.unload_lora_adapter("small")
        long.join(timeout=120)
        assert engine.unload_lora_adapter("small") == []
        with pytest.raises(ValueError, match="no LoRA adapter 'small'"):
            engine.generate(input_ids=prompt, sampling_params={**greedy, "lora_path": "small"})
        assert engine.load_lora_adapter("wide", str(adapters["wide"])) == ["wide"]
        assert engine.generate(input_ids=prompt, sampling_params={**greedy, "lora_path": "wide"})["output_ids"] == \
            peft_greedy(str(base), str(adapters["wide"]), tuple(prompt))


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_more_adapters_than_slots_take_turns(setup, policy):
    """Three adapters, two slots: the scheduler runs at most two adapters at once, and a batch's
    adapter takes the slot of one the batch does not use."""
    base, adapters = setup
    prompts = random_prompts(6, seed=21)
    names = ["small", "wide", "mlp", None, "mlp", "small"]
    params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
               **({"lora_path": name} if name else {})} for name in names]
    paths = [f"{name}={path}" for name, path in adapters.items()]
    with srv.Engine(model_path=str(base), dtype="float32", lora_paths=paths, max_loras_per_batch=2,
                    lora_eviction_policy=policy) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=params)
        lora = engine.runner.lora
        assert len(lora.slots) == 2 and lora.names == list(adapters)
    for ids, name, result in zip(prompts, names, results):
        assert result["output_ids"] == peft_greedy(str(base), str(adapters[name]) if name else None, tuple(ids)), name
    with pytest.raises(ValueError, match="--max-loaded-loras"):
        srv.Engine(model_path=str(base), lora_paths=paths, max_loras_per_batch=2, max_loaded_loras=1)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-uneven-heads"])
def test_the_default_model_with_a_random_adapter(default_model_dir, tmp_path, tp, monkeypatch):
    # At tp=2 the default model's 3 key/value head groups split 2 + 1, and its decode steps run
    # each rank's layers (the adapters' kernels with them) in one C call.
    if tp > 1:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    adapter = make_adapter(default_model_dir, tmp_path / "default-lora", 8, ["q_proj", "v_proj", "down_proj"], seed=9)
    prompts = random_prompts(2, seed=13)
    params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "lora_path": "mine"},
              {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}]
    with srv.Engine(model_path=str(default_model_dir), dtype="float32", lora_paths=[f"mine={adapter}"],
                    tp_size=tp) as engine:
        adapted, base = engine.generate(input_ids=prompts, sampling_params=params)
    assert adapted["output_ids"] == peft_greedy(str(default_model_dir), str(adapter), tuple(prompts[0]))
    assert base["output_ids"] == peft_greedy(str(default_model_dir), None, tuple(prompts[1]))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_adapters_split_over_ranks_give_peft_output(setup, tp, pp, monkeypatch):
    """Each rank holds its part of every adapter (B's rows where the layer splits its output, A's
    columns where it splits its input; a pipeline stage its own layers'), loaded at launch or at
    run time; a prefill's micro-batches each find their requests' adapters."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # the ranks share this machine's cores
    base, adapters = setup
    prompts = random_prompts(8, seed=9)
    names = [None, "small", "wide", "mlp"] * 2
    params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
               **({"lora_path": name} if name else {})} for name in names]
    with srv.Engine(model_path=str(base), dtype="float32", tp_size=tp, pp_size=pp, page_size=4,
                    lora_paths=[f"{name}={adapters[name]}" for name in ("small", "wide")]) as engine:
        assert engine.load_lora_adapter("mlp", str(adapters["mlp"])) == ["small", "wide", "mlp"]
        results = engine.generate(input_ids=prompts, sampling_params=params)
    for ids, name, result in zip(prompts, names, results):
        assert result["output_ids"] == peft_greedy(str(base), str(adapters[name]) if name else None, tuple(ids)), name


def test_an_adapter_of_other_shapes_is_refused_and_the_server_goes_on(setup, tmp_path):
    import json

    from safetensors.torch import save_file

    base, adapters = setup
    folder = tmp_path / "misfit"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.randn(4, 96), f"{prefix}.lora_B.weight": torch.randn(64, 4)},
              str(folder / "adapter_model.safetensors"))
    prompt = random_prompts(1, seed=3)[0]
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with srv.Engine(model_path=str(base), dtype="float32", enable_lora=True) as engine:
        with pytest.raises(ValueError, match="do not fit the model's self_attn.qkv_proj"):
            engine.load_lora_adapter("misfit", str(folder))
        assert engine.load_lora_adapter("small", str(adapters["small"])) == ["small"]
        assert engine.generate(input_ids=prompt, sampling_params={**greedy, "lora_path": "small"})["output_ids"] == \
            peft_greedy(str(base), str(adapters["small"]), tuple(prompt))


def test_speculative_decoding_keeps_each_requests_adapters_output(setup):
    """The base model as its own draft (STANDALONE, which never loads the adapters): drafts hold
    for the base model's requests and often fail for the adapters', whose verify rows run each
    request's adapter; every output is PEFT's."""
    base, adapters = setup
    prompts = random_prompts(4, seed=21)
    names = [None, "small", "wide", "mlp"]
    params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
               **({"lora_path": name} if name else {})} for name in names]
    with srv.Engine(model_path=str(base), dtype="float32", lora_paths=[f"{n}={p}" for n, p in adapters.items()],
                    speculative_algorithm="STANDALONE", speculative_draft_model_path=str(base),
                    speculative_num_draft_tokens=4) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.scheduler.stats
        assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > stats.spec_verifies, vars(stats)
    for ids, name, result in zip(prompts, names, results):
        assert result["output_ids"] == peft_greedy(str(base), str(adapters[name]) if name else None, tuple(ids)), name
