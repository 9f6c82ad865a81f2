"""The expert distribution recorder: which experts a MoE model's routers chose, as SGLang records
it (`--expert-distribution-recorder-mode`, `/start_expert_distribution_record`,
`/stop_expert_distribution_record`, `/dump_expert_distribution_record`), and the balancedness
metric of `--enable-expert-distribution-metrics`.

It taps `srv.sdk.moe.MoEBackends.on_routed`, which every FusedMoE layer calls with its expert
ids. Under tensor or expert parallelism every rank routes every token alike, so rank 0's tap
sees the whole model (a pipeline stage sees its own layers only).

Modes:
    stat, stat_approx   tokens routed to each expert of each layer, summed over the recording
    per_pass            the same counts for each forward pass (the last buffer-size passes)
    per_token           each token's expert ids at each layer (the last buffer-size passes)
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("srv.scheduler")

MODES = ("stat", "stat_approx", "per_pass", "per_token")
# SGLang's variable for where dumps go.
DUMP_DIR_VARIABLE = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"
METRICS_LOG_PASSES = 100   # --enable-expert-distribution-metrics logs a line this often


def balancedness(counts: torch.Tensor) -> float:
    """Mean over the layers that routed anything of (mean tokens an expert / most tokens an
    expert): 1.0 when every expert of a layer got as many tokens, 1/experts when one got all."""
    counts = counts.double()
    used = counts.sum(-1) > 0
    if not bool(used.any()):
        return 1.0
    counts = counts[used]
    return float((counts.mean(-1) / counts.max(-1).values).mean())


class ExpertDistributionRecorder:
    def __init__(self, mode: str | None, buffer_size: int | None, num_layers: int, num_experts: int,
                 metrics: bool = False, rebalance_every: int | None = None) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"--expert-distribution-recorder-mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode or "stat"
        self.buffer_size = buffer_size if buffer_size is not None else 1000
        self.num_layers, self.num_experts, self.metrics = num_layers, num_experts, metrics
        self.recording = False
        self._reset()
        self._window = torch.zeros(num_layers, num_experts, dtype=torch.int64)   # for the metric
        self._window_passes = 0
        self.last_balancedness: float | None = None
        # --enable-eplb: the counts since the last rebalance, handed out every `rebalance_every` passes.
        self.rebalance_every = rebalance_every
        self._since_rebalance = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self._passes_since_rebalance = 0

    def _reset(self) -> None:
        self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        self._passes: list[Any] = []
        self._pass: Any = None

    @property
    def active(self) -> bool:
        return self.recording or self.metrics or self.rebalance_every is not None

    # ---- the tap and the step boundary ----------------------------------------------------------

    def on_routed(self, layer: int, ids: torch.Tensor) -> None:
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        if self.metrics:
            self._window[layer] += counts
        if self.rebalance_every is not None:
            self._since_rebalance[layer] += counts
        if not self.recording:
            return
        if self.mode in ("stat", "stat_approx"):
            self._counts[layer] += counts
            return
        if self._pass is None:
            self._pass = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64) \
                if self.mode == "per_pass" else {}
        if self.mode == "per_pass":
            self._pass[layer] += counts
        else:
            self._pass[layer] = ids.tolist()

    def after_pass(self) -> torch.Tensor | None:
        """A forward pass ended (a scheduler step); with --enable-eplb, every `rebalance_every`
        passes that routed tokens, the counts to rebalance by."""
        if self._pass is not None:
            self._passes.append(self._pass)
            self._pass = None
            if 0 <= self.buffer_size < len(self._passes):
                del self._passes[:len(self._passes) - self.buffer_size]
        if self.metrics and int(self._window.sum()):
            self._window_passes += 1
            if self._window_passes >= METRICS_LOG_PASSES:
                self.last_balancedness = balancedness(self._window)
                logger.info("expert distribution: balancedness %.3f over the last %d forward passes",
                            self.last_balancedness, self._window_passes)
                self._window.zero_()
                self._window_passes = 0
        if self.rebalance_every is not None and int(self._since_rebalance.sum()):
            self._passes_since_rebalance += 1
            if self._passes_since_rebalance >= self.rebalance_every:
                counts = self._since_rebalance.clone()
                self._since_rebalance.zero_()
                self._passes_since_rebalance = 0
                return counts
        return None

    # ---- the routes ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._reset()
        self.recording = True
        logger.info("expert distribution: recording (%s)", self.mode)

    def stop(self) -> None:
        if not self.recording:
            raise ValueError("no expert distribution is being recorded: /start_expert_distribution_record first")
        self.after_pass()
        self.recording = False
        logger.info("expert distribution: stopped")

    def dump(self, output_dir: str | None = None) -> dict[str, Any]:
        """Write what was recorded as a torch file (SGLang's folder variable, or /tmp) and return
        where, with the per-layer counts."""
        self.after_pass()
        if self.mode in ("stat", "stat_approx"):
            counts, record = self._counts, {"logical_count": self._counts.clone()}
        elif self.mode == "per_pass":
            counts = torch.stack(self._passes).sum(0) if self._passes else self._counts
            record = {"logical_count_of_pass": [p.clone() for p in self._passes]}
        else:
            counts = self._counts
            record = {"topk_ids_of_pass": list(self._passes)}
        folder = Path(output_dir or os.environ.get(DUMP_DIR_VARIABLE) or "/tmp")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"expert_distribution_recorder_{time.time():.6f}.pt"
        torch.save({"mode": self.mode, "num_layers": self.num_layers, "num_experts": self.num_experts, **record}, path)
        logger.info("expert distribution: dumped to %s", path)
        return {"path": str(path), "mode": self.mode, "passes": len(self._passes),
                "logical_count": counts.tolist(), "balancedness": balancedness(counts)}
