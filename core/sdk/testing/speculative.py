"""Conformance kit for speculative decoding algorithms (`--speculative-algorithm`).

The algorithm runs inside srv.Engine on the tiny Llama (vocab 256) with prompts that repeat
themselves, so that drafts get proposed, and is held to what every algorithm owes: greedy
output token for token the target's own (transformers'), alone and batched, beside
grammar-constrained rows; drafts actually proposed; KV memory all back after many rejections.
Set `engine_flags` (or override `launch_flags`) for what the algorithm needs (a draft model
path, say).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from srv.sdk.testing.models import _engine_backend
from srv.sdk.testing.tiny_model import hf_greedy, random_prompts, tiny_llama, write_tiny_llama


def repeating_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts whose latter half repeats their first: an n-gram or a model can draft from them."""
    return [p + p + p[: len(p) // 2] for p in random_prompts([6, 11, 4, 20], seed=seed)]


class SpeculativeAlgorithmKit:
    backend_name: str | None = None
    #: factory(context: SpeculativeContext) -> SpeculativeAlgorithm, instead of backend_name
    algorithm_factory: Callable[..., Any] | None = None
    #: more launch flags for the engine (for example speculative_draft_model_path)
    engine_flags: dict[str, Any] = {}
    new_tokens: int = 16

    @classmethod
    def launch_flags(cls, model_dir: Path) -> dict[str, Any]:
        """The engine's extra flags, given the tiny target's directory (a STANDALONE kit may
        name it as its own draft model): engine_flags by default."""
        return dict(cls.engine_flags)

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return write_tiny_llama(tmp_path_factory.mktemp("speculative-kit") / "llama")

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_engine(cls, srv_kit_model_dir: Path) -> Iterator[Any]:
        from srv import Engine  # lazily: the public entry point, and all of srv's core behind it

        yield from cls._engine(Engine, srv_kit_model_dir, max_total_tokens=4096)

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_engine_tp2(cls, srv_kit_model_dir: Path) -> Iterator[Any]:
        """The target split over two ranks, processes of one torch thread each."""
        from srv import Engine  # lazily, as srv_kit_engine

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("OMP_NUM_THREADS", "1")   # the ranks share this machine's cores (read as they start)
            engines = cls._engine(Engine, srv_kit_model_dir, tp_size=2)
            engine = next(engines)
        yield engine
        next(engines, None)   # shuts it down

    @classmethod
    def _engine(cls, engine_class: Any, model_dir: Path, **flags: Any) -> Iterator[Any]:
        """An engine (srv.Engine, which only fixtures import) of the kit's algorithm on the tiny
        target, until the generator resumes."""
        with _engine_backend(cls(), "speculative_algorithm", "backend_name", "algorithm_factory") as name:
            engine = engine_class(model_path=str(model_dir), dtype="float32", speculative_algorithm=name,
                            **cls.launch_flags(model_dir), **flags)
        try:
            yield engine
        finally:
            engine.shutdown()

    def greedy(self) -> dict[str, Any]:
        return {"max_new_tokens": self.new_tokens, "temperature": 0, "ignore_eos": True}

    def test_greedy_output_is_the_targets(self, srv_kit_engine: Any) -> None:
        prompts = repeating_prompts()
        before = srv_kit_engine.status()["spec_draft_tokens"]
        single = srv_kit_engine.generate(input_ids=prompts[0], sampling_params=self.greedy())
        batched = srv_kit_engine.generate(input_ids=prompts, sampling_params=self.greedy())
        for prompt, result in zip([prompts[0]] + prompts, [single] + batched):
            assert result["output_ids"] == hf_greedy(tiny_llama(), prompt, self.new_tokens), f"prompt {prompt[:6]}..."
        assert srv_kit_engine.status()["spec_draft_tokens"] > before, \
            "the algorithm proposed no drafts for prompts that repeat themselves"

    def test_greedy_output_is_the_targets_at_tensor_parallel_size_2(self, srv_kit_engine_tp2: Any) -> None:
        """The algorithm's reads of the target (hidden states, head, embedding) and its accepted
        drafts' KV moves reach every rank's share."""
        prompts = repeating_prompts(seed=3)[:2]
        results = srv_kit_engine_tp2.generate(input_ids=prompts, sampling_params=self.greedy())
        assert srv_kit_engine_tp2.status()["spec_draft_tokens"] > 0, "the algorithm proposed no drafts at tp=2"
        for prompt, result in zip(prompts, results):
            assert result["output_ids"] == hf_greedy(tiny_llama(), prompt, self.new_tokens), f"prompt {prompt[:6]}..."

    def test_free_rows_beside_constrained_rows(self, srv_kit_engine: Any) -> None:
        prompts = repeating_prompts(seed=1)
        params = [self.greedy(), {**self.greedy(), "regex": "(t1[0-9] )+"}, self.greedy()]
        results = srv_kit_engine.generate(input_ids=prompts[:3], sampling_params=params)
        for i in (0, 2):
            assert results[i]["output_ids"] == hf_greedy(tiny_llama(), prompts[i], self.new_tokens)
        assert results[1]["text"].startswith("t1"), results[1]["text"]

    def test_kv_memory_all_returned(self, srv_kit_engine: Any) -> None:
        prompts = [p[::-1] + p for p in random_prompts([30, 7, 15], seed=2)]
        srv_kit_engine.generate(input_ids=prompts, sampling_params={**self.greedy(), "max_new_tokens": 40})
        assert srv_kit_engine.flush_cache()
        assert srv_kit_engine.status()["kv_tokens_in_use"] == 0
