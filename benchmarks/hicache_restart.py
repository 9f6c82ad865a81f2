"""The first request after a restart with file storage: srv launched with the hierarchical cache
and `--hicache-storage-backend file` on an empty directory serves a 1,024-token prompt (cold: its
prefill computed), is stopped, and is launched again on the same directory, where the same
prompt's pages come from storage (warm). Time to first token, warm against cold, within each of
PAIRS pairs. The prefetch policy is wait_complete: on an idle server best_effort admits the
request before any page has been read."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from benchmarks.engine import BenchContext, shell_line
from benchmarks.load import load_command, run_load
from benchmarks.results import Run, serve_metrics
from benchmarks.servers import ServerProcess, free_port
from benchmarks.srv_engine import SrvEngine
from benchmarks.workloads import Workload

logger = logging.getLogger("benchmarks")

RESTART = "restart"
RESTART_PROMPT_LEN = 1024
PAIRS = 3
RESTART_FLAGS = ("--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                 "--hicache-storage-prefetch-policy", "wait_complete")
PHASES = ("cold", "warm")


def restart_workload() -> Workload:
    return Workload(RESTART, 1, 1, input_len=RESTART_PROMPT_LEN, output_len=1)


def measure_restart(context: BenchContext, rep: int) -> tuple[list[Run], list[str]]:
    """Runs named `restart-<pair>-cold` and `restart-<pair>-warm`, and the command lines."""
    runs, commands = [], []
    workload = restart_workload()
    for pair in range(PAIRS):
        store = Path(tempfile.mkdtemp(prefix="srv-bench-hicache-"))
        try:
            flags = [*RESTART_FLAGS, "--hicache-storage-backend-extra-config", json.dumps({"storage_dir": str(store)})]
            for phase in PHASES:
                port = free_port()
                command = SrvEngine.command(str(port)) + flags
                server = ServerProcess(f"srv (hicache {phase})", command, port,
                                       context.log_dir / f"srv-restart-{pair}-{phase}.log")
                with server:
                    server.launch_to_first_token()
                    load = load_command(server.base_url, workload, context.model.hf_dir, False)
                    if pair == 0:
                        commands.append(shell_line(command).replace(str(port), "PORT").replace(str(store), "DIR"))
                        commands.append(shell_line(load).replace(server.base_url, "http://127.0.0.1:PORT"))
                    result = run_load(load, f"srv restart {phase}")
                runs.append(Run("srv", rep, f"{RESTART}-{pair}-{phase}", serve_metrics(result), phase))
                logger.info("srv restart pair %d %s: TTFT %.0f ms", pair, phase, result["ttft_median_s"] * 1e3)
        finally:
            shutil.rmtree(store, ignore_errors=True)
    return runs, commands


def restart_rows(runs: list[Run]) -> list[tuple[int, float, float]]:
    """(pair, cold TTFT s, warm TTFT s) for each pair measured."""
    by_name = {run.workload: run.metrics for run in runs}
    rows = []
    for pair in range(PAIRS):
        cold, warm = (by_name.get(f"{RESTART}-{pair}-{phase}") for phase in PHASES)
        if cold and warm and not cold.get("failed") and not warm.get("failed"):
            rows.append((pair, cold["ttft_median_s"], warm["ttft_median_s"]))
    return rows
