"""Conformance kit for warm-ups (`--warmups`)."""

from __future__ import annotations

import time
from typing import Any, Callable

from srv.sdk.testing.registry import create
from srv.sdk.warmup import Warmup


class WarmupKit:
    """Runs a warm-up on srv's tiny test model through srv.Engine (the `srv_engine_factory`
    fixture): it ends within `timeout_s`, and leaves no request running or waiting and every
    KV slot free; the engine then still answers.

        class TestMyWarmup(WarmupKit):
            warmup_name = "mywarmup"          # the name your plugin registers, or:
            # warmup_factory = MyWarmup       # (server_args) -> Warmup
    """

    warmup_name: str | None = None
    warmup_factory: Callable[[Any], Warmup] | None = None
    timeout_s: float = 120.0

    def make_warmup(self) -> Warmup:
        return create(self, "warmup", "warmup_name", "warmup_factory", None)

    def test_runs_to_its_end_and_leaves_nothing_behind(self, srv_engine_factory) -> None:
        engine = srv_engine_factory()
        started = time.monotonic()
        engine.warm_up(self.make_warmup())
        assert time.monotonic() - started <= self.timeout_s, "the warm-up took longer than timeout_s"
        status = engine.status()
        assert status["running_requests"] == 0 and status["waiting_requests"] == 0
        assert engine.flush_cache() and engine.status()["kv_tokens_in_use"] == 0, "KV memory left behind"
        result = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})
        assert len(result["output_ids"]) == 2
