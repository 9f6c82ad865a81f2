"""The throughput-vs-concurrency plot: median output tokens/s per engine, min-max over the runs."""

from __future__ import annotations

from pathlib import Path

from benchmarks.results import BenchResults
from benchmarks.stats import median
from benchmarks.workloads import INPUT_LEN, OUTPUT_LEN, SWEEP, sweep_name

COLORS = {"srv": "tab:blue", "llama.cpp": "tab:orange", "hf": "tab:green"}


def sweep_values(results: BenchResults, engine: str, concurrency: int) -> list[float]:
    """The output throughputs of the runs at this point that lost no request."""
    return [run.metrics["output_throughput"] for run in results.runs
            if run.engine == engine and run.workload == sweep_name(concurrency) and not run.metrics.get("failed")]


def plot_throughput(results: BenchResults, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")   # no display: write the file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine in results.engines:
        points = [(c, values) for c in SWEEP if (values := sweep_values(results, engine, c))]
        if not points:
            continue
        xs = [c for c, _ in points]
        mids = [median(values) for _, values in points]
        ax.plot(xs, mids, marker="o", label=engine, color=COLORS.get(engine))
        ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], alpha=0.2,
                        color=COLORS.get(engine))
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(SWEEP), [str(c) for c in SWEEP])
    ax.set_xlabel("concurrent streams (HF: batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"SmolLM2-135M-Instruct Q4_1, {INPUT_LEN} in / {OUTPUT_LEN} out\n"
                 f"{results.machine.get('cpu_model', '')}, {results.machine.get('cpus', '?')} CPUs; "
                 f"median of {results.repeats} (band: min-max)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
