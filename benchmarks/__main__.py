"""`python -m benchmarks` (`make bench`): measure, then write results.json, the plot and BENCHMARKS.md.

    python -m benchmarks                      # BENCH_REPEATS (default 3) repetitions
    BENCH_QUICK=1 python -m benchmarks        # one repetition, one wave of prompts: checks the harness
    python -m benchmarks --report-only        # rewrite BENCHMARKS.md and the plot from results.json
    python -m benchmarks --only c16,c16-int8  # some workloads, into a report of their own
                                              # ($TMPDIR/srv-bench-only unless --report/--results/--plot)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.engine import REPO
from benchmarks.plot import plot_throughput
from benchmarks.report import write_report
from benchmarks.results import BenchResults
from benchmarks.runner import ENGINES, BenchOptions, run_bench


# A partial run (--only) must not overwrite the full run's files, which the repository keeps.
FULL_OUTPUTS = {"report": REPO / "BENCHMARKS.md", "results": REPO / "benchmarks" / "results.json",
                "plot": REPO / "benchmarks" / "throughput.png"}
ONLY_DIR = Path(tempfile.gettempdir()) / "srv-bench-only"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "no", "false")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=int(os.environ.get("BENCH_REPEATS") or 3),
                        help="repetitions whose medians are reported (env BENCH_REPEATS; default 3)")
    parser.add_argument("--quick", action="store_true", default=_truthy(os.environ.get("BENCH_QUICK")),
                        help="1 repetition with one wave of prompts per point (env BENCH_QUICK=1)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--report", type=Path, help="the report to write (default BENCHMARKS.md)")
    parser.add_argument("--results", type=Path, help="the raw results (JSON; default benchmarks/results.json)")
    parser.add_argument("--plot", type=Path, help="the PNG plot (default benchmarks/throughput.png)")
    parser.add_argument("--only", default="", help="comma-separated workload names: run just these "
                        "(and no grammar mask cost); the report, results and plot then default to "
                        f"{ONLY_DIR}, never the repository's full report")
    parser.add_argument("--report-only", action="store_true", help="no measurement: rewrite from --results")
    args = parser.parse_args(argv)
    args.engines = tuple(e for e in args.engines.split(",") if e)
    args.only = tuple(w for w in args.only.split(",") if w)
    defaults = FULL_OUTPUTS if not args.only else {name: ONLY_DIR / path.name for name, path in FULL_OUTPUTS.items()}
    for name, path in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, path)
    unknown = set(args.engines) - set(ENGINES)
    if unknown or "srv" not in args.engines:
        parser.error(f"--engines must include srv and name only {', '.join(ENGINES)}")
    if args.quick:
        args.repeats = 1
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)   # not one line per poll
    for path in (args.report, args.results, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = BenchResults.load(args.results)
    else:
        results = run_bench(BenchOptions(args.repeats, args.quick, args.engines, args.results, only=args.only))
    plot_throughput(results, args.plot)
    write_report(results, args.report, args.plot)
    logging.getLogger("benchmarks").info("bench: wrote %s and %s", args.report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
