"""The cost of constrained decoding per output token, for each grammar backend: srv launched with
`--grammar-backend X` serves W1's load free and with every request constrained by a regex, in
PAIRS alternating runs on the one server, and the difference in time per output token within a
pair is the mask cost (filling the bitmask, applying it, accepting the token) the backend adds.
Pairs, not one run each: the machine's noise is as large as the effect, and the spread over the
pairs shows whether a sign is to be trusted."""

from __future__ import annotations

import json
import logging

from benchmarks.engine import BenchContext, shell_line
from benchmarks.load import load_command, run_load
from benchmarks.results import Run, serve_metrics
from benchmarks.servers import ServerProcess, free_port
from benchmarks.stats import median
from benchmarks.srv_engine import SrvEngine
from benchmarks.workloads import W1, Workload

logger = logging.getLogger("benchmarks")

GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "outlines")
# 128 one-letter words: every output token is constrained and none can end the output early.
REGEX = "[a-z]( [a-z]){127}"
PAIRS = 3


def grammar_workload(context: BenchContext) -> Workload:
    return next(w for w in context.workloads if w.name == W1)


def measure_grammar_cost(context: BenchContext, rep: int) -> tuple[list[Run], list[str]]:
    """Runs named `grammar-<backend>-<pair>` (free) and `grammar-<backend>-<pair>-regex`, and the
    command lines."""
    workload = grammar_workload(context)
    runs, commands = [], []
    for backend in GRAMMAR_BACKENDS:
        port = free_port()
        command = SrvEngine.command(str(port)) + ["--grammar-backend", backend]
        server = ServerProcess(f"srv ({backend})", command, port, context.log_dir / f"srv-grammar-{backend}.log")
        commands.append(shell_line(command).replace(str(port), "PORT"))
        with server:
            server.launch_to_first_token()
            for pair in range(PAIRS):
                for suffix, extra in (("", []), ("-regex", ["--extra-body", json.dumps({"regex": REGEX})])):
                    load = load_command(server.base_url, workload, context.model.hf_dir, False) + extra
                    if extra and pair == 0:
                        commands.append(shell_line(load).replace(server.base_url, "http://127.0.0.1:PORT"))
                    result = run_load(load, f"srv {backend}{suffix}")
                    runs.append(Run("srv", rep, f"grammar-{backend}-{pair}{suffix}", serve_metrics(result), backend))
                logger.info("srv --grammar-backend %s%s: %.1f output tok/s, TPOT p50 %.1f ms", backend,
                            " (regex)" if extra else " (free)", result["output_throughput"],
                            result["tpot_median_s"] * 1e3)
    return runs, commands


def mask_cost_rows(runs: list[Run], concurrency: int) -> list[tuple[str, float, float, float, float, float]]:
    """(backend, free TPOT ms, constrained TPOT ms: medians over the pairs, and the extra µs per
    constrained token: median, lowest, highest over the pairs); each step decodes `concurrency`
    requests, so the extra time per step is shared by that many tokens."""
    by_name = {run.workload: run.metrics for run in runs}
    rows = []
    for backend in GRAMMAR_BACKENDS:
        free, constrained, extra = [], [], []
        for pair in range(PAIRS):
            f, c = by_name.get(f"grammar-{backend}-{pair}"), by_name.get(f"grammar-{backend}-{pair}-regex")
            if f is None or c is None:
                continue
            free.append(f["tpot_median_s"] * 1e3)
            constrained.append(c["tpot_median_s"] * 1e3)
            extra.append((constrained[-1] - free[-1]) * 1e3 / concurrency)
        if extra:
            rows.append((backend, median(free), median(constrained), median(extra), min(extra), max(extra)))
    return rows
