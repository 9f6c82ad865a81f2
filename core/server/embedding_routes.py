"""The embedding routes of an embedding server: OpenAI's /v1/embeddings and SGLang's /encode.

Each prompt runs as a request of its own through the scheduler (so a batch shares forward
passes with other callers' prompts); the vectors come back pooled and, as the model's pooling
says, normalized (srv.engine.pooling).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from srv.engine.request_state import RequestState
from srv.server.app import APIError, ServerContext, checked, read_body, until_done
from srv.server.protocol import EmbeddingRequest, EncodeRequest


def split_inputs(value: Any) -> tuple[bool, list[str | None], list[list[int] | None]]:
    """(whether it is a list, the texts, the token ids) of an input that is a text, token ids,
    or a list of either."""
    if isinstance(value, str):
        return False, [value], [None]
    if all(isinstance(v, int) for v in value):
        return False, [None], [list(value)]
    return True, [v if isinstance(v, str) else None for v in value], [v if isinstance(v, list) else None for v in value]


class EmbeddingRoutes:
    def __init__(self, context: ServerContext) -> None:
        self.context = context

    async def _embed(self, request: Request, texts: list[str | None], ids: list[list[int] | None]) -> list[RequestState]:
        frontend = self.context.frontend
        states = await until_done(request, frontend.embed(texts, ids, self.context.labels(request)))
        return [checked(state) for state in states]

    def _dimensions(self, wanted: int | None) -> int | None:
        """How many leading dimensions to keep (None: all), if the model allows it."""
        info = self.context.model_info
        full = info.get("hidden_size")
        if wanted is None or wanted == full:
            return None
        allowed = info.get("matryoshka_dimensions")
        if not allowed:
            raise APIError(f"the model does not support dimensions other than its own ({full}): it is not a "
                           "Matryoshka model", param="dimensions")
        if full is not None and wanted > full:
            raise APIError(f"dimensions {wanted} is more than the model's {full}", param="dimensions")
        if isinstance(allowed, list) and wanted not in allowed:
            raise APIError(f"dimensions {wanted} is not one the model was trained for ({allowed})", param="dimensions")
        return wanted

    @staticmethod
    def _truncated(vector: list[float], dimensions: int | None) -> list[float]:
        """The first `dimensions` of a normalized vector, normalized again (as sentence-transformers'
        truncate_dim followed by normalization gives)."""
        if dimensions is None:
            return vector
        head = vector[:dimensions]
        norm = math.sqrt(sum(x * x for x in head)) or 1.0
        return [x / norm for x in head]

    async def embeddings(self, request: Request) -> Response:
        body = await read_body(request, EmbeddingRequest, self.context)
        self.context.log.request("/v1/embeddings", body)
        dimensions = self._dimensions(body.dimensions)
        _, texts, ids = split_inputs(body.input)
        states = await self._embed(request, texts, ids)
        data = []
        for index, state in enumerate(states):
            vector = self._truncated(state.embedding, dimensions)
            if body.encoding_format == "base64":
                data.append({"object": "embedding", "index": index,
                             "embedding": base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()})
            else:
                data.append({"object": "embedding", "index": index, "embedding": vector})
        tokens = sum(len(state.prompt_ids) for state in states)
        response = {"object": "list", "data": data, "model": self.context.model_name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        self.context.log.response("/v1/embeddings", {"usage": response["usage"]})
        return JSONResponse(response)

    async def encode(self, request: Request) -> Response:
        body = await read_body(request, EncodeRequest, self.context)
        self.context.log.request("/encode", body)
        if (body.text is None) == (body.input_ids is None):
            raise APIError("give text or input_ids (one of them)", param="input_ids" if body.text else "text")
        batched, texts, ids = split_inputs(body.text if body.text is not None else body.input_ids)
        states = await self._embed(request, texts, ids)
        results = [state.embedding_result() for state in states]
        return JSONResponse(results if batched else results[0])


def embedding_routes(context: ServerContext) -> list[Route]:
    routes = EmbeddingRoutes(context)
    return [Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
            Route("/encode", routes.encode, methods=["POST"])]
