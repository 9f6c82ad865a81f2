"""--enable-tokenizer-batch-encode and --enable-dynamic-batch-tokenizer: prompts encoded in one
tokenizer call give the ids each gets alone, and the requests the output they get without."""

from __future__ import annotations

import asyncio

import pytest

from srv.engine.batch_tokenizer import DynamicBatchTokenizer, encode_batch
from srv.engine.tokenizer import hf_tokenizer
from test_engine import make_engine

TEXTS = ["Hello, world!", "", "The capital of France is", "naïve café — ünïcödé ✓", "a " * 300, "\n\t  spaces  "]
GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return hf_tokenizer(str(default_model_dir))


def test_a_batch_encodes_each_text_as_alone(tokenizer):
    for special in (True, False):
        assert encode_batch(tokenizer, TEXTS, special) == [tokenizer.encode(t, add_special_tokens=special)
                                                           for t in TEXTS]


class Picky:
    """A tokenizer that cannot take one text: a batch holding it fails as a whole."""

    def __init__(self, tokenizer, refused: str) -> None:
        self.tokenizer, self.refused = tokenizer, refused

    def __call__(self, texts, **kwargs):
        if self.refused in texts:
            raise ValueError(f"cannot take {self.refused!r}")
        return self.tokenizer(texts, **kwargs)


def test_texts_arriving_together_are_encoded_in_one_call_and_a_bad_one_fails_alone(tokenizer):
    async def run(batcher: DynamicBatchTokenizer, texts: list[str]) -> list:
        return await asyncio.gather(*(batcher.encode(t) for t in texts), return_exceptions=True)

    async def off_loop(function):
        return function()

    batcher = DynamicBatchTokenizer(tokenizer, 32, 0.05, off_loop)
    assert asyncio.run(run(batcher, TEXTS)) == [tokenizer.encode(t) for t in TEXTS]
    assert batcher.batches == 1
    small = DynamicBatchTokenizer(tokenizer, 4, 0.05, off_loop)
    assert asyncio.run(run(small, TEXTS)) == [tokenizer.encode(t) for t in TEXTS] and small.batches == 2
    picky = DynamicBatchTokenizer(Picky(tokenizer, "bad"), 32, 0.05, off_loop)
    results = asyncio.run(run(picky, ["good", "bad", "fine"]))
    assert results[0] == tokenizer.encode("good") and results[2] == tokenizer.encode("fine")
    assert isinstance(results[1], ValueError)


def test_requests_get_the_output_they_get_without_batching(tiny_models):
    prompts = ["one two three", "four five", "six seven eight nine"]
    with make_engine(tiny_models["llama"]) as engine:
        expected = [r["output_ids"] for r in engine.generate(prompts, GREEDY)]
    for flags in ({"enable_tokenizer_batch_encode": True}, {"enable_dynamic_batch_tokenizer": True}):
        with make_engine(tiny_models["llama"], **flags) as engine:
            assert [r["output_ids"] for r in engine.generate(prompts, GREEDY)] == expected, flags
            assert engine.generate(prompts[1], GREEDY)["output_ids"] == expected[1], flags
