"""SGLang's routes for the weights at run time: /update_weights_from_disk, /get_weights_by_name,
/update_weight_version, and with --enable-memory-saver /release_memory_occupation and
/resume_memory_occupation (on CPU: the KV pool and the weights dropped, then restored from the
checkpoint); /load_lora_adapter and /unload_lora_adapter (with --enable-lora)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from srv.server.app import APIError, ServerContext, read_body, read_optional_body
from srv.server.protocol import (GetWeightsByNameRequest, LoadLoRAAdapterRequest, MemoryOccupationRequest,
                                 UnloadLoRAAdapterRequest, UpdateWeightVersionRequest, UpdateWeightsFromDiskRequest)


class WeightsRoutes:
    def __init__(self, context: ServerContext) -> None:
        self.context = context

    async def update_weights_from_disk(self, request: Request) -> Response:
        body = await read_body(request, UpdateWeightsFromDiskRequest, self.context)
        if body.abort_all_requests:
            self.context.frontend.abort_all()
        result = await self.context.frontend.control("update_weights_from_disk", model_path=body.model_path,
                                                     load_format=body.load_format,
                                                     abort_all_requests=body.abort_all_requests)
        if body.weight_version is not None:
            self.context.weight_version = body.weight_version
        return JSONResponse({**result, "num_paused_requests": 0, "weight_version": self.context.weight_version})

    async def get_weights_by_name(self, request: Request) -> Response:
        body = await read_body(request, GetWeightsByNameRequest, self.context)
        return JSONResponse(await self.context.frontend.control("get_weights_by_name", name=body.name,
                                                                truncate_size=body.truncate_size))

    async def update_weight_version(self, request: Request) -> Response:
        body = await read_body(request, UpdateWeightVersionRequest, self.context)
        if body.abort_all_requests:
            self.context.frontend.abort_all()
        self.context.weight_version = body.new_version
        return JSONResponse({"success": True, "message": f"weight version {body.new_version}",
                             "new_version": body.new_version})

    async def _memory(self, request: Request, method: str) -> Response:
        if not self.context.args.enable_memory_saver:
            raise APIError("releasing memory needs --enable-memory-saver")
        body = await read_optional_body(request, MemoryOccupationRequest, self.context)
        await self.context.frontend.control(method, tags=body.tags)
        what = ", ".join(body.tags or ["kv_cache", "weights"])
        return JSONResponse({"success": True, "message": f"{method.removesuffix('_memory_occupation')}d: {what}"})

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await read_body(request, LoadLoRAAdapterRequest, self.context)
        loaded = await self.context.frontend.load_lora_adapter(body.lora_name, body.lora_path)
        return JSONResponse({"success": True, "message": f"adapter {body.lora_name} loaded", "loaded_adapters": loaded})

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await read_body(request, UnloadLoRAAdapterRequest, self.context)
        loaded = await self.context.frontend.unload_lora_adapter(body.lora_name)
        return JSONResponse({"success": True, "message": f"adapter {body.lora_name} unloaded", "loaded_adapters": loaded})

    async def release_memory_occupation(self, request: Request) -> Response:
        return await self._memory(request, "release_memory_occupation")

    async def resume_memory_occupation(self, request: Request) -> Response:
        return await self._memory(request, "resume_memory_occupation")


def weights_routes(context: ServerContext) -> list[Route]:
    routes = WeightsRoutes(context)
    return [Route(f"/{name}", getattr(routes, name), methods=["POST"])
            for name in ("update_weights_from_disk", "get_weights_by_name", "update_weight_version",
                         "release_memory_occupation", "resume_memory_occupation", "load_lora_adapter",
                         "unload_lora_adapter")]
