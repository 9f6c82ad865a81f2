"""`srv`: the console script. Each subcommand lives in its own module of this package."""

from __future__ import annotations

import argparse
import importlib
import sys

import srv

COMMANDS = {
    "launch": ("srv.cli.launch", "start the server"),
    "plugins": ("srv.cli.plugins", "list plugins and their backends; `srv plugins new` writes a plugin"),
    "bench": ("srv.cli.bench", "benchmark a server (serve), the engine (offline) or one static batch (one-batch)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="srv", description="An LLM inference server built from plugins.")
    parser.add_argument("--version", action="version", version=f"srv {srv.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    known, rest = parser.parse_known_args(argv[:1])
    if known.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[known.command][0])
    return int(module.main(rest + argv[1:]) or 0)
