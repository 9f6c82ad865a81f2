"""SGLang's operations routes: /ping, /get_load, /pause_generation and /continue_generation,
/start_profile and /stop_profile, /configure_logging, the expert distribution recorder's three."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from srv.server.app import ServerContext, read_body, read_optional_body
from srv.server.protocol import (ConfigureLoggingRequest, DumpExpertDistributionRequest, PauseGenerationRequest,
                                 StartProfileRequest)


class AdminRoutes:
    def __init__(self, context: ServerContext) -> None:
        self.context = context

    async def ping(self, request: Request) -> Response:
        return PlainTextResponse("pong" if self.context.alive() else "", status_code=200 if self.context.alive() else 503)

    async def get_load(self, request: Request) -> Response:
        load = await self.context.frontend.control("load")
        groups = load.pop("data_parallel_groups", [load])
        return JSONResponse([{"dp_rank": rank, **group} for rank, group in enumerate(groups)])

    async def pause_generation(self, request: Request) -> Response:
        body = await read_optional_body(request, PauseGenerationRequest, self.context)
        await self.context.frontend.control("pause_generation", mode=body.mode)
        return JSONResponse({"success": True, "message": f"generation paused ({body.mode})"})

    async def continue_generation(self, request: Request) -> Response:
        await self.context.frontend.control("continue_generation")
        return JSONResponse({"success": True, "message": "generation continues"})

    async def start_profile(self, request: Request) -> Response:
        body = await read_optional_body(request, StartProfileRequest, self.context)
        path = await self.context.frontend.control("start_profile", **body.model_dump(exclude_none=True))
        return JSONResponse({"success": True, "message": f"profiling; the trace goes to {path}", "path": path})

    async def stop_profile(self, request: Request) -> Response:
        path = await self.context.frontend.control("stop_profile")
        return JSONResponse({"success": True, "message": f"trace written to {path}", "path": path})

    async def start_expert_distribution_record(self, request: Request) -> Response:
        await self.context.frontend.control("start_expert_distribution_record")
        return JSONResponse({"success": True, "message": "recording the expert distribution"})

    async def stop_expert_distribution_record(self, request: Request) -> Response:
        await self.context.frontend.control("stop_expert_distribution_record")
        return JSONResponse({"success": True, "message": "the expert distribution recording stopped"})

    async def dump_expert_distribution_record(self, request: Request) -> Response:
        body = await read_optional_body(request, DumpExpertDistributionRequest, self.context)
        dump = await self.context.frontend.control("dump_expert_distribution_record", output_dir=body.output_dir)
        return JSONResponse({"success": True, **dump})

    async def clear_hicache_storage_backend(self, request: Request) -> Response:
        await self.context.frontend.control("clear_hicache_storage_backend")
        return JSONResponse({"success": True, "message": "hierarchical cache storage backend cleared"})

    async def configure_logging(self, request: Request) -> Response:
        body = await read_body(request, ConfigureLoggingRequest, self.context)
        log = self.context.log
        if body.log_requests is not None:
            log.enabled = body.log_requests
        if body.log_requests_level is not None:
            log.level = body.log_requests_level
        if body.crash_dump_folder is not None:
            log.dump_folder = Path(body.crash_dump_folder) if body.crash_dump_folder else None
        return JSONResponse({"success": True, "log_requests": log.enabled, "log_requests_level": log.level,
                             "crash_dump_folder": str(log.dump_folder) if log.dump_folder else None})


def admin_routes(context: ServerContext) -> list[Route]:
    routes = AdminRoutes(context)
    both = ["GET", "POST"]
    return [Route("/ping", routes.ping, methods=["GET"]),
            Route("/get_load", routes.get_load, methods=["GET"]),
            Route("/pause_generation", routes.pause_generation, methods=["POST"]),
            Route("/continue_generation", routes.continue_generation, methods=["POST"]),
            Route("/start_profile", routes.start_profile, methods=both),
            Route("/stop_profile", routes.stop_profile, methods=both),
            Route("/configure_logging", routes.configure_logging, methods=["POST"]),
            Route("/start_expert_distribution_record", routes.start_expert_distribution_record, methods=both),
            Route("/stop_expert_distribution_record", routes.stop_expert_distribution_record, methods=both),
            Route("/dump_expert_distribution_record", routes.dump_expert_distribution_record, methods=both),
            Route("/clear_hicache_storage_backend", routes.clear_hicache_storage_backend, methods=both)]
