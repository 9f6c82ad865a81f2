"""The Hugging Face transformers peer: `generate` on the same weights, in its own venv.

It is no server: each workload's concurrency becomes a batch size, its prompts run batch after
batch, and the W2 time to first token is the prefill time of the batch of 16 prompts sharing
their 512-token prefix (nothing reuses the prefix across prompts). The weights are srv's
dequantization of the GGUF file, in float32 safetensors: the same numbers llama.cpp and srv use.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.engine import Engine, shell_line
from benchmarks.hf_venv import HfVenv, ensure_hf_venv
from benchmarks.results import LAUNCH, Probe, Run
from benchmarks.workloads import PROBE, W2_STEADY, Workload

logger = logging.getLogger("benchmarks")

SCRIPT = Path(__file__).with_name("hf_peer.py")
DTYPES = ("bf16", "fp32")
SEED = 0   # srv bench serve's default: the same prompts as the servers get


@functools.cache
def tokenizer(tokenizer_dir: Path) -> Any:
    from srv.engine.tokenizer import hf_tokenizer

    return hf_tokenizer(str(tokenizer_dir))


def prompt_ids(workload: Workload, tokenizer_dir: Path) -> tuple[list[list[int]], list[int]]:
    """The token ids `srv bench serve` sends for `workload`, and its warm-up prompt's."""
    from srv.bench.prompts import generate_prompts

    prompts = generate_prompts(workload.num_prompts + 1, workload.input_len, workload.output_len, 1.0, SEED,
                               workload.shared_prefix_len, tokenizer(tokenizer_dir))
    ids = [p.token_ids or [] for p in prompts]
    return ids[:-1], ids[-1]


@dataclass
class HfEngine(Engine):
    venv: HfVenv = field(default_factory=HfVenv)
    python: Path | None = None
    dtype: str = DTYPES[0]

    name = "hf"

    def spec(self, dtype: str, workloads: list[Workload]) -> dict[str, Any]:
        jobs = []
        for workload in workloads:
            prompts, warmup = prompt_ids(workload, self.context.model.hf_dir)
            jobs.append({"name": workload.name, "batch_size": workload.concurrency, "output_len": workload.output_len,
                         "prompts": prompts, "warmup": [warmup]})
        return {"model_dir": str(self.context.model.hf_dir), "dtype": dtype, "first_prompt": jobs[0]["warmup"][0],
                "jobs": jobs}

    def run_peer(self, dtype: str, workloads: list[Workload], tag: str) -> tuple[float, dict[str, Any]]:
        """Run hf_peer.py; return the seconds from its start to its first token, and its result."""
        assert self.python is not None
        spec_path = self.context.log_dir / f"hf-{tag}-spec.json"
        spec_path.write_text(json.dumps(self.spec(dtype, workloads)))
        log_path = self.context.log_dir / f"hf-{tag}.log"
        command = [str(self.python), str(SCRIPT), str(spec_path)]
        logger.info("hf: %s, %s: %s", tag, dtype, shell_line(command))
        start = time.time()   # wall clock: the child reports its first token in the same clock
        with open(log_path, "w") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                          text=True) as process:
            assert process.stderr is not None and process.stdout is not None
            for line in process.stderr:   # transformers' warnings go to the log only
                log.write(line)
                if line.startswith("hf_peer: "):
                    logger.info("hf: %s", line[len("hf_peer: "):].rstrip())
            output = process.stdout.read()
        if process.returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"hf_peer.py exited with {process.returncode}; log: {log_path}\n{tail}")
        result = json.loads(output)
        return result["first_token_wall"] - start, result

    def prepare(self) -> None:
        self.python = ensure_hf_venv(self.venv)
        self.version = ", ".join(self.venv.packages)
        for dtype in DTYPES:
            _, result = self.run_peer(dtype, [PROBE], f"probe-{dtype}")
            throughput = result["results"][PROBE.name]["output_throughput"]
            self.probes.append(Probe(self.name, dtype, throughput))
            logger.info("hf probe %s: %.1f output tok/s", dtype, throughput)
        self.dtype = max(self.probes, key=lambda p: p.output_throughput or 0.0).config
        self.chosen = f"{self.dtype}, the faster of {' and '.join(DTYPES)} on a short W1"
        self.server_commands = [shell_line([str(self.python), str(SCRIPT), "SPEC.json"])
                                + f"  # SPEC: dtype {self.dtype}, the workloads' token ids"]

    @property
    def workloads(self) -> list[Workload]:
        """The workloads HF runs: each as batches, so neither a steady arrival nor a hog beside
        it means anything here."""
        return [w for w in self.context.workloads
                if not w.hog and w.name != W2_STEADY and not w.srv_flags and not w.instruction]

    def run_rep(self, rep: int) -> list[Run]:
        launch_s, result = self.run_peer(self.dtype, self.workloads, f"rep{rep}")
        logger.info("hf rep %d: first token %.2fs after the process started", rep, launch_s)
        runs = [Run(self.name, rep, LAUNCH, {"launch_to_first_token_s": launch_s}, self.dtype)]
        for workload in self.workloads:
            metrics = result["results"][workload.name]
            runs.append(Run(self.name, rep, workload.name, metrics, self.dtype))
            logger.info("hf rep %d %s: %.1f output tok/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms", rep, workload.name,
                        metrics["output_throughput"], metrics["ttft_median_s"] * 1e3, metrics["tpot_median_s"] * 1e3)
        return runs
