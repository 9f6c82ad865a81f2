"""`srv launch [flags]`: parse every flag, resolve backends through the plugins, serve."""

from __future__ import annotations

import sys

HELP = {"-h", "--help"}


def main(argv: list[str]) -> int:
    from srv.server.early_scheduler import EarlyScheduler

    # The scheduler process starts first, importing torch while this one parses the flags.
    early = None if HELP.intersection(argv) else EarlyScheduler()
    try:
        from srv.server.scheduler_main import spawn_scheduler_processes
        from srv.args.parser import parse_launch_args
        from srv.backend_registry import RegistryConflict
        from srv.plugin_manager import load_plugins

        try:
            manager, registry = load_plugins()
        except RegistryConflict as exc:
            print(f"srv launch: error: {exc}", file=sys.stderr)
            return 2
        args = parse_launch_args(argv, manager, registry)
        if args.node_rank > 0:
            # Another node of a multi-node group: its tensor-parallel ranks, and no HTTP server.
            import logging

            from srv.engine.tensor_parallel import serve_node

            logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            return serve_node(args)
        schedulers = spawn_scheduler_processes(args, early)
        early = None
    finally:
        if early is not None:
            early.cancel()
    from srv.server.launch import serve

    return serve(args, manager, registry, schedulers)
