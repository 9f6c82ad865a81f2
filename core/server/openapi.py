"""The OpenAPI document at /openapi.json, made from the routes' pydantic schemas
(`srv.server.protocol`): what a client may send each route and what it gets back."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from srv.server import protocol
from srv.server.app import APIKeyMiddleware, ServerContext
from srv.server.responses_routes import ResponseObject, ResponsesRequest

# path -> (request body, response body, whether it can stream server-sent events)
BODIES: dict[str, tuple[type[BaseModel] | None, type[BaseModel] | None, bool]] = {
    "/v1/completions": (protocol.CompletionRequest, protocol.CompletionResponse, True),
    "/v1/chat/completions": (protocol.ChatCompletionRequest, protocol.ChatCompletionResponse, True),
    "/generate": (protocol.GenerateRequest, protocol.GenerateResult, True),
    "/abort_request": (protocol.AbortRequestBody, None, False),
    "/separate_reasoning": (protocol.SeparateReasoningRequest, protocol.SeparateReasoningResponse, False),
    "/parse_function_call": (protocol.ParseFunctionCallRequest, protocol.ParseFunctionCallResponse, False),
    "/open_session": (protocol.OpenSessionRequest, None, False),
    "/close_session": (protocol.CloseSessionRequest, None, False),
    "/pause_generation": (protocol.PauseGenerationRequest, protocol.OperationResult, False),
    "/clear_hicache_storage_backend": (None, protocol.OperationResult, False),
    "/start_expert_distribution_record": (None, protocol.OperationResult, False),
    "/stop_expert_distribution_record": (None, protocol.OperationResult, False),
    "/dump_expert_distribution_record": (protocol.DumpExpertDistributionRequest, protocol.ExpertDistribution, False),
    "/continue_generation": (None, protocol.OperationResult, False),
    "/start_profile": (protocol.StartProfileRequest, protocol.OperationResult, False),
    "/stop_profile": (None, protocol.OperationResult, False),
    "/configure_logging": (protocol.ConfigureLoggingRequest, protocol.OperationResult, False),
    "/get_load": (None, protocol.LoadEntry, False),
    "/update_weights_from_disk": (protocol.UpdateWeightsFromDiskRequest, protocol.OperationResult, False),
    "/get_weights_by_name": (protocol.GetWeightsByNameRequest, None, False),
    "/update_weight_version": (protocol.UpdateWeightVersionRequest, protocol.OperationResult, False),
    "/release_memory_occupation": (protocol.MemoryOccupationRequest, protocol.OperationResult, False),
    "/resume_memory_occupation": (protocol.MemoryOccupationRequest, protocol.OperationResult, False),
    "/load_lora_adapter": (protocol.LoadLoRAAdapterRequest, protocol.OperationResult, False),
    "/unload_lora_adapter": (protocol.UnloadLoRAAdapterRequest, protocol.OperationResult, False),
    "/v1/responses": (ResponsesRequest, ResponseObject, True),
    "/v1/responses/{response_id}": (None, ResponseObject, False),
    "/v1/embeddings": (protocol.EmbeddingRequest, protocol.EmbeddingResponse, False),
    "/encode": (protocol.EncodeRequest, protocol.EncodeResult, False),
    "/v1/score": (protocol.ScoreRequest, protocol.ScoreResponse, False),
    "/v1/rerank": (protocol.RerankRequest, protocol.RerankResult, False),
    "/v1/models": (None, protocol.ModelList, False),
    "/v1/models/{model}": (None, protocol.ModelCard, False),
    **{f"{prefix}/tokenize": (protocol.TokenizeRequest, protocol.TokenizeResponse, False) for prefix in ("", "/v1")},
    **{f"{prefix}/detokenize": (protocol.DetokenizeRequest, protocol.DetokenizeResponse, False)
       for prefix in ("", "/v1")},
}
# Routes that answer plain text (or nothing) on success.
TEXT_ROUTES = {"/metrics", "/flush_cache", "/ping"}
# Routes that answer one result or, for a batch, a list of them; and routes that answer a list.
ONE_OR_LIST_ROUTES = {"/generate", "/encode"}
LIST_ROUTES = {"/v1/rerank", "/get_load"}
# Routes that answer a list of numbers.
NUMBER_LIST_ROUTES = {"/get_weights_by_name"}
STRING_ROUTES = {"/open_session"}   # answer a JSON string
SUMMARIES = {
    "/v1/completions": "OpenAI's legacy completions", "/v1/chat/completions": "OpenAI's chat completions",
    "/v1/models": "the served model", "/v1/models/{model}": "one model",
    "/v1/responses": "OpenAI's Responses API", "/v1/responses/{response_id}": "a stored response", "/generate": "SGLang's native generation",
    "/health": "200 while the scheduler runs", "/health_generate": "200 once the scheduler makes a token",
    "/get_model_info": "the model's path and shapes", "/get_server_info": "launch arguments and scheduler counters",
    "/flush_cache": "empty the prefix cache (when idle)", "/abort_request": "abort a request by rid",
    "/metrics": "Prometheus metrics", "/openapi.json": "this document",
    "/tokenize": "a prompt's token ids", "/v1/tokenize": "a prompt's token ids",
    "/detokenize": "the text of token ids", "/v1/detokenize": "the text of token ids",
    "/separate_reasoning": "a text's reasoning and the rest, split by a reasoning parser",
    "/parse_function_call": "the tool calls in a text, read by a tool-call parser",
    "/open_session": "a session whose turns continue each other (its id)", "/close_session": "end a session",
    "/ping": "pong while the scheduler runs", "/get_load": "requests and KV tokens in the scheduler",
    "/pause_generation": "stop stepping (abort, retract or keep the requests)",
    "/continue_generation": "step again after a pause",
    "/start_profile": "record the scheduler's steps with torch.profiler", "/stop_profile": "write the trace",
    "/configure_logging": "change request logging while serving",
    "/clear_hicache_storage_backend": "remove every page of the hierarchical cache's storage backend",
    "/start_expert_distribution_record": "record which experts a MoE model's routers choose",
    "/stop_expert_distribution_record": "stop recording the expert distribution",
    "/dump_expert_distribution_record": "write the recorded expert distribution to a file, and return its counts",
    "/update_weights_from_disk": "serve another checkpoint of the same model",
    "/get_weights_by_name": "the first values of a parameter",
    "/update_weight_version": "label the served weights",
    "/release_memory_occupation": "drop the KV cache and weights of an idle server (--enable-memory-saver)",
    "/resume_memory_occupation": "restore what was dropped",
    "/load_lora_adapter": "load a PEFT adapter (--enable-lora)", "/unload_lora_adapter": "unload an adapter",
    "/v1/score": "label tokens' probabilities after a query and each item",
    "/v1/rerank": "documents by relevance to a query (an embedding server)",
    "/v1/embeddings": "OpenAI's embeddings (an embedding server)", "/encode": "SGLang's embeddings (an embedding server)",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_document(routes: list[Route], context: ServerContext) -> dict[str, Any]:
    requests = [r for r, _, _ in BODIES.values() if r is not None]
    responses = [r for _, r, _ in BODIES.values() if r is not None] + [protocol.ErrorResponse]
    _, schemas = models_json_schema([(m, "validation") for m in requests] + [(m, "serialization") for m in responses],
                                    ref_template="#/components/schemas/{model}")
    error = {"description": "an error (OpenAI's error object)", "content": {"application/json": {
        "schema": _ref(protocol.ErrorResponse)}}}
    paths: dict[str, Any] = {}
    for route in routes:
        path = route.path.replace("{model:path}", "{model}")
        request, response, streams = BODIES.get(path, (None, None, False))
        for method in sorted(m for m in (route.methods or ()) if m != "HEAD"):
            success: dict[str, Any] = {"description": "success"}
            content: dict[str, Any] = {}
            if method == "DELETE":
                content["application/json"] = {"schema": {"type": "object"}}
            elif response is not None:
                body = _ref(response)
                if path in ONE_OR_LIST_ROUTES:
                    body = {"anyOf": [body, {"type": "array", "items": body}]}
                elif path in LIST_ROUTES:
                    body = {"type": "array", "items": body}
                content["application/json"] = {"schema": body}
            elif path in STRING_ROUTES:
                content["application/json"] = {"schema": {"type": "string"}}
            elif path in NUMBER_LIST_ROUTES:
                content["application/json"] = {"schema": {"type": "array", "items": {"type": "number"}}}
            elif path in TEXT_ROUTES:
                content["text/plain"] = {"schema": {"type": "string"}}
            elif method == "GET" and path.startswith("/get_"):
                content["application/json"] = {"schema": {"type": "object"}}
            if streams:   # each event's data is a JSON chunk, then [DONE]
                content["text/event-stream"] = {"schema": {"type": "object", "properties": {
                    "data": {"type": "string"}}, "required": ["data"]}}
            if content:
                success["content"] = content
            operation: dict[str, Any] = {"summary": SUMMARIES.get(path, path),
                                         "responses": {"200": success, "default": error}}
            if "{model}" in path:
                operation["parameters"] = [{"name": "model", "in": "path", "required": True,
                                            "schema": {"type": "string", "enum": [context.model_name]}}]
            if "{response_id}" in path:
                operation["parameters"] = [{"name": "response_id", "in": "path", "required": True,
                                            "schema": {"type": "string"}}]
            if request is not None and method != "GET":
                operation["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": _ref(request)}}}
            if context.args.api_key and path not in APIKeyMiddleware.OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
            paths.setdefault(path, {})[method.lower()] = operation
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "srv", "version": context.version or "0", "description":
                 f"OpenAI-compatible and SGLang-native API serving {context.model_name}"},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }
    if context.args.api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def openapi_route(routes: list[Route], context: ServerContext) -> Route:
    cached: list[dict[str, Any]] = []

    async def openapi(request: Request) -> Response:
        if not cached:
            cached.append(openapi_document(routes + [Route("/openapi.json", openapi, methods=["GET"])], context))
        return JSONResponse(cached[0])

    return Route("/openapi.json", openapi, methods=["GET"])
