"""`--warmups a,b`: the named warm-up plugins (family `warmup`), run in order once the server's
own one-token probe has passed and before it listens (and by srv.Engine once it is built); each
as requests through the front end."""

from __future__ import annotations

import logging
import time
from argparse import Namespace
from typing import Any

from srv.args.parser import warmup_names
from srv.backend_registry import BackendRegistry
from srv.engine.frontend import Frontend

logger = logging.getLogger("srv.engine")


class FrontendWarmupClient:
    """srv.sdk.warmup.WarmupClient over the front end: greedy requests that ignore end tokens."""

    def __init__(self, frontend: Frontend, chunked_prefill_size: int, max_running_requests: int) -> None:
        self.frontend = frontend
        self.vocab_size = frontend.limits.vocab_size
        self.context_len = frontend.context_len
        self.chunked_prefill_size, self.max_running_requests = chunked_prefill_size, max_running_requests

    async def generate(self, input_ids: list[list[int]], max_new_tokens: Any) -> list[list[int]]:
        counts = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(input_ids)
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in counts]
        groups = await self.frontend.generate([None] * len(input_ids), input_ids, params)
        return [list(group[0].output_ids) for group in groups]


async def run_warmups(args: Namespace, registry: BackendRegistry, client: Any) -> None:
    for name in warmup_names(args):
        started = time.monotonic()
        await registry.choose("warmup", name).create(args).run(client)
        logger.info("warm-up %s done in %.2fs", name, time.monotonic() - started)
