"""`srv bench serve|offline|one-batch`: benchmarks, in the manner of SGLang's bench_serving,
bench_offline_throughput and bench_one_batch.

    srv bench serve --base-url http://127.0.0.1:30000 --num-prompts 200 --concurrency 16
    srv bench offline --model-path PATH --num-prompts 64 --input-len 256 --output-len 64
    srv bench one-batch --model-path PATH --batch-size 1 8 32 --input-len 512 --output-len 32

`offline` and `one-batch` also take every `srv launch` flag (the model, dtype, KV cache size...).
The result prints as a table, or with --json as a JSON object on stdout; progress and log lines go
to stderr. The exit status is 1 when a request failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

LAUNCH_FLAGS_NOTE = "Every `srv launch` flag is accepted too (see `srv launch --help`), e.g. --model-path, --dtype."


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), not {text}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], not {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones (None, False) that say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):
            return action.help or ""
        return super()._get_help_string(action)


def _add_workload(parser: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    parser.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send")
    parser.add_argument("--input-len", type=_positive_int, default=input_len,
                        help="prompt tokens (the maximum with --range-ratio)")
    parser.add_argument("--output-len", type=_positive_int, default=output_len,
                        help="output tokens per request (the maximum with --range-ratio)")
    parser.add_argument("--range-ratio", type=_ratio, default=1.0,
                        help="lengths are drawn uniformly in [len * ratio, len]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, their lengths and the arrivals")


def _add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="srv bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    commands = parser.add_subparsers(dest="bench", metavar="{serve,offline,one-batch}")
    defaults = _DefaultsHelp

    serve = commands.add_parser(
        "serve", help="load-test an OpenAI-compatible server over HTTP", formatter_class=defaults,
        allow_abbrev=False, description="Load-test an OpenAI-compatible server (srv, SGLang, vLLM, llama-server) "
        "with streamed requests of random-word prompts, and report throughput, TTFT, ITL, TPOT and end-to-end "
        "latency. Prompt lengths are exact under --tokenizer; without it one word counts as one token.")
    serve.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server's address")
    serve.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                       help="POST /v1/completions or /v1/chat/completions")
    serve.add_argument("--model", help="the model name to send (default: the first id of GET /v1/models); "
                                        "several, comma-separated (LoRA adapters, say): request i sends the i-th in turn")
    serve.add_argument("--api-key", help="sent as a Bearer token")
    serve.add_argument("--concurrency", type=_positive_int, help="at most this many requests in flight")
    serve.add_argument("--request-rate", type=_rate, default=math.inf,
                       help="Poisson arrivals at this many requests per second (inf: all at once)")
    _add_workload(serve, 1024, 128)
    serve.add_argument("--shared-prefix-len", type=_non_negative_int, default=0,
                       help="every prompt starts with the same prefix of this many tokens (added to --input-len)")
    serve.add_argument("--num-shared-prefixes", type=_positive_int, default=1,
                       help="that many distinct shared prefixes, prompt i taking prefix i mod N (system prompts "
                            "cycled by the clients)")
    serve.add_argument("--instruction", default="",
                       help="a fixed text before every prompt's words, e.g. 'Repeat this text exactly:' (not counted "
                            "in --input-len)")
    serve.add_argument("--tokenizer", metavar="PATH",
                       help="a Hugging Face tokenizer folder to make prompt lengths exact")
    serve.add_argument("--warmup-requests", type=_non_negative_int, default=1,
                       help="requests sent first, one at a time, and not counted")
    serve.add_argument("--fresh-connections", action="store_true",
                       help="open a new HTTP connection per request (llama-server closes it after each stream)")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    serve.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                       help='fields added to every request, e.g. \'{"regex": "[a-z]+"}\' or a response_format')
    _add_output(serve)

    offline = commands.add_parser(
        "offline", help="throughput of srv.Engine without HTTP", formatter_class=defaults, allow_abbrev=False,
        description="Submit every prompt (random token ids) at once to an in-process srv.Engine and report "
                    "requests/s and tokens/s.", epilog=LAUNCH_FLAGS_NOTE)
    _add_workload(offline, 1024, 128)
    offline.add_argument("--warmup-requests", type=_non_negative_int, default=1,
                         help="short requests run first and not timed")
    _add_output(offline)

    one_batch = commands.add_parser(
        "one-batch", help="prefill and decode latency of one static batch", formatter_class=defaults,
        allow_abbrev=False, description="Run static batches through the scheduler in this process and report "
                                        "the prefill latency and the per-step decode latency.",
        epilog=LAUNCH_FLAGS_NOTE)
    for flag, default, what in (("--batch-size", 1, "batch sizes"), ("--input-len", 1024, "prompt lengths"),
                                ("--output-len", 16, "output lengths")):
        one_batch.add_argument(flag, type=_positive_int, nargs="+", default=[default], help=f"one or more {what}")
    one_batch.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    one_batch.add_argument("--no-gemm", action="store_true",
                           help="skip timing the linear layers' products against the machine's float32 and int8 peaks")
    _add_output(one_batch)
    return parser


def _emit(result: dict[str, Any], args: argparse.Namespace, table: str) -> None:
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    print(text if args.json else table, flush=True)


def _launch_args(rest: list[str]) -> tuple[argparse.Namespace, Any]:
    from srv.args.parser import parse_launch_args
    from srv.plugin_manager import load_plugins

    manager, registry = load_plugins()
    return parse_launch_args(rest, manager, registry), registry


def _serve(args: argparse.Namespace) -> int:
    from srv.bench.serve import ServeConfig, run_serve_benchmark
    from srv.bench.stats import format_table

    config = ServeConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        concurrency=args.concurrency, request_rate=args.request_rate, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        shared_prefix_len=args.shared_prefix_len, num_shared_prefixes=args.num_shared_prefixes, instruction=args.instruction, seed=args.seed,
        warmup_requests=args.warmup_requests,
        fresh_connections=args.fresh_connections, tokenizer=args.tokenizer, timeout=args.timeout,
        disable_tqdm=args.disable_tqdm, extra_body=args.extra_body)
    result = run_serve_benchmark(config)
    _emit(result, args, format_table(result))
    return 1 if result["failed"] else 0


def _offline(args: argparse.Namespace, rest: list[str]) -> int:
    from srv.bench.offline import OfflineConfig, format_offline, run_offline_benchmark

    launch_args, registry = _launch_args(rest)
    config = OfflineConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                           range_ratio=args.range_ratio, seed=args.seed, warmup_requests=args.warmup_requests,
                           disable_tqdm=args.disable_tqdm)
    result = run_offline_benchmark(config, launch_args, registry)
    _emit(result, args, format_offline(result))
    return 1 if result["failed"] else 0


def _one_batch(args: argparse.Namespace, rest: list[str]) -> int:
    from srv.bench.one_batch import OneBatchConfig, format_one_batch, run_one_batch_benchmark

    launch_args, registry = _launch_args(rest)
    config = OneBatchConfig(batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len,
                            seed=args.seed, disable_tqdm=args.disable_tqdm, gemm=not args.no_gemm)
    result = run_one_batch_benchmark(config, launch_args, registry)
    _emit(result, args, format_one_batch(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.bench is None:
        parser.print_help()
        return 2
    if args.bench == "serve" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # not one line per request
    try:
        if args.bench == "serve":
            return _serve(args)
        if args.bench == "offline":
            return _offline(args, rest)
        return _one_batch(args, rest)
    except (ValueError, RuntimeError, OSError) as exc:
        # Expected failures (a bad model path, a batch that does not fit) end in one line.
        print(f"srv bench {args.bench}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"srv bench {args.bench}: interrupted", file=sys.stderr)
        return 130
