"""The Hugging Face transformers peer: batched `generate` on the benchmarked weights.

Run by the HF venv's python as a script (it imports only torch and transformers, not srv):

    hf-venv/bin/python benchmarks/hf_peer.py SPEC.json > RESULT.json

SPEC holds the model folder, the dtype, the first prompt and the jobs (a name, a batch size, an
output length and prompts as token ids, made by srv's prompt generator so they match the
servers' token for token). Each job runs its prompts in batches, left-padded, greedy, with
min_new_tokens = max_new_tokens so every sequence makes its full output; a stopping criterion
that never stops timestamps each step. RESULT has, per job, the keys `srv bench serve --json`
uses, and the wall-clock time (time.time()) of the first token, from which the caller derives
the process start to first token time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def batch_inputs(prompts: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    """input_ids and attention_mask, left-padded: generation continues from the right edge."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


class StepTimes:
    """A stopping criterion that never stops: it records when each new token is ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, list[float], int]:
    """Start time, per-step times and the tokens generated per sequence."""
    import torch
    from transformers import StoppingCriteriaList

    ids, mask = batch_inputs(prompts, pad_id)
    steps = StepTimes()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             stopping_criteria=StoppingCriteriaList([steps]))
    return start, steps.times, out.shape[1] - ids.shape[1]


def run_job(model: Any, job: dict[str, Any], pad_id: int) -> dict[str, float]:
    generate(model, job["warmup"], job["output_len"], pad_id)
    size, prompts = job["batch_size"], job["prompts"]
    ttfts, tpots, gaps = [], [], []
    duration, output_tokens = 0.0, 0
    for i in range(0, len(prompts), size):
        batch = prompts[i:i + size]
        start, times, made = generate(model, batch, job["output_len"], pad_id)
        if made != job["output_len"]:
            raise RuntimeError(f"{job['name']}: generated {made} tokens, not {job['output_len']}")
        duration += times[-1] - start
        output_tokens += made * len(batch)
        ttfts.append(times[0] - start)
        tpots.append((times[-1] - times[0]) / max(1, len(times) - 1))
        gaps += [b - a for a, b in zip(times, times[1:])]
    return {"completed": len(prompts), "failed": 0, "duration_s": duration, "output_tokens": output_tokens,
            "output_throughput": output_tokens / duration, "ttft_median_s": statistics.median(ttfts),
            "tpot_median_s": statistics.median(tpots), "itl_median_s": statistics.median(gaps) if gaps else 0.0}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    generate(model, [spec["first_prompt"]], 1, pad_id)
    first_token_wall = time.time()
    print(f"hf_peer: first token at {first_token_wall:.3f}", file=sys.stderr, flush=True)
    results = {}
    for job in spec["jobs"]:
        results[job["name"]] = run_job(model, job, pad_id)
        print(f"hf_peer: {job['name']}: {results[job['name']]['output_throughput']:.1f} output tok/s",
              file=sys.stderr, flush=True)
    json.dump({"first_token_wall": first_token_wall, "dtype": spec["dtype"], "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "results": results}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
