"""Weights at run time: /update_weights_from_disk (running requests finish first; a checkpoint
that does not fit is refused and the served one stays), /get_weights_by_name,
/update_weight_version, and /release_memory_occupation with /resume_memory_occupation under
--enable-memory-saver; each against transformers' greedy output of the checkpoint served."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from test_server import AUTH, API_KEY, Server, post

PROMPT = list(range(5, 17))


def greedy(path: Path, tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny llama, and a copy of it with other weights (the same shapes)."""
    first = tiny_models["llama"]
    second = tmp_path_factory.mktemp("retrained") / "llama"
    shutil.copytree(first, second)
    tensors = load_file(second / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    save_file({name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in tensors.items()},
              second / "model.safetensors", metadata={"format": "pt"})
    return first, second


@pytest.fixture(scope="module")
def server(checkpoints):
    server = Server("--api-key", API_KEY, "--model-path", str(checkpoints[0]), "--enable-memory-saver")
    yield server
    server.stop()


def generate(server: Server, tokens: int = 8) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    return post(server, "/generate", body).json()["output_ids"]


def test_new_weights_from_disk_after_the_running_requests(server, checkpoints, tiny_models):
    first, second = checkpoints
    assert generate(server) == greedy(first, 8)
    before = post(server, "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 4}).json()
    assert before == pytest.approx(load_file(first / "model.safetensors")["model.embed_tokens.weight"].flatten()[:4].tolist())
    running: list = []
    thread = threading.Thread(target=lambda: running.append((generate(server, 300), time.monotonic())))
    thread.start()
    time.sleep(0.5)
    answer = post(server, "/update_weights_from_disk", {"model_path": str(second), "weight_version": "v2"})
    updated_at = time.monotonic()
    thread.join(timeout=60)
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert running[0][1] <= updated_at and running[0][0][:8] == greedy(first, 8)   # it finished on the old weights
    assert generate(server) == greedy(second, 8)
    after = post(server, "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 4}).json()
    assert after != before
    info = httpx.get(f"{server.base}/get_model_info", headers=AUTH).json()
    assert info["weight_version"] == "v2"
    assert post(server, "/update_weight_version", {"new_version": "v3"}).json()["new_version"] == "v3"
    assert httpx.get(f"{server.base}/get_model_info", headers=AUTH).json()["weight_version"] == "v3"
    # What does not load, or does not fit, is refused; the served weights stay.
    missing = post(server, "/update_weights_from_disk", {"model_path": "/nonexistent/checkpoint"})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    other = post(server, "/update_weights_from_disk", {"model_path": str(tiny_models["qwen3"])})
    assert other.status_code == 400 and "not a checkpoint of the served model" in other.json()["error"]["message"]
    assert post(server, "/get_weights_by_name", {"name": "no.such.weight"}).status_code == 400
    assert generate(server) == greedy(second, 8)
    assert post(server, "/update_weights_from_disk", {"model_path": str(first)}).json()["success"]


def test_released_memory_holds_requests_until_resumed(server, checkpoints):
    want = generate(server)
    assert post(server, "/release_memory_occupation", b"").status_code == 200
    assert post(server, "/continue_generation", b"").status_code == 400
    results: list = []
    thread = threading.Thread(target=lambda: results.append(generate(server)))
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive()
    refused = post(server, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert refused.status_code == 400   # a request waits: only an idle server releases
    assert post(server, "/resume_memory_occupation", b"").status_code == 200
    thread.join(timeout=60)
    assert results == [want]
    assert post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert generate(server) == want
