"""One benchmark run: prepare every engine, then the repetitions, engines alternating within each
so that a slow minute of a shared machine does not fall on one engine only."""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine import REPO, BenchContext, Engine
from benchmarks.grammar_cost import measure_grammar_cost
from benchmarks.hicache_restart import RESTART, measure_restart
from benchmarks.hf_engine import HfEngine
from benchmarks.limits import measure_limits
from benchmarks.llama_engine import LlamaEngine
from benchmarks.machine import describe_machine
from benchmarks.model import prepare_model
from benchmarks.results import BenchResults
from benchmarks.srv_engine import SrvEngine
from benchmarks.workloads import workloads

logger = logging.getLogger("benchmarks")

ENGINES: dict[str, type[Engine]] = {"srv": SrvEngine, "llama.cpp": LlamaEngine, "hf": HfEngine}


@dataclass(frozen=True)
class BenchOptions:
    repeats: int = 3
    quick: bool = False
    engines: tuple[str, ...] = tuple(ENGINES)
    results_path: Path = REPO / "benchmarks" / "results.json"
    log_root: Path = Path.home() / ".cache" / "srv" / "bench" / "logs"
    only: tuple[str, ...] = ()   # workload names to run (all when empty), without the grammar mask cost


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def run_bench(options: BenchOptions) -> BenchResults:
    started = time.perf_counter()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = options.log_root / stamp
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("bench: %d repetition(s)%s, engines %s; server logs in %s", options.repeats,
                " (quick)" if options.quick else "", ", ".join(options.engines), log_dir)
    machine = describe_machine(REPO)
    machine["loadavg_start"] = load_average()
    logger.info("bench: %s, %s CPUs, load average %.2f", machine["cpu_model"], machine["cpus"],
                machine["loadavg_start"])
    model = prepare_model()
    logger.info("bench: model %s (%.1f M weights), tokenizer and HF weights %s", model.gguf.name,
                model.num_params / 1e6, model.hf_dir)
    logger.info("bench: measuring the machine's limits")
    limits = measure_limits(model.num_params)
    logger.info("bench: DRAM %.1f GB/s, bf16 matmul %.0f GFLOP/s at M=128", limits["bandwidth"]["read_gb_s"],
                limits["matmul_gflops"]["bf16_m128"])
    chosen = [w for w in workloads(options.quick) if not options.only or w.name in options.only]
    context = BenchContext(model, chosen, log_dir)
    results = BenchResults(repeats=options.repeats, quick=options.quick,
                           machine=machine, limits=limits, engines=[])

    engines: list[Engine] = []
    for name in options.engines:
        engine = ENGINES[name](context)
        logger.info("%s: preparing", name)
        try:
            engine.prepare()
        except Exception as exc:
            if name == "srv":
                raise
            # A peer that cannot run is reported, not fatal: srv's numbers still stand.
            logger.error("%s: left out: %s", name, exc)
            results.errors.append(f"{name} left out: {str(exc).splitlines()[0]}")
            continue
        engines.append(engine)
        results.probes += engine.probes
        results.chosen[name] = engine.chosen
        results.versions[name] = engine.version
    results.engines = [e.name for e in engines]

    for rep in range(1, options.repeats + 1):
        for engine in engines:
            logger.info("bench: repetition %d/%d: %s", rep, options.repeats, engine.name)
            try:
                results.runs += engine.run_rep(rep)
            except Exception as exc:
                logger.error("%s: repetition %d failed: %s", engine.name, rep, exc)
                results.errors.append(f"{engine.name} repetition {rep} failed: {str(exc).splitlines()[0]}")
            results.save(options.results_path)   # a crash later keeps what was measured

    # srv-only measurements after the repetitions: (what, when it runs, how)
    extra_commands: list[str] = []
    for what, wanted, measure in (("the mask cost of each grammar backend", not options.only, measure_grammar_cost),
                                  ("the first request after a restart with file storage",
                                   not options.only or RESTART in options.only, measure_restart)):
        if "srv" not in results.engines or not wanted:
            continue
        logger.info("bench: %s", what)
        try:
            runs, commands = measure(context, 1)
            results.runs += runs
            extra_commands += commands
        except Exception as exc:
            logger.error("%s: %s", what, exc)
            results.errors.append(f"{what} failed: {str(exc).splitlines()[0]}")

    for engine in engines:
        results.commands.servers[engine.name] = engine.server_commands
        results.commands.loads[engine.name] = engine.load_commands
    if extra_commands:
        results.commands.loads["srv"] = results.commands.loads.get("srv", []) + extra_commands
    results.machine["loadavg_end"] = load_average()
    results.duration_s = time.perf_counter() - started
    results.save(options.results_path)
    logger.info("bench: done in %.1f minutes; results in %s", results.duration_s / 60, options.results_path)
    return results
