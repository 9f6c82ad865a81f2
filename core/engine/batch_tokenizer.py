"""Prompts encoded together: one tokenizer call for many texts, where a fast tokenizer encodes
the batch on all its threads and the front end's worker thread is crossed once.

`--enable-tokenizer-batch-encode`: a request's several text prompts (a batch of completions, a
list of embedding inputs) in one call. `--enable-dynamic-batch-tokenizer`: the prompts of
requests that arrive together, one each, collected for up to `--dynamic-batch-tokenizer-batch-
timeout` seconds or `--dynamic-batch-tokenizer-batch-size` prompts, whichever comes first.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable


def encode_batch(tokenizer: Any, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Each text's ids, as `tokenizer.encode(text, add_special_tokens=...)` gives them."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


class DynamicBatchTokenizer:
    """Encodes the texts `encode` is given within a short window in one batch; `run_off_loop`
    runs a call in the front end's worker thread. The first text of a batch starts its window;
    the batch is encoded when the window closes or the batch is full, by a task that ends with
    it. A batch the tokenizer refuses is encoded text by text, so that only the text it cannot
    take fails."""

    def __init__(self, tokenizer: Any, batch_size: int, timeout_s: float,
                 run_off_loop: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        self.tokenizer, self.batch_size, self.timeout_s = tokenizer, batch_size, timeout_s
        self.run_off_loop = run_off_loop
        self._pending: list[tuple[str, bool, asyncio.Future]] = []
        self._window: asyncio.TimerHandle | None = None
        self.batches = 0   # tokenizer calls made (what the tests read)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((text, bool(add_special_tokens), future))
        if len(self._pending) >= self.batch_size:
            self._flush()
        elif self._window is None:
            self._window = loop.call_later(self.timeout_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None
        batch, self._pending = self._pending, []
        for flag in (True, False):
            part = [item for item in batch if item[1] is flag]
            if part:
                asyncio.ensure_future(self._encode(part, flag))

    async def _encode(self, part: list[tuple[str, bool, asyncio.Future]], add_special_tokens: bool) -> None:
        texts = [text for text, _, _ in part]
        self.batches += 1
        try:
            results: list[Any] = await self.run_off_loop(lambda: encode_batch(self.tokenizer, texts, add_special_tokens))
        except Exception:
            results = []
            for text in texts:
                try:
                    results.append(await self.run_off_loop(lambda t=text: encode_batch(self.tokenizer, [t],
                                                                                         add_special_tokens)[0]))
                except Exception as exc:
                    results.append(exc)
        for (_, _, future), result in zip(part, results):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
