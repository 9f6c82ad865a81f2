"""A mixture of experts on this machine: srv's MoE runners against transformers' own expert code.

The model is random-weight and built from a config (no MoE checkpoint ships in a package): a
Mixtral of 8 experts, top-2, hidden 1024, expert width 1408, 12 layers, about 0.5B parameters,
float32, the default model's tokenizer. Each configuration runs in a process of its own (so no
engine's threads or memory touch another's), one after another within each repetition:

- `srv`: srv's defaults (`--dtype auto`: bfloat16 where the CPU computes it natively, else
  float32; the runner picked by priority: the fused CPU runner where a C compiler is found);
- `srv-int8`: srv's defaults with `--quantization w8a8_int8` (the experts int8 per output channel,
  quantized as the model loads);
- `srv-f32`: `--dtype float32`, and `srv-torch-f32`: float32 with `--moe-runner-backend torch`
  (the reference runner);
- `hf`: HF transformers `generate` on the same weights in float32 with its default experts
  implementation (grouped products in transformers 5), `hf-eager` with its per-expert loop
  (`experts_implementation="eager"`), and `hf-bf16` in bfloat16, greedy, its batch the number of
  streams.

Both take the same prompts (random token ids, INPUT_LEN each) and write OUTPUT_LEN tokens each,
never stopping early; output tok/s is the tokens written over the wall time of the whole call
(prefill included). The MoE share is the time inside the sparse blocks (router, selection,
experts, shared expert) over the whole call's, measured by forward hooks in a separate pass.

    python -m benchmarks.moe [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("benchmarks")

MODEL_DIR = Path.home() / ".cache" / "srv" / "bench" / "moe-mixtral-0.5b"
CONFIG = dict(vocab_size=49152, hidden_size=1024, intermediate_size=1408, num_hidden_layers=12,
              num_attention_heads=16, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              initializer_range=0.02)
INPUT_LEN = 64
OUTPUT_LEN = 64
STREAMS = (1, 16)
CONFIGS = ("srv", "srv-int8", "srv-f32", "srv-torch-f32", "hf", "hf-eager", "hf-bf16")
SEED = 0


def build_model(model_dir: Path = MODEL_DIR) -> Path:
    """The random Mixtral saved as safetensors with the default model's tokenizer, built once."""
    if (model_dir / "model.safetensors").exists() or (model_dir / "model.safetensors.index.json").exists():
        return model_dir
    import torch
    import transformers

    from srv.engine.default_model import default_model_path
    from srv.plugins.models.loaders import GGUFLoader

    logger.info("moe bench: building a random Mixtral (%s) in %s", CONFIG, model_dir)
    torch.manual_seed(SEED)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    tokenizer_dir = GGUFLoader().prepare(default_model_path())
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(model_dir)
    logger.info("moe bench: %.0fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    return model_dir


def prompts(streams: int, seed: int = SEED) -> list[list[int]]:
    import random

    rng = random.Random(seed + streams)
    return [[rng.randrange(3, CONFIG["vocab_size"]) for _ in range(INPUT_LEN)] for _ in range(streams)]


class BlockTimer:
    """Wall time inside modules' forward calls, by forward hooks."""

    def __init__(self, modules: list[Any]):
        self.total = 0.0
        self._start = 0.0
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave)

    def _enter(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._start


def measure_srv(model_dir: Path, flags: dict[str, Any]) -> dict[str, Any]:
    import srv

    # One chunk holds all the 16-stream prompts, so every configuration prefills them at once.
    flags = {"chunked_prefill_size": 16 * INPUT_LEN, **flags}
    params = {"temperature": 0.0, "max_new_tokens": OUTPUT_LEN, "ignore_eos": True}
    result: dict[str, Any] = {}
    with srv.Engine(model_path=str(model_dir), **flags) as engine:
        model = engine.runner.model
        result["runner"] = type(model.layers[0].mlp.experts.backends.runner).__name__
        result["dtype"] = str(next(model.parameters()).dtype)
        # A warm-up prompt of its own: the measured ones must not hit srv's prefix cache.
        engine.generate(input_ids=prompts(1, seed=SEED - 1), sampling_params={**params, "max_new_tokens": 4})
        for streams in STREAMS:
            start = time.perf_counter()
            out = engine.generate(input_ids=prompts(streams), sampling_params=params)
            seconds = time.perf_counter() - start
            tokens = sum(len(r["output_ids"]) for r in out)
            result[f"c{streams}_tok_s"] = tokens / seconds
        timer = BlockTimer([layer.mlp for layer in model.layers])
        for streams in STREAMS:
            timer.total = 0.0
            start = time.perf_counter()
            engine.generate(input_ids=prompts(streams), sampling_params=params)
            result[f"c{streams}_moe_share"] = timer.total / (time.perf_counter() - start)
    return result


def measure_hf(model_dir: Path, dtype: str, experts: str | None) -> dict[str, Any]:
    import torch
    import transformers

    kwargs = {"experts_implementation": experts} if experts else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **kwargs).eval()
    result: dict[str, Any] = {"experts_implementation": str(getattr(model.config, "_experts_implementation", "")),
                              "dtype": dtype}

    def generate(streams: int, new_tokens: int) -> int:
        ids = torch.tensor(prompts(streams))
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * streams

    generate(1, 4)
    for streams in STREAMS:
        start = time.perf_counter()
        tokens = generate(streams, OUTPUT_LEN)
        result[f"c{streams}_tok_s"] = tokens / (time.perf_counter() - start)
    timer = BlockTimer([layer.mlp for layer in model.model.layers])
    for streams in STREAMS:
        timer.total = 0.0
        start = time.perf_counter()
        generate(streams, OUTPUT_LEN)
        result[f"c{streams}_moe_share"] = timer.total / (time.perf_counter() - start)
    return result


