"""The benchmark harness's pieces that need no peer: workloads, medians and ratios, the report,
the plot, the results file, the machine-limit measurements and the decode-kernel timer (tiny
sizes, no timing checks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

# `benchmarks/` is a top-level folder of the repository, not part of the installed srv.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.hf_peer import batch_inputs  # noqa: E402
from benchmarks.limits import LimitSizes, measure_limits  # noqa: E402
from benchmarks.llama_engine import BASE_CTX, SlotConfig, slot_configs  # noqa: E402
from benchmarks.load import load_command  # noqa: E402
from benchmarks.plot import plot_throughput  # noqa: E402
from benchmarks.report import NOTES_BEGIN, NOTES_END, write_report  # noqa: E402
from benchmarks.results import LAUNCH, BenchResults, Probe, Run  # noqa: E402
from benchmarks.stats import median, medians, ratio, repetition_ratios  # noqa: E402
from benchmarks.workloads import W1, W2, W3, num_prompts, workloads  # noqa: E402

# Output tok/s per engine at each sweep point; W2 and W4 get fixed numbers below.
SPEED = {"srv": {1: 50.0, 4: 150.0, 16: 400.0, 64: 600.0},
         "llama.cpp": {1: 100.0, 4: 250.0, 16: 500.0, 64: 700.0},
         "hf": {1: 25.0, 4: 80.0, 16: 200.0, 64: 300.0}}


def serve_metrics(tok_s: float, ttft: float = 0.1, tpot: float = 0.02, failed: int = 0) -> dict[str, float]:
    return {"completed": 32, "failed": failed, "duration_s": 4096 / tok_s, "output_tokens": 4096,
            "output_throughput": tok_s, "ttft_median_s": ttft, "tpot_median_s": tpot, "itl_median_s": tpot}


def fake_results() -> BenchResults:
    runs = []
    for rep, scale in ((1, 0.9), (2, 1.0), (3, 1.2)):       # the median is the rep-2 value
        for engine, speeds in SPEED.items():
            runs.append(Run(engine, rep, LAUNCH, {"launch_to_first_token_s": {"srv": 4.0, "llama.cpp": 1.0,
                                                                               "hf": 6.0}[engine] * scale}))
            for c, tok_s in speeds.items():
                runs.append(Run(engine, rep, f"c{c}", serve_metrics(tok_s * scale, tpot=1 / speeds[1] * scale)))
            runs.append(Run(engine, rep, W2, serve_metrics(300.0 * scale, ttft=0.2 * scale)))
        runs.append(Run("srv", rep, "repeat", serve_metrics(50.0, tpot=0.020 * scale)))
        runs.append(Run("llama.cpp", rep, "repeat", serve_metrics(50.0, tpot=0.010 * scale)))
        runs.append(Run("srv", rep, "repeat-ngram", {**serve_metrics(50.0, tpot=0.008 * scale),
                                                     "spec_accept_length": 3.5}))
        runs.append(Run("srv", rep, "c1-float32", serve_metrics(30.0, tpot=0.040 * scale)))
        runs.append(Run("srv", rep, "c1-dense", serve_metrics(30.0, tpot=0.030 * scale)))
        runs.append(Run("srv", rep, "prefixes8", serve_metrics(20.0, ttft=3.0 * scale)))
        runs.append(Run("srv", rep, "prefixes8-hicache", serve_metrics(60.0, ttft=0.6 * scale)))
    for pair, cold in enumerate((1.0, 1.2, 0.8)):
        runs.append(Run("srv", 1, f"restart-{pair}-cold", serve_metrics(1.0, ttft=cold)))
        runs.append(Run("srv", 1, f"restart-{pair}-warm", serve_metrics(1.0, ttft=cold / 4)))
    # A run that lost requests must not move the medians.
    runs.append(Run("srv", 4, W1, serve_metrics(1.0, failed=3)))
    limits = measure_limits(1_000_000, LimitSizes(bandwidth_bytes=1 << 20, matmul_k=32, matmul_n=32, seconds=0.0))
    return BenchResults(repeats=3, quick=False,
                        machine={"date": "2026-01-01 00:00 UTC", "cpu_model": "Test CPU", "cpus": 2,
                                 "memory_gib": 24.0, "isa": ["avx512f"], "loadavg_start": 0.1, "loadavg_end": 0.2},
                        limits=limits, engines=list(SPEED), chosen={"srv": "defaults", "llama.cpp": "--repack",
                                                                    "hf": "bf16"},
                        probes=[Probe("llama.cpp", "--repack -t 2", 500.0), Probe("llama.cpp", "--no-repack -t 2",
                                                                                  None, "exited with -4")],
                        runs=runs, duration_s=600.0)


def test_workloads_reuse_the_sweep_for_w1_and_w3():
    names = [w.name for w in workloads(quick=False)]
    assert names == ["c1", "c4", "c16", "c64", "prefix16", "prefix16-steady", "c16-hog", "repeat", "c1-ngram",
                     "repeat-ngram", "c1-int8", "c16-int8", "c64-int8", "c1-float32", "c16-float32",
                     "c64-float32", "c1-dense", "prefixes8", "prefixes8-hicache", "c1-tp2", "c16-tp2", "c1-pp2", "c16-pp2", "c1-dp2", "c16-dp2", "c1-dpattn", "c16-dpattn", "c16-lora4", "c16-lora4-torch"]
    assert W1 == "c16" and W3 == "c1" and W2 == "prefix16"
    assert [num_prompts(c, False) for c in (1, 4, 16, 64)] == [4, 8, 16, 64]
    assert [num_prompts(c, True) for c in (1, 4, 16, 64)] == [2, 4, 16, 64]
    everything = workloads(quick=False)
    everything, (lora, lora_torch) = everything[:-2], everything[-2:]
    assert (lora.concurrency, lora.lora_adapters, lora.srv_flags) == (16, 4, ("--max-loras-per-batch", "4"))
    assert (lora_torch.lora_adapters, lora_torch.srv_flags) == (4, lora.srv_flags + ("--lora-backend", "torch"))
    everything, parallel = everything[:-8], everything[-8:]
    assert [(w.concurrency, w.srv_flags) for w in parallel] == [
        (c, (flag, "2")) for flag in ("--tp-size", "--pp-size", "--dp-size") for c in (1, 16)] + [
        (c, ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--enable-dp-lm-head")) for c in (1, 16)]
    burst, steady, hog, repeat, w3_ngram, repeat_ngram = everything[-15:-9]
    assert repeat.endpoint == repeat_ngram.endpoint == "chat" and repeat.instruction == repeat_ngram.instruction
    assert w3_ngram.speculative and repeat_ngram.speculative and not repeat.speculative
    assert burst.shared_prefix_len == steady.shared_prefix_len == 512 and burst.context_tokens == 768
    assert (burst.num_prompts, steady.num_prompts, steady.concurrency) == (16, 48, 16)
    assert hog.hog and not burst.hog and (hog.concurrency, hog.num_prompts) == (16, 16)
    int8, float32, dense, hierarchical = everything[-9:-6], everything[-6:-3], everything[-3], everything[-2:]
    assert all(w.srv_flags == ("--quantization", "w8a8_int8") and not w.speculative for w in int8)
    assert [w.concurrency for w in int8 + float32] == [1, 16, 64, 1, 16, 64]
    assert (dense.concurrency, dense.srv_flags) == (1, ("--quantization", "none"))
    assert all(w.srv_flags == ("--quantization", "none", "--dtype", "float32") for w in float32)
    w6, w6_hicache = hierarchical
    assert (w6.num_shared_prefixes, w6.shared_prefix_len, w6.concurrency, w6.num_prompts) == (8, 1024, 16, 32)
    assert w6_hicache.srv_flags[:len(w6.srv_flags)] == w6.srv_flags and "--enable-hierarchical-cache" in w6_hicache.srv_flags


def test_median_and_ratio():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert median([]) is None
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(None, 4.0) is None and ratio(2.0, None) is None and ratio(2.0, 0.0) is None


def test_medians_leave_out_runs_with_failed_requests():
    values = medians(fake_results().runs)
    assert values[("srv", W1, "output_throughput")] == pytest.approx(400.0)
    assert values[("hf", LAUNCH, "launch_to_first_token_s")] == pytest.approx(6.0)


def test_repetition_ratios_pair_each_repetition_and_skip_failed_runs():
    runs = [Run("srv", 1, W1, serve_metrics(300.0)), Run("llama.cpp", 1, W1, serve_metrics(100.0)),
            Run("srv", 2, W1, serve_metrics(200.0)), Run("llama.cpp", 2, W1, serve_metrics(50.0)),
            Run("srv", 3, W1, serve_metrics(200.0, failed=1)), Run("llama.cpp", 3, W1, serve_metrics(50.0)),
            Run("srv", 4, W1, serve_metrics(200.0))]
    assert repetition_ratios(runs, "srv", "llama.cpp", W1, "output_throughput") == [3.0, 4.0]
    assert repetition_ratios(runs, "srv", "hf", W1, "output_throughput") == []


def test_llama_slots_give_every_stream_room():
    groups = slot_configs(workloads(quick=False))
    assert [[w.name for w in ws] for ws in groups.values()] == [
        ["c1", "c4", "c16", "prefix16", "prefix16-steady", "c16-hog", "repeat"], ["c64"]]
    small, large = groups
    assert small == SlotConfig(16, BASE_CTX)
    assert large.slots == 64 and large.ctx >= 64 * 256


def test_load_command_for_llama_server():
    prefix = next(w for w in workloads(quick=True) if w.name == W2)
    command = load_command("http://127.0.0.1:1234", prefix, ROOT / "tok", fresh_connections=True)
    assert command[1:3] == ["bench", "serve"]
    for flag, value in (("--concurrency", "16"), ("--shared-prefix-len", "512"), ("--tokenizer", str(ROOT / "tok"))):
        assert command[command.index(flag) + 1] == value
    assert "--fresh-connections" in command and "--json" in command


def test_hf_batches_are_left_padded():
    ids, mask = batch_inputs([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_limits_run_with_tiny_sizes():
    sizes = LimitSizes(bandwidth_bytes=1 << 20, matmul_k=64, matmul_n=64, seconds=0.0)
    limits = measure_limits(134_515_008, sizes)
    assert limits["bandwidth"]["read_gb_s"] > 0 and limits["bandwidth"]["copy_gb_s"] > 0
    assert set(limits["matmul_gflops"]) == {"bf16_m128", "bf16_m1", "fp32_m128", "fp32_m1"}
    ceilings = {c["weight_format"]: c for c in limits["decode_ceilings"]}
    assert ceilings["bf16"]["weight_bytes"] == 2 * 134_515_008
    # Fewer bytes per weight, a proportionally higher single-stream ceiling.
    assert ceilings["4-bit (Q4_1)"]["single_stream_tok_s"] == pytest.approx(
        ceilings["bf16"]["single_stream_tok_s"] * 2 / (20 / 32))


def test_report_has_the_medians_ratios_and_keeps_the_notes(tmp_path):
    results = fake_results()
    report, plot = tmp_path / "BENCHMARKS.md", tmp_path / "benchmarks" / "throughput.png"
    report.write_text(f"old\n{NOTES_BEGIN}\nA human wrote this.\n{NOTES_END}\n")
    plot_throughput(results, plot)
    write_report(results, report, plot)
    text = report.read_text()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![output tokens/s vs concurrency](benchmarks/throughput.png)" in text
    assert "| workload | metric | srv | llama.cpp | hf | srv/llama.cpp | srv/hf |" in text
    w1 = next(line for line in text.splitlines() if line.startswith("| W1:"))
    assert "| 400.0 | 500.0 | 200.0 | 0.80× | 2.00× |" in w1
    w4 = next(line for line in text.splitlines() if line.startswith("| W4:"))
    assert "| 4.00 | 1.00 | 6.00² | 4.00× | 0.67× |" in w4
    assert "| 64 | 600.0 | 700.0 | 300.0 | 0.86× | 2.00× |" in text
    by_rep = text.split("### Ratios within each repetition", 1)[1]
    w1 = next(line for line in by_rep.splitlines() if line.startswith("| W1:"))
    assert "| 0.800, 0.800, 0.800 | 0.800× | 2.00, 2.00, 2.00 | 2.00× |" in w1
    assert "Test CPU" in text and "exited with -4" in text
    assert text.count("\n| srv | ") == 3 * 12 + 6 + 1               # every run, the failed one too
    dense = text.split("### Dense weights", 1)[1].split("###", 1)[0]
    # The test machine has no bf16: both rows serve float32, 40 and 30 ms against one floor.
    floor = next(c for c in results.limits["decode_ceilings"] if c["weight_format"] == "fp32")["single_stream_ms"]
    assert f"| `--quantization none --dtype float32` | fp32 | 40.00 | {floor:.2f} | {40 / floor:.2f}× |" in dense
    assert f"| `--quantization none` | fp32 | 30.00 | {floor:.2f} | {30 / floor:.2f}× |" in dense
    speculative = text.split("### Speculative decoding (NGRAM)", 1)[1]
    assert "| W5 with NGRAM / W5 srv default | 0.400, 0.400, 0.400 | 0.400× |" in speculative
    assert "| W5 with NGRAM / W5 llama.cpp | 0.800, 0.800, 0.800 | 0.800× |" in speculative
    assert "repeat-ngram: 3.50, 3.50, 3.50" in speculative
    hierarchical = text.split("### Hierarchical cache", 1)[1]
    assert "| W6 with the hierarchical cache | 600 | 0.200, 0.200, 0.200 | 0.200× |" in hierarchical
    assert "| 1 | 1200 | 300 | 0.250× |" in hierarchical and "Median warm / cold: 0.250×." in hierarchical
    assert "A human wrote this." in text and "old" not in text.split("# Benchmarks")[0]
    write_report(results, report, plot)                              # regenerating keeps the notes once
    assert report.read_text().count("A human wrote this.") == 1


def test_results_round_trip_through_json(tmp_path):
    results = fake_results()
    results.save(tmp_path / "results.json")
    assert BenchResults.load(tmp_path / "results.json") == results


def test_decode_kernels_run_on_the_default_model_with_tiny_sizes():
    """`python -m benchmarks.decode_kernels` calls the kernels directly, so a change of their C
    signatures must show here (no timing checks)."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.decode_kernels", "--rows", "1", "--batches", "2",
                             "--contexts", "9", "--shared-prefixes", "0", "4", "--repeats", "1", "--dense-rows", "1", "--lora-rows", "2"],
                            cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| float32 | 1 |" in result.stdout and "| bfloat16 | 1 |" in result.stdout
    assert "| float32 | 2 |" in result.stdout and "| bfloat16 | 2 |" in result.stdout, "LoRA products"
    assert "| 1 |" in result.stdout and "| 2 | 9 | 0 |" in result.stdout and "| 2 | 9 | 4 |" in result.stdout


