"""srv's warm-ups: a long prefill, and decode steps at every batch size up to 16."""

from __future__ import annotations

import random

from srv.sdk.warmup import Warmup, WarmupClient

LONG_PROMPT_TOKENS = 1024   # without a --chunked-prefill-size
DECODE_BATCH_SIZES = 16
SEED = 0


def random_ids(rng: random.Random, client: WarmupClient, length: int) -> list[int]:
    return [rng.randrange(1, client.vocab_size) for _ in range(length)]


class LongPrefill(Warmup):
    async def run(self, client: WarmupClient) -> None:
        chunk = client.chunked_prefill_size if client.chunked_prefill_size > 0 else LONG_PROMPT_TOKENS
        length = max(1, min(chunk, client.context_len - 2))
        await client.generate([random_ids(random.Random(SEED), client, length)], 1)


class DecodeBatch(Warmup):
    async def run(self, client: WarmupClient) -> None:
        rng = random.Random(SEED)
        # Each request decodes longer than the one after it, so the batch shrinks by one a step
        # and every size from the largest down to one runs.
        size = max(1, min(DECODE_BATCH_SIZES, client.max_running_requests))
        await client.generate([random_ids(rng, client, 8) for _ in range(size)],
                              [size - i + 1 for i in range(size)])
