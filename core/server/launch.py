"""`srv launch`: start the scheduler process, then serve HTTP with uvicorn until a signal
(SIGINT/SIGTERM) or the scheduler's death; exit non-zero in the latter case."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
from argparse import Namespace
from pathlib import Path
from typing import Any

import uvicorn

import srv
from srv.backend_registry import BackendRegistry
from srv.plugin_manager import PluginManager
from srv.sdk.tools import ToolCallParser
from srv.server.app import ServerContext, build_app
from srv.engine.diagnostics import install_gc_warning
from srv.engine.frontend import EngineDead
from srv.server.metrics import ServerMetrics
from srv.server.tracing import RequestTracer
from srv.server.request_log import RequestLog
from srv.server.scheduler_main import SpawnedScheduler
from srv.server.scheduler_process import SchedulerProcess
from srv.engine.warmups import FrontendWarmupClient, run_warmups, warmup_names

logger = logging.getLogger("srv.server")


def serve(args: Namespace, manager: PluginManager, registry: BackendRegistry,
          schedulers: list[SpawnedScheduler]) -> int:
    """Serve with the scheduler processes that `spawn_scheduler_processes` started (early: it
    imports torch while this process imports the HTTP stack)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(args, manager, registry, schedulers))


async def _serve(args: Namespace, manager: PluginManager, registry: BackendRegistry,
                 schedulers: list[SpawnedScheduler]) -> int:
    log = RequestLog(args)
    model_name = args.served_model_name or args.model_path or "SmolLM2-135M-Instruct"
    server: uvicorn.Server | None = None
    death: list[str] = []

    def on_death(reason: str) -> None:
        death.append(reason)
        log.dump(reason)
        if server is not None:
            server.should_exit = True

    def on_signal(signum: int, frame: Any) -> None:
        # uvicorn handles SIGINT/SIGTERM while it serves, then re-raises them to the handler that
        # was there before: this one, so the scheduler process is still shut down in order.
        signals.append(signum)
        if server is not None:
            server.should_exit = True

    signals: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    scheduler = SchedulerProcess(args, registry, schedulers, on_death)
    tracer: RequestTracer | None = None
    try:
        try:
            metrics = ServerMetrics(args, model_name) if args.enable_metrics else None
            tracer = RequestTracer(args) if args.enable_trace else None
        except (ValueError, RuntimeError) as exc:
            logger.error("%s", exc)
            return 2
        install_gc_warning(args.gc_warning_threshold_secs)
        try:
            frontend = await scheduler.start()
        except RuntimeError as exc:
            logger.error("%s", exc)
            return 1
        ready = scheduler.ready
        context = ServerContext(frontend, args, model_name, {"model_dir": ready.model_dir, **ready.model_info}, log,
                                alive=lambda: scheduler.alive, version=srv.__version__, metrics=metrics,
                                tool_parser=_tool_parser(args, registry),
                                reasoning_parser=registry.choose("reasoning_parser", args.reasoning_parser).create()
                                if args.reasoning_parser else None,
                                reasoning_parsers=lambda name: registry.choose("reasoning_parser", name).create(),
                                tool_parsers=lambda name: registry.choose("tool_call_parser", name).create())
        if args.debug_tensor_dump_input_file:
            # SGLang's debugging run: the file's token ids through the model (their layers dumped
            # with --debug-tensor-dump-output-folder), then the server ends without listening.
            try:
                ids = dump_input_ids(args.debug_tensor_dump_input_file)
            except (ValueError, OSError) as exc:
                logger.error("%s", exc)
                return 2
            await frontend.generate([None], [ids], [{"max_new_tokens": 1, "temperature": 0}])
            logger.info("ran the %d token ids of %s (--debug-tensor-dump-input-file); exiting", len(ids),
                        args.debug_tensor_dump_input_file)
            return 0
        try:
            if not args.skip_server_warmup:
                # One token through the whole path, so the first user request pays no one-time costs.
                await frontend.probe()
            if warmup_names(args):
                await run_warmups(args, registry, FrontendWarmupClient(frontend, ready.model_info["chunked_prefill_size"],
                                                                       ready.model_info["max_running_requests"]))
        except EngineDead:
            pass   # the scheduler died during the warm-up: on_death has the reason, and the server ends below
        if args.delete_ckpt_after_loading:
            delete_checkpoint(args.model_path)
        frontend.observers += [o.observe for o in (metrics, tracer, log) if o is not None]
        config = uvicorn.Config(build_app(context, manager.routes()), host=args.host, port=args.port,
                                log_level=(args.log_level_http or args.log_level).lower())
        server = uvicorn.Server(config)
        if not signals and not death:   # a scheduler that died while warming up is not served
            logger.info("serving %s on http://%s:%d", model_name, args.host, args.port)
            await server.serve()
    finally:
        await scheduler.shutdown()
        if tracer is not None:
            tracer.shutdown()
    if death:
        logger.error("exiting: %s", death[0])
        return 1
    return 0


def dump_input_ids(path: str) -> list[int]:
    """The token ids of a --debug-tensor-dump-input-file: a NumPy array (.npy, as SGLang reads
    it) or a JSON list."""
    if path.endswith(".npy"):
        import numpy

        ids = numpy.load(path).reshape(-1).tolist()
    else:
        ids = json.loads(Path(path).read_text())
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"--debug-tensor-dump-input-file {path}: not a list of token ids")
    return ids


def delete_checkpoint(model_path: str) -> None:
    """--delete-ckpt-after-loading: remove the checkpoint every rank has loaded (after the warm-up,
    which every rank takes part in): the directory or file --model-path names on this machine."""
    path = Path(model_path)
    if not path.exists():
        logger.warning("--delete-ckpt-after-loading: %s is not a path on this machine; nothing deleted", model_path)
        return
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    logger.info("deleted the checkpoint %s (--delete-ckpt-after-loading)", path)


def _tool_parser(args: Namespace, registry: BackendRegistry) -> ToolCallParser | None:
    """The --tool-call-parser; None when it is unset and no parser is installed (requests with
    tools then get a 400 that names the flag)."""
    if args.tool_call_parser is None and not registry.registrations("tool_call_parser"):
        return None
    return registry.choose("tool_call_parser", args.tool_call_parser).create()