def measure(config: str, model_dir: Path) -> dict[str, Any]:
    return {
        "srv": lambda: measure_srv(model_dir, {}),
        "srv-int8": lambda: measure_srv(model_dir, {"quantization": "w8a8_int8"}),
        "srv-f32": lambda: measure_srv(model_dir, {"dtype": "float32"}),
        "srv-torch-f32": lambda: measure_srv(model_dir, {"dtype": "float32", "moe_runner_backend": "torch"}),
        "hf": lambda: measure_hf(model_dir, "float32", None),
        "hf-eager": lambda: measure_hf(model_dir, "float32", "eager"),
        "hf-bf16": lambda: measure_hf(model_dir, "bfloat16", None),
    }[config]()


def run_one(config: str, model_dir: Path) -> dict[str, Any]:
    """`config` measured in a child process; its result dict."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moe", "--one", config, "--model-dir", str(model_dir)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"moe bench {config} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.one:
        print(json.dumps(measure(args.one, args.model_dir)))
        return
    model_dir = build_model(args.model_dir)
    configs = args.configs.split(",")
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for config in configs:
            result = {"config": config, "rep": rep, **run_one(config, model_dir)}
            logger.info("moe bench rep %d %s: %s", rep, config, json.dumps(result))
            runs.append(result)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(report(runs, configs))


def report(runs: list[dict[str, Any]], configs: list[str]) -> str:
    """A markdown table of medians, and each repetition's ratios (srv's default to the others, srv's
    int8 to transformers, srv's float32 to the float32 peers)."""
    lines = ["| configuration | " + " | ".join(f"{s} stream{'s' * (s > 1)}, output tok/s" for s in STREAMS)
             + " | " + " | ".join(f"MoE share, {s}" for s in STREAMS) + " |",
             "| --- |" + " ---: |" * (2 * len(STREAMS))]
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        cells = [f"{statistics.median(r[f'c{s}_tok_s'] for r in mine):.1f}" for s in STREAMS]
        cells += [f"{statistics.median(r[f'c{s}_moe_share'] for r in mine):.0%}" for s in STREAMS]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    reps = sorted({r["rep"] for r in runs})
    by = {(r["config"], r["rep"]): r for r in runs}
    # srv's default against every other row; int8 srv against transformers; float32 srv against
    # the float32 peers (same arithmetic).
    pairs = [("srv", other) for other in configs if other != "srv"] + \
            [("srv-int8", other) for other in ("hf", "hf-eager", "hf-bf16")] + \
            [("srv-f32", other) for other in ("srv-torch-f32", "hf", "hf-eager")]
    for mine, other in pairs:
        for s in STREAMS:
            ratios = [by[(mine, rep)][f"c{s}_tok_s"] / by[(other, rep)][f"c{s}_tok_s"]
                      for rep in reps if (mine, rep) in by and (other, rep) in by]
            if ratios:
                lines.append(f"\n{mine} / {other}, {s} stream(s), within each repetition: "
                             + ", ".join(f"{x:.2f}" for x in ratios) + f" (median {statistics.median(ratios):.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
