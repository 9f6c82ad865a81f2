"""`srv bench one-batch`: the latency of one static batch, like `sglang.bench_one_batch`.

The model runner and scheduler are built in this process (no threads, no front end) and driven
directly: `batch_size` requests of `input_len` random token ids are added at once, then
`Scheduler.step()` runs until every request has its first token (the prefill, however many
chunked-prefill steps it takes) and then once per decode step until all have `output_len`
tokens (ignore_eos, greedy). Every step is timed on its own.
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import statistics
import time
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

from srv.bench.gemm import gemm_report
from srv.bench.prompts import random_token_ids
from srv.bench.stats import render

logger = logging.getLogger("srv.bench")


@dataclass
class OneBatchConfig:
    batch_size: list[int] = field(default_factory=lambda: [1])
    input_len: list[int] = field(default_factory=lambda: [1024])
    output_len: list[int] = field(default_factory=lambda: [16])
    seed: int = 0
    disable_tqdm: bool = False
    gemm: bool = True   # also time the linear layers' products against the machine's peaks


# Prefill rows the GEMM report times at most (a prefill of more rows runs its products the same way).
MAX_GEMM_ROWS = 2048


class BatchDoesNotFit(RuntimeError):
    pass


def run_once(scheduler: Any, rng: random.Random, vocab: int, batch_size: int, input_len: int, output_len: int,
             disable_tqdm: bool = True) -> dict[str, Any]:
    """One static batch through `scheduler`; the prefix cache is flushed afterwards."""
    from tqdm import tqdm

    from srv.engine.request import Req
    from srv.sdk.sampling import SamplingParams

    if batch_size > scheduler.max_running:
        raise BatchDoesNotFit(f"batch size {batch_size} exceeds the {scheduler.max_running} running requests "
                              f"allowed: pass --max-running-requests")
    if input_len + output_len > scheduler.runner.context_len:
        raise BatchDoesNotFit(f"input {input_len} + output {output_len} tokens exceed the context of "
                              f"{scheduler.runner.context_len} tokens")
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [Req(f"bench-{batch_size}-{i}", random_token_ids(rng, input_len, vocab), params)
            for i in range(batch_size)]
    retractions = scheduler.stats.retractions
    for req in reqs:
        scheduler.add(req)

    def step() -> float:
        before = scheduler.stats.forward_steps
        started = time.perf_counter()
        scheduler.step()
        elapsed = time.perf_counter() - started
        if scheduler.stats.forward_steps == before:
            raise BatchDoesNotFit("the scheduler cannot run the batch (KV cache too small?): pass "
                                  "--max-total-tokens or --mem-fraction-static")
        return elapsed

    prefill_latency, prefill_steps = 0.0, 0
    while any(not r.output_ids for r in reqs):
        prefill_latency += step()
        prefill_steps += 1
    decode_times: list[float] = []
    collectives = scheduler.runner.parallel.collective_time
    with tqdm(total=max(output_len - 1, 0), disable=disable_tqdm, unit="step",
              desc=f"decode bs={batch_size}", leave=False) as bar:
        while scheduler.has_work:
            decode_times.append(step())
            bar.update(1)
    collectives = scheduler.runner.parallel.collective_time - collectives
    if scheduler.stats.retractions != retractions:
        logger.warning("%d requests were retracted (KV cache full): the timings include their recomputation",
                       scheduler.stats.retractions - retractions)
    scheduler.flush_cache()   # the next run must not find these prompts in the prefix cache
    decode_median = statistics.median(decode_times) if decode_times else 0.0
    decode_mean = statistics.fmean(decode_times) if decode_times else 0.0
    total = prefill_latency + sum(decode_times)
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_steps": prefill_steps,
        "prefill_latency_s": prefill_latency,
        "prefill_throughput": batch_size * input_len / prefill_latency if prefill_latency > 0 else 0.0,
        "decode_steps": len(decode_times),
        "decode_median_s": decode_median,
        "decode_mean_s": decode_mean,
        "decode_throughput": batch_size / decode_median if decode_median > 0 else 0.0,
        # Under tensor parallelism: the share of the decode steps rank 0 spent in collectives
        # (the command broadcast, the all-reduces, the logits' gather).
        "decode_collective_share": collectives / sum(decode_times) if decode_times else 0.0,
        "total_latency_s": total,
        "overall_throughput": batch_size * (input_len + output_len) / total if total > 0 else 0.0,
    }


def run_one_batch_benchmark(config: OneBatchConfig, launch_args: Namespace, registry: Any) -> dict[str, Any]:
    from srv.engine.build import build_scheduler

    runner, scheduler = build_scheduler(launch_args, registry)
    try:
        vocab = int(runner.config.vocab_size)
        if scheduler.tokenizer is not None:
            vocab = min(vocab, len(scheduler.tokenizer))
        rng = random.Random(config.seed)
        shapes = list(itertools.product(config.batch_size, config.input_len, config.output_len))
        bs, il, ol = shapes[0]
        warm = run_once(scheduler, rng, vocab, bs, il, min(ol, 32))
        logger.info("warm-up (batch %d, input %d, output %d) done in %.2fs", bs, il, min(ol, 32),
                    warm["total_latency_s"])
        runs = []
        for bs, il, ol in shapes:
            result = run_once(scheduler, rng, vocab, bs, il, ol, config.disable_tqdm)
            logger.info("batch %d, input %d, output %d: prefill %.4fs (%.1f tok/s), decode step median %.4fs "
                        "(%.1f tok/s)", bs, il, ol, result["prefill_latency_s"], result["prefill_throughput"],
                        result["decode_median_s"], result["decode_throughput"])
            runs.append(result)
        summary = {"model": str(runner.model_dir), "dtype": str(runner.dtype).removeprefix("torch."),
                   "quantization": runner.quantization_name, "tp_size": runner.parallel.tp_size, "runs": runs}
        if config.gemm:
            logger.info("timing the linear layers' products and the machine's peaks")
            rows = sorted({bs for bs, _, _ in shapes} | {min(bs * il, MAX_GEMM_ROWS) for bs, il, _ in shapes})
            summary["gemm"] = gemm_report(runner.model, runner.dtype, rows)
        return summary
    finally:
        # Drop the KV cache and the weights now, not whenever the caller's references go.
        scheduler.waiting.clear()
        scheduler.running.clear()
        runner.close()
        runner.kv_cache = None
        runner.model = None
        del scheduler, runner
        gc.collect()


def format_one_batch(summary: dict[str, Any]) -> str:
    rows: list[tuple[str, str] | str] = []
    for run in summary["runs"]:
        rows += [
            f"batch {run['batch_size']}, input {run['input_len']}, output {run['output_len']}",
            ("Prefill latency (s)", f"{run['prefill_latency_s']:.4f}"),
            ("Prefill throughput (tok/s)", f"{run['prefill_throughput']:.2f}"),
            ("Median decode step latency (s)", f"{run['decode_median_s']:.5f}"),
            ("Mean decode step latency (s)", f"{run['decode_mean_s']:.5f}"),
            ("Decode throughput (tok/s)", f"{run['decode_throughput']:.2f}"),
            *([("Decode time in collectives", f"{run['decode_collective_share']:.1%}")]
              if run.get("decode_collective_share") else []),
            ("Total latency (s)", f"{run['total_latency_s']:.4f}"),
            ("Overall throughput (tok/s)", f"{run['overall_throughput']:.2f}"),
        ]
    gemm = summary.get("gemm")
    if gemm:
        rows.append(f"linear layers ({summary['quantization']}, {summary['dtype']})")
        rows += [(f"GOP/s at {n} rows", f"{gops:.1f}") for n, gops in gemm["layers_gops"].items()]
        rows.append(f"machine peaks ({gemm['peak_isa']} multiply-adds on registers, {gemm['peak_threads']} threads)")
        rows += [(f"{kind} GOP/s", f"{gops:.1f}") for kind, gops in gemm["peaks_gops"].items()]
        m, k, n = gemm["library_shape"]
        rows.append(f"torch's products ({m}x{k} by {k}x{n})")
        rows += [(f"{kind} GOP/s", f"{gops:.1f}") for kind, gops in gemm["library_gops"].items()]
    return render("One-batch benchmark", rows)
