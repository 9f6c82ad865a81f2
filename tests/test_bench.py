"""`srv bench serve|offline|one-batch`: statistics, prompts and arrivals on their own, then each
benchmark end to end (serve against a real `srv launch`, offline and one-batch on a tiny model)."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys

import numpy as np
import pytest

from srv.bench.prompts import arrival_times, draw_lengths, generate_prompts
from srv.engine.tokenizer import hf_tokenizer
from srv.bench.stats import RequestResult, describe, per_token_gaps, percentile, summarize
from srv.cli.bench import main as bench_main
from test_server import API_KEY, Server, free_port


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`srv bench ...` in a child process: through `python -m srv` once the subcommand is
    registered there, else through srv.cli.bench directly."""
    from srv.cli import main as cli

    if "bench" in cli.COMMANDS:
        command = [sys.executable, "-m", "srv", "bench", *args]
    else:
        command = [sys.executable, "-c", "import sys; from srv.cli.bench import main; sys.exit(main(sys.argv[1:]))",
                   *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def run_json(capsys, *args: str) -> tuple[int, dict]:
    """`srv bench ... --json` in this process; its exit status and the JSON it printed."""
    capsys.readouterr()
    status = bench_main([*args, "--json", "--disable-tqdm"])
    return status, json.loads(capsys.readouterr().out)


# ---- statistics ---------------------------------------------------------------------------------


def test_statistics_on_synthetic_timings():
    values = [0.5, 0.1, 0.4, 0.2, 0.3, 1.0, 0.05, 0.7, 0.9, 0.6, 0.25]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert describe(values) == pytest.approx({"mean": sum(values) / 11, "median": 0.4,
                                              "p90": float(np.percentile(values, 90)),
                                              "p99": float(np.percentile(values, 99))})
    assert describe([]) == {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}

    # One token per chunk: the gaps themselves. Four tokens in three chunks: each gap counts 1.5 tokens.
    assert per_token_gaps([1.0, 1.1, 1.3, 1.6], 4) == pytest.approx([0.1, 0.2, 0.3])
    assert per_token_gaps([1.0, 1.3, 1.9], 4) == pytest.approx([0.2, 0.4])
    assert per_token_gaps([1.0], 1) == []

    fast = RequestResult(success=True, prompt_len=10, completion_tokens=5, chunks=5, ttft=0.2, latency=0.6,
                         itl=[0.1, 0.1, 0.1, 0.1])
    slow = RequestResult(success=True, prompt_len=20, prompt_tokens=21, chunks=3, ttft=0.5, latency=1.5,
                         itl=[0.5, 0.5])
    single = RequestResult(success=True, prompt_len=4, completion_tokens=1, chunks=1, ttft=0.3, latency=0.3)
    failed = RequestResult(error="HTTP 500: boom", prompt_len=7)
    assert fast.tpot == pytest.approx(0.1) and slow.tpot == pytest.approx(0.5) and single.tpot is None
    assert slow.output_tokens == 3 and slow.input_tokens == 21     # chunks count without usage; usage wins

    summary = summarize([fast, slow, single, failed], duration=2.0)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (3, 1, ["HTTP 500: boom"])
    assert (summary["input_tokens"], summary["output_tokens"]) == (35, 9)
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(4.5)
    assert summary["total_token_throughput"] == pytest.approx(22.0)
    assert summary["ttft_mean_s"] == pytest.approx((0.2 + 0.5 + 0.3) / 3)
    assert summary["ttft_median_s"] == pytest.approx(0.3)
    assert summary["itl_mean_s"] == pytest.approx(statistics.fmean([0.1] * 4 + [0.5] * 2))
    assert summary["itl_median_s"] == pytest.approx(0.1)
    assert summary["tpot_mean_s"] == pytest.approx(0.3)          # the single-token request has no TPOT
    assert summary["e2e_latency_p99_s"] == pytest.approx(float(np.percentile([0.6, 1.5, 0.3], 99)))
    assert summary["e2e_latency_p99_s"] >= summary["e2e_latency_median_s"]


# ---- prompts and arrivals ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return hf_tokenizer(str(default_model_dir))


def test_prompts_are_seeded_and_have_the_drawn_token_lengths(tokenizer):
    prompts = generate_prompts(40, 64, 16, range_ratio=0.5, seed=7, tokenizer=tokenizer)
    again = generate_prompts(40, 64, 16, range_ratio=0.5, seed=7, tokenizer=tokenizer)
    other = generate_prompts(40, 64, 16, range_ratio=0.5, seed=8, tokenizer=tokenizer)
    assert [(p.text, p.output_len) for p in prompts] == [(p.text, p.output_len) for p in again]
    assert [p.text for p in prompts] != [p.text for p in other]
    assert len({p.text for p in prompts}) == 40 and len({p.text.split()[0] for p in prompts}) > 10
    for p in prompts:
        measured = len(tokenizer.encode(p.text, add_special_tokens=False))
        assert measured == p.input_len and 32 <= measured <= 64
        assert 8 <= p.output_len <= 16
    assert len({p.input_len for p in prompts}) > 5 and len({p.output_len for p in prompts}) > 3
    # Without a tokenizer a prompt has that many words, which is about that many tokens.
    for p in generate_prompts(10, 100, 4, seed=1):
        assert len(p.text.split()) == 100
        assert 95 <= len(tokenizer.encode(p.text)) <= 110
    assert draw_lengths(random.Random(0), 50, 10, 1.0) == [10] * 50


def test_shared_prefix_is_really_shared(tokenizer):
    prompts = generate_prompts(8, 24, 4, range_ratio=0.5, seed=3, shared_prefix_len=40, tokenizer=tokenizer)
    ids = [tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
    prefix = ids[0][:40]
    for p, tokens in zip(prompts, ids):
        assert tokens[:40] == prefix
        assert len(tokens) == p.input_len and 40 + 12 <= len(tokens) <= 40 + 24
    assert len({tuple(t[40:]) for t in ids}) == 8          # the rest differs


def test_shared_prefixes_are_cycled(tokenizer):
    prompts = generate_prompts(9, 16, 4, seed=3, shared_prefix_len=30, tokenizer=tokenizer, num_shared_prefixes=3)
    heads = [tuple(tokenizer.encode(p.text, add_special_tokens=False)[:30]) for p in prompts]
    assert len(set(heads)) == 3 and all(heads[i] == heads[i % 3] for i in range(9))
    assert all(len(tokenizer.encode(p.text, add_special_tokens=False)) == p.input_len for p in prompts)


def test_poisson_arrivals_are_seeded_with_the_requested_rate():
    times = arrival_times(20000, 10.0, seed=1)
    assert times == arrival_times(20000, 10.0, seed=1) and times != arrival_times(20000, 10.0, seed=2)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() == pytest.approx(0.1, rel=0.05)      # exponential: standard deviation = mean
    assert arrival_times(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)


# ---- srv bench serve against a real server --------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    server = Server("--api-key", API_KEY)
    yield server
    server.stop()


def test_serve_benchmark_against_srv(server, default_model_dir, capsys, tmp_path):
    before = server.scheduler_status()
    status, result = run_json(capsys, "serve", "--base-url", server.base, "--api-key", API_KEY, "--num-prompts", "6",
                              "--concurrency", "3", "--input-len", "32", "--output-len", "8",
                              "--tokenizer", str(default_model_dir), "--output", str(tmp_path / "result.json"))
    after = server.scheduler_status()
    assert status == 0
    assert (result["completed"], result["failed"], result["errors"]) == (6, 0, [])
    assert result["model"] == "SmolLM2-135M-Instruct" and result["concurrency"] == 3
    assert result["output_tokens"] == 48 and result["input_tokens"] == 6 * 32
    # The server generated exactly those tokens, plus the warm-up request's 8.
    assert after["generated_tokens"] - before["generated_tokens"] == 48 + 8
    assert after["prompt_tokens"] - before["prompt_tokens"] == 7 * 32
    for key in ("ttft", "itl", "tpot", "e2e_latency"):
        assert 0 < result[f"{key}_median_s"] <= result[f"{key}_p90_s"] <= result[f"{key}_p99_s"]
        assert result[f"{key}_mean_s"] > 0
    assert result["ttft_p99_s"] < result["e2e_latency_p99_s"]
    assert result["e2e_latency_mean_s"] < result["duration_s"]
    assert result["output_throughput"] == pytest.approx(48 / result["duration_s"])
    assert result["request_throughput"] > 0 and result["total_token_throughput"] > result["output_throughput"]
    assert json.loads((tmp_path / "result.json").read_text()) == result


def test_serve_benchmark_with_a_request_rate_and_fresh_connections(server, capsys):
    status, paced = run_json(capsys, "serve", "--base-url", server.base, "--api-key", API_KEY, "--num-prompts", "6",
                             "--request-rate", "20", "--input-len", "16", "--output-len", "6", "--seed", "3")
    assert status == 0 and paced["completed"] == 6 and paced["output_tokens"] == 36
    assert paced["request_rate"] == 20.0 and paced["concurrency"] is None
    # The chat endpoint, one new connection per request, at most two in flight.
    status, fresh = run_json(capsys, "serve", "--base-url", server.base, "--api-key", API_KEY, "--num-prompts", "4",
                             "--endpoint", "chat", "--fresh-connections", "--concurrency", "2",
                             "--input-len", "16", "--output-len", "5", "--warmup-requests", "0")
    assert status == 0 and (fresh["completed"], fresh["output_tokens"]) == (4, 20)
    assert fresh["fresh_connections"] and fresh["ttft_median_s"] > 0 and fresh["itl_median_s"] > 0
    assert fresh["input_tokens"] > 4 * 16        # the chat template's tokens, counted by the server


def test_serve_benchmark_reports_errors_from_the_server(server, capsys):
    status, result = run_json(capsys, "serve", "--base-url", server.base, "--api-key", "wrong-key",
                              "--model", "SmolLM2-135M-Instruct", "--num-prompts", "3", "--input-len", "8",
                              "--output-len", "2", "--warmup-requests", "0")
    assert status == 1 and (result["completed"], result["failed"]) == (0, 3)
    assert all(error.startswith("HTTP 401") for error in result["errors"])


def test_serve_benchmark_against_a_server_that_is_down():
    result = run_bench("serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "5",
                       "--input-len", "16", "--output-len", "4", "--disable-tqdm")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert "Failed requests:" in result.stdout and "ConnectError" in result.stdout
    assert [line.split()[-1] for line in result.stdout.splitlines() if "requests:" in line] == ["0", "5"]


def test_help_of_every_subcommand():
    for command in ("serve", "offline", "one-batch"):
        with pytest.raises(SystemExit) as exit_info:
            bench_main([command, "--help"])
        assert exit_info.value.code == 0
    assert bench_main([]) == 2


# ---- offline and one-batch on a tiny model -------------------------------------------------------


def test_offline_benchmark(tiny_models, capsys):
    status, result = run_json(capsys, "offline", "--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                              "--num-prompts", "12", "--input-len", "48", "--output-len", "6", "--seed", "5")
    assert status == 0 and (result["completed"], result["failed"]) == (12, 0)
    assert result["output_tokens"] == 12 * 6 and result["input_tokens"] == 12 * 48
    for key in ("duration_s", "request_throughput", "input_throughput", "output_throughput",
                "total_token_throughput"):
        assert result[key] > 0, key
    assert result["output_throughput"] == pytest.approx(72 / result["duration_s"])
    engine = result["engine_status"]
    assert engine["running_requests"] == 0 and engine["waiting_requests"] == 0
    # The counters include the warm-up request (min(input, 32) prompt tokens, min(output, 8) output tokens).
    assert engine["generated_tokens"] == 72 + 6 and engine["prompt_tokens"] == 12 * 48 + 32


def test_one_batch_benchmark(tiny_models, capsys):
    status, result = run_json(capsys, "one-batch", "--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                              "--batch-size", "1", "4", "--input-len", "40", "--output-len", "5")
    assert status == 0 and result["dtype"] == "float32"
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in result["runs"]] == [(1, 40, 5), (4, 40, 5)]
    for run in result["runs"]:
        assert run["prefill_steps"] >= 1 and run["decode_steps"] == 4
        for key in ("prefill_latency_s", "prefill_throughput", "decode_median_s", "decode_mean_s",
                    "decode_throughput", "total_latency_s", "overall_throughput"):
            assert run[key] > 0, key
        assert run["decode_throughput"] == pytest.approx(run["batch_size"] / run["decode_median_s"])
        assert run["prefill_throughput"] == pytest.approx(run["batch_size"] * 40 / run["prefill_latency_s"])
    # The linear layers at each batch's decode and prefill rows, beside the machine's peaks.
    gemm = result["gemm"]
    assert set(gemm["layers_gops"]) == {"1", "4", "40", "160"} and all(g > 0 for g in gemm["layers_gops"].values())
    assert set(gemm["peaks_gops"]) == {"float32", "int8"} and all(g > 0 for g in gemm["peaks_gops"].values())
    assert {"float32", "int8"} <= set(gemm["library_gops"]) and result["quantization"] == "none"


def test_instruction_peaks_on_every_instruction_set_this_cpu_has(monkeypatch):
    """The peak loops of each instruction set the machine runs (the portable C one included)
    give their figures; a name the ladder does not have is refused."""
    from srv.bench.gemm import PEAK_ISAS, instruction_peaks
    from srv.sdk import requires_cpu_flags

    for isa, flags in PEAK_ISAS.items():
        if not requires_cpu_flags(*flags)().ok:
            continue
        monkeypatch.setenv("SRV_PEAK_ISA", isa)
        measured, peaks = instruction_peaks(1)
        assert measured == isa and set(peaks) == {"float32", "int8"} and all(g > 0.1 for g in peaks.values())
    monkeypatch.setenv("SRV_PEAK_ISA", "sse9")
    with pytest.raises(ValueError, match="SRV_PEAK_ISA=sse9"):
        instruction_peaks(1)


def test_one_batch_text_report_and_a_batch_too_big(tiny_models):
    result = run_bench("one-batch", "--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                       "--batch-size", "2", "--input-len", "16", "--output-len", "3", "--disable-tqdm")
    assert result.returncode == 0, result.stderr
    assert "Prefill latency (s):" in result.stdout and "Median decode step latency (s):" in result.stdout
    assert "machine peaks" in result.stdout and "int8 GOP/s" in result.stdout and "torch's products" in result.stdout
    too_big = run_bench("one-batch", "--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                        "--max-running-requests", "2", "--batch-size", "3", "--input-len", "16", "--output-len", "3")
    assert too_big.returncode == 1 and "--max-running-requests" in too_big.stderr
    assert "Traceback" not in too_big.stderr