def test_an_engine_beside_a_hog_against_itself_quiet():
    from benchmarks.engine import cpu_hog
    from benchmarks.workloads import W1_HOG

    runs = [Run("srv", rep, workload, {"output_throughput": value})
            for rep, workload, value in ((0, W1, 100.0), (0, W1_HOG, 60.0), (1, W1, 80.0), (1, W1_HOG, 60.0))]
    assert repetition_ratios(runs, "srv", "srv", W1_HOG, "output_throughput", W1) == [0.6, 0.75]
    with cpu_hog(True):
        busy = [p for p in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
                if "while True: pass" in p]
    assert busy
    assert not [p for p in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
                if "while True: pass" in p and "ps -eo" not in p]


def test_the_runs_table_names_adapters_without_their_folders(tmp_path):
    from benchmarks.engine import BenchContext
    from benchmarks.srv_engine import SrvEngine

    engine = SrvEngine(BenchContext(None, [], tmp_path))
    engine.adapters = [engine.adapter_folder / "a0", engine.adapter_folder / "a1"]
    flags = ("--max-loras-per-batch", "4", "--lora-paths", *(f"{p.name}={p}" for p in engine.adapters))
    assert engine.config(flags) == "--max-loras-per-batch 4 --lora-paths a0 a1"


def test_a_partial_run_never_writes_over_the_full_reports_files():
    from benchmarks.__main__ import FULL_OUTPUTS, ONLY_DIR, parse_args

    full = parse_args([])
    assert (full.report, full.results, full.plot) == tuple(FULL_OUTPUTS.values())
    partial = parse_args(["--only", "c16", "--report", "/tmp/x.md"])
    assert partial.report == Path("/tmp/x.md")
    assert partial.results.parent == partial.plot.parent == ONLY_DIR
    assert not {partial.results, partial.plot} & set(FULL_OUTPUTS.values())
