"""Start the engine and serve it with uvicorn."""

from __future__ import annotations

import logging
from argparse import Namespace

import uvicorn

from srv.backend_registry import BackendRegistry
from srv.plugin_manager import PluginManager
from srv.engine.engine import Engine
from srv.server.app import ServerApp

logger = logging.getLogger("srv.server")


def serve(args: Namespace, manager: PluginManager, registry: BackendRegistry) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine.from_args(args, registry)
    app = ServerApp(engine, manager.routes()).build()
    logger.info("serving %s on http://%s:%d", engine.server_args.served_model_name or "the default model",
                args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=(args.log_level_http or args.log_level).lower())
    finally:
        engine.shutdown()
