"""srv's pytest plugin (entry point `srv` in the `pytest11` group): loaded by pytest wherever
srv is installed, it offers two fixtures for tests that need a running model.

srv_tiny_model_dir (session): a directory holding a tiny random Llama (2 layers, vocab 256,
    float32 safetensors) with a word-level tokenizer ("t3" .. "t255" are ids 3 .. 255), built
    in code: nothing is downloaded. Greedy references: srv.sdk.testing.hf_greedy(
    srv.sdk.testing.tiny_llama(), ids, n).

srv_engine_factory: a function `make(**flags) -> srv.Engine` taking any launch flag as a
    keyword (model_path defaults to srv_tiny_model_dir, dtype to "float32", max_total_tokens to
    4096); every engine it made is shut down when the test ends::

        def test_my_sampler(srv_engine_factory):
            engine = srv_engine_factory(sampling_backend="my_sampler")
            engine.generate("t5 t6 t7", {"max_new_tokens": 4, "temperature": 0})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest


@pytest.fixture(scope="session")
def srv_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from srv.sdk.testing.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("srv-tiny-model") / "llama")


@pytest.fixture
def srv_engine_factory(srv_tiny_model_dir: Path) -> Iterator[Callable[..., Any]]:
    engines: list[Any] = []

    def make(**flags: Any) -> Any:
        from srv import Engine  # lazily: the public entry point, and all of srv's core behind it

        flags = {"model_path": str(srv_tiny_model_dir), "dtype": "float32", "max_total_tokens": 4096, **flags}
        engines.append(Engine(**flags))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()
