"""Scoring: token_ids_logprob on /generate and srv.Engine, /v1/score (plain, softmaxed,
item first, token ids, and SGLang's multi-item form with --multi-item-scoring-delimiter), each
against transformers' next-token distribution on the same weights."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import srv

from test_server import API_KEY, MODEL, Server, post

QUERY = "The capital of France is"
ITEMS = [" Paris. The capital of Italy is", " Rome. The capital of Spain is", " blue. Oranges are"]


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_next_logprobs(path, ids: list[int], labels: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = hf_model(str(path))(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)[labels].tolist()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def labels(tokenizer) -> list[int]:
    return [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" Madrid", " Rome", " apples")]


def test_token_ids_logprob_follows_the_named_tokens_at_every_position(default_model_dir, tokenizer, labels):
    ids = tokenizer.encode(QUERY + ITEMS[0])
    with srv.Engine(model_path=str(default_model_dir), dtype="float32") as engine:
        result = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                                  "token_ids_logprob": labels})
        with pytest.raises(ValueError, match="token_ids_logprob"):
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "token_ids_logprob": [10**6]})
    positions = result["meta_info"]["output_token_ids_logprobs"]
    assert len(positions) == 3 and [t for _, t in positions[0]] == labels
    for j, position in enumerate(positions):
        want = hf_next_logprobs(default_model_dir, ids + result["output_ids"][:j], labels)
        assert [v for v, _ in position] == pytest.approx(want, abs=2e-3)


@pytest.fixture(scope="module")
def server():
    server = Server("--api-key", API_KEY, "--multi-item-scoring-delimiter", "0")
    yield server
    server.stop()


def test_multi_item_scoring_scores_query_delimiter_item_delimiter(server, default_model_dir, tokenizer, labels):
    body = {"model": MODEL, "query": QUERY, "items": ITEMS, "label_token_ids": labels}
    scores = post(server, "/v1/score", body).json()["scores"]
    query = tokenizer.encode(QUERY)
    for item, got in zip(ITEMS, scores):
        ids = query + [0] + tokenizer.encode(item, add_special_tokens=False) + [0]
        assert got == pytest.approx([math.exp(v) for v in hf_next_logprobs(default_model_dir, ids, labels)], rel=2e-3)
    refused = post(server, "/v1/score", {**body, "item_first": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "item_first"


def test_return_hidden_states_gives_every_positions_final_hidden_state(default_model_dir, tokenizer):
    """--enable-return-hidden-states: the final norm's output at every position the request
    computed (its prompt, then each output token but the last), as transformers computes them;
    the same again when the prompt is in the prefix cache."""
    ids = tokenizer.encode(QUERY + ITEMS[0])
    params = {"max_new_tokens": 4, "temperature": 0, "return_hidden_states": True}
    with srv.Engine(model_path=str(default_model_dir), dtype="float32", enable_return_hidden_states=True) as engine:
        first = engine.generate(input_ids=ids, sampling_params=params)
        again = engine.generate(input_ids=ids, sampling_params=params)
    sequence = ids + first["output_ids"][:-1]
    with torch.inference_mode():
        want = hf_model(str(default_model_dir))(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]
    for result in (first, again):
        got = torch.tensor(result["meta_info"]["hidden_states"])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.float(), atol=2e-3, rtol=1e-3)
    with srv.Engine(model_path=str(default_model_dir), dtype="float32") as engine:
        with pytest.raises(ValueError, match="--enable-return-hidden-states"):
            engine.generate(input_ids=ids, sampling_params=params)


FORCING_PROCESSOR = '''
from srv.sdk.logit_processor import CustomLogitProcessor

class OnlyToken(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list):
            token = params["token_id"]
            kept = logits[row, token].clone()
            logits[row] = float("-inf")
            logits[row, token] = kept
        return logits

print(OnlyToken.to_str())
'''


def test_custom_logit_processor_in_sglangs_wire_format(default_model_dir):
    """A processor class defined in a client's __main__ travels by value (dill) and runs on its
    requests' rows only, with each request's custom_params; without the flag it is refused."""
    import subprocess
    import sys

    text = subprocess.run([sys.executable, "-c", FORCING_PROCESSOR], capture_output=True, text=True,
                          check=True).stdout.strip()
    forced = {"max_new_tokens": 3, "temperature": 0, "custom_logit_processor": text, "custom_params": {"token_id": 42}}
    with srv.Engine(model_path=str(default_model_dir), dtype="float32", enable_custom_logit_processor=True) as engine:
        plain, got = engine.generate(["Hello", "Hello"], [{"max_new_tokens": 3, "temperature": 0}, forced])
        assert got["output_ids"] == [42, 42, 42] and plain["output_ids"] != [42, 42, 42]
        with pytest.raises(ValueError, match="could not be loaded"):
            engine.generate("Hello", {**forced, "custom_logit_processor": '{"callable": "00"}'})
    with srv.Engine(model_path=str(default_model_dir), dtype="float32") as engine:
        with pytest.raises(ValueError, match="--enable-custom-logit-processor"):
            engine.generate("Hello", forced)
