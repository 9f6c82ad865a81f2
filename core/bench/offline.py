"""`srv bench offline`: the throughput of `srv.Engine`, without HTTP (like
`sglang.bench_offline_throughput` with random token ids).

Every prompt (random token ids from a seeded generator, ids below 10 avoided as likely special
tokens) is submitted at once with ignore_eos at temperature 0; the clock runs from the first
submission to the last completion.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from srv.bench.prompts import draw_lengths, random_token_ids
from srv.bench.stats import render, throughput_rows

logger = logging.getLogger("srv.bench")


@dataclass
class OfflineConfig:
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 1.0
    seed: int = 0
    warmup_requests: int = 1
    disable_tqdm: bool = False


def vocab_size(engine: Any) -> int:
    size = int(engine.runner.config.vocab_size)
    if engine.tokenizer is not None:
        size = min(size, len(engine.tokenizer))
    return size


def sampling(output_len: int) -> dict[str, Any]:
    return {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}


async def _generate_all(engine: Any, prompts: list[list[int]], output_lens: list[int],
                        disable_tqdm: bool) -> list[Any]:
    from tqdm import tqdm

    bar = tqdm(total=len(prompts), disable=disable_tqdm, unit="req", desc="srv bench offline")

    async def one(ids: list[int], out_len: int) -> Any:
        try:
            return await engine.async_generate(input_ids=ids, sampling_params=sampling(out_len))
        except Exception as exc:   # noqa: BLE001 - counted as a failed request
            return exc
        finally:
            bar.update(1)

    try:
        return list(await asyncio.gather(*(one(ids, n) for ids, n in zip(prompts, output_lens))))
    finally:
        bar.close()


def run_offline_benchmark(config: OfflineConfig, launch_args: Namespace, registry: Any) -> dict[str, Any]:
    from srv.engine.engine import Engine

    engine = Engine.from_args(launch_args, registry)
    try:
        vocab = vocab_size(engine)
        rng = random.Random(config.seed)
        input_lens = draw_lengths(rng, config.num_prompts, config.input_len, config.range_ratio)
        output_lens = draw_lengths(rng, config.num_prompts, config.output_len, config.range_ratio)
        prompts = [random_token_ids(rng, n, vocab) for n in input_lens]
        for i in range(config.warmup_requests):
            engine.generate(input_ids=random_token_ids(rng, min(config.input_len, 32) or 1, vocab),
                            sampling_params=sampling(min(config.output_len, 8)))
            logger.info("warm-up request %d/%d done", i + 1, config.warmup_requests)
        logger.info("benchmark: %d prompts, input %d, output %d tokens (range ratio %g), all at once",
                    config.num_prompts, config.input_len, config.output_len, config.range_ratio)
        start = time.perf_counter()
        results = asyncio.run(_generate_all(engine, prompts, output_lens, config.disable_tqdm))
        duration = time.perf_counter() - start
        status = engine.status()
    finally:
        engine.shutdown()
    ok = [(r, n) for r, n in zip(results, input_lens) if not isinstance(r, BaseException)]
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    input_tokens = sum(n for _, n in ok)
    output_tokens = sum(r["meta_info"]["completion_tokens"] for r, _ in ok)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary = {
        "num_prompts": config.num_prompts, "input_len": config.input_len, "output_len": config.output_len,
        "range_ratio": config.range_ratio, "completed": len(ok), "failed": len(errors), "errors": errors[:5],
        "duration_s": duration, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)), "input_throughput": per_second(input_tokens),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        # Cumulative since the engine started: the warm-up requests are included.
        "engine_status": status,
    }
    logger.info("done: %d completed, %d failed in %.2fs", len(ok), len(errors), duration)
    return summary


def format_offline(summary: dict[str, Any]) -> str:
    status = summary["engine_status"]
    rows = throughput_rows(summary) + ["Engine counters (warm-up included)"]
    rows += [(key, f"{value:.2f}" if isinstance(value, float) else f"{value}") for key, value in status.items()
             if key != "pid"]
    return render("Offline throughput benchmark", rows, summary["errors"])
