"""Per-request timings and the summary `srv bench serve` reports (seconds; throughputs per second)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

PERCENTILES = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))


@dataclass
class RequestResult:
    """One request's outcome, timed by the client (perf_counter seconds)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0             # local count of the prompt's tokens
    prompt_tokens: int | None = None        # the server's usage, when it sends one
    completion_tokens: int | None = None
    chunks: int = 0                 # streamed chunks that carried text
    ttft: float = 0.0               # request sent -> first text chunk
    latency: float = 0.0            # request sent -> stream ended (end to end)
    itl: list[float] = field(default_factory=list)   # gaps between text chunks, per token

    @property
    def output_tokens(self) -> int:
        """The server's count when it reports usage, else one token per text chunk."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None


def per_token_gaps(chunk_times: Sequence[float], output_tokens: int) -> list[float]:
    """Inter-token latencies from the arrival times of the text chunks.

    A server that streams several tokens per chunk (SGLang/srv --stream-interval, llama-server
    batching) leaves fewer gaps than tokens: each gap is then divided by the mean number of
    tokens per gap, (output_tokens - 1) / gaps, so every value stays a per-token latency.
    """
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    if not gaps:
        return []
    per_gap = max(1.0, (output_tokens - 1) / len(gaps))
    return [g / per_gap for g in gaps]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90 and p99 of `values` (zeros when empty)."""
    out = {}
    for name, q in PERCENTILES:
        out[name] = (sum(values) / len(values) if values else 0.0) if q is None else percentile(values, q)
    return out


# key, short name, section title
METRICS = (("ttft", "TTFT", "Time to first token"), ("itl", "ITL", "Inter-token latency"),
           ("tpot", "TPOT", "Time per output token (excl. 1st)"), ("e2e_latency", "E2E", "End-to-end latency"))
STAT_LABELS = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99"}


def summarize(results: Sequence[RequestResult], duration: float, max_errors: int = 5) -> dict[str, Any]:
    """The benchmark's result object: counts, throughputs and latency distributions.

    Keys: completed, failed, errors (the first few messages), duration_s, input_tokens,
    output_tokens, request_throughput (req/s), input_throughput, output_throughput,
    total_token_throughput (tok/s), and {ttft,itl,tpot,e2e_latency}_{mean,median,p90,p99}_s.
    """
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "errors": [r.error for r in failed[:max_errors]],
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "input_throughput": per_second(input_tokens),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "itl": [gap for r in ok for gap in r.itl],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "e2e_latency": [r.latency for r in ok],
    }
    for key, _, _ in METRICS:
        for name, value in describe(samples[key]).items():
            summary[f"{key}_{name}_s"] = value
    return summary


def throughput_rows(summary: dict[str, Any]) -> list[tuple[str, str] | str]:
    """The table rows every benchmark shares: request counts, duration, tokens, throughputs."""
    return [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['input_tokens']}"),
        ("Total output tokens", f"{summary['output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{summary['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]


def format_table(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    """The summary as aligned text (latencies in milliseconds)."""
    rows = throughput_rows(summary)
    for key, short, section in METRICS:
        rows.append(section)
        for name, _ in PERCENTILES:
            rows.append((f"{STAT_LABELS[name]} {short} (ms)", f"{summary[f'{key}_{name}_s'] * 1e3:.2f}"))
    return render(title, rows, summary.get("errors") or [])


def render(title: str, rows: list[tuple[str, str] | str], errors: Sequence[str] = ()) -> str:
    width = max([len(r[0]) for r in rows if isinstance(r, tuple)] + [len(title)]) + 2
    value_width = max([len(r[1]) for r in rows if isinstance(r, tuple)] + [8])
    total = width + value_width
    lines = [f" {title} ".center(total, "=")]
    for row in rows:
        if isinstance(row, str):
            lines.append(f" {row} ".center(total, "-"))
        else:
            lines.append(f"{row[0] + ':':<{width}}{row[1]:>{value_width}}")
    for error in errors:
        lines.append(f"error: {error}")
    lines.append("=" * total)
    return "\n".join(lines)
