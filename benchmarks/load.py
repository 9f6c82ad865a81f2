"""One workload against a running server, through `srv bench serve --json` in a child process:
the same load generator and prompts for srv and llama-server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.workloads import Workload

logger = logging.getLogger("benchmarks")

SRV = str(Path(sys.executable).with_name("srv"))


def load_command(base_url: str, workload: Workload, tokenizer: Path, fresh_connections: bool) -> list[str]:
    command = [SRV, "bench", "serve", "--base-url", base_url, "--endpoint", workload.endpoint,
               "--concurrency", str(workload.concurrency), "--num-prompts", str(workload.num_prompts),
               "--input-len", str(workload.input_len), "--output-len", str(workload.output_len),
               "--tokenizer", str(tokenizer), "--json", "--disable-tqdm"]
    if workload.shared_prefix_len:
        command += ["--shared-prefix-len", str(workload.shared_prefix_len)]
    if workload.num_shared_prefixes > 1:
        command += ["--num-shared-prefixes", str(workload.num_shared_prefixes)]
    if workload.warmup_requests != 1:
        command += ["--warmup-requests", str(workload.warmup_requests)]
    if workload.instruction:
        command += ["--instruction", workload.instruction]
    if workload.lora_adapters:
        command += ["--model", ",".join(f"a{i}" for i in range(workload.lora_adapters))]
    if fresh_connections:
        command.append("--fresh-connections")
    return command


def run_load(command: list[str], label: str) -> dict[str, Any]:
    """The JSON result of `srv bench serve`; a run with failed requests is returned (and logged),
    one that produced no result raises."""
    done = subprocess.run(command, capture_output=True, text=True)
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"{label}: srv bench serve exited with {done.returncode} and no result:\n"
                           + "\n".join(done.stderr.splitlines()[-20:])) from None
    if result["failed"]:
        logger.warning("%s: %d of %d requests failed: %s", label, result["failed"],
                       result["failed"] + result["completed"], "; ".join(result["errors"]))
    return result
