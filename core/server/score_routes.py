"""Scoring routes: SGLang's /v1/score (the probabilities of label tokens after a query and an
item, on a generation model) and /v1/rerank (documents ordered by relevance to a query: a
cross-encoder's score of each (query, document) pair, or on an embedding model the cosine of
their embeddings).

Each item of /v1/score runs as a request of its own whose one output position reports the
labels' log-probabilities (`token_ids_logprob`); items after a shared query find it in the
prefix cache. With --multi-item-scoring-delimiter, each item is scored as SGLang's multi-item
sequence scores it, `query<d>item<d>`, the delimiter token d closing the query and the item;
SGLang packs all items into one sequence whose attention mask keeps each item to the query and
itself, which is the same arithmetic as these separate requests sharing the query's KV.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from srv.server.app import APIError, ServerContext, checked, read_body, until_done
from srv.server.protocol import RerankRequest, ScoreRequest


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = sum(weights)
    return [w / total for w in weights]


class ScoreRoutes:
    def __init__(self, context: ServerContext) -> None:
        self.context = context

    async def _token_ids(self, value: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(value, list):
            return value
        return await self.context.frontend.tokenize(value, None, add_special_tokens)

    async def _prompts(self, body: ScoreRequest) -> list[tuple[str | None, list[int] | None]]:
        """Each item's prompt, as text or token ids."""
        items = [body.items] if isinstance(body.items, str) else body.items
        texts = isinstance(body.query, str)
        if any(isinstance(item, str) != texts for item in items):
            raise APIError("query and items must both be text or both be token ids", param="items")
        delimiter = self.context.args.multi_item_scoring_delimiter
        if delimiter is not None:
            if body.item_first:
                raise APIError("multi-item scoring (--multi-item-scoring-delimiter) puts the query first",
                               param="item_first")
            query = await self._token_ids(body.query, True)
            return [(None, query + [delimiter] + await self._token_ids(item, False) + [delimiter]) for item in items]
        if texts:
            return [((item + body.query) if body.item_first else (body.query + item), None) for item in items]
        return [(None, (item + body.query) if body.item_first else (body.query + item)) for item in items]

    async def score(self, request: Request) -> Response:
        body = await read_body(request, ScoreRequest, self.context)
        self.context.log.request("/v1/score", body)
        if not self.context.model_info.get("is_generation", True):
            raise APIError("scoring reads a generation model's next-token probabilities: this server embeds "
                           "(/v1/rerank ranks by embeddings)")
        prompts = await self._prompts(body)
        params = {"max_new_tokens": 1, "temperature": 0, "token_ids_logprob": body.label_token_ids}
        frontend = self.context.frontend
        groups = await frontend.submit([text for text, _ in prompts], [ids for _, ids in prompts],
                                       [params] * len(prompts), labels=self.context.labels(request))
        await until_done(request, frontend.wait(groups))
        states = [checked(state) for [state] in groups]
        scores = []
        for state in states:
            logprobs = state.token_ids_logprobs[0]
            scores.append(softmax(logprobs) if body.apply_softmax else [math.exp(lp) for lp in logprobs])
        tokens = sum(len(state.prompt_ids) for state in states)
        return JSONResponse({"object": "scoring", "scores": scores, "model": self.context.model_name,
                             "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}})

    async def rerank(self, request: Request) -> Response:
        body = await read_body(request, RerankRequest, self.context)
        self.context.log.request("/v1/rerank", body)
        frontend = self.context.frontend
        if not frontend.limits.embedding:
            raise APIError("reranking needs a cross-encoder or an embedding model (an encoder, or --is-embedding)")
        labels = self.context.labels(request)
        if self.context.model_info.get("is_cross_encoder"):
            pairs = [(body.query, document) for document in body.documents]
            states = [checked(s) for s in await until_done(request, frontend.embed_pairs(pairs, labels))]
            scores = [state.embedding[0] for state in states]
        else:
            texts = [body.query, *body.documents]
            everything = await until_done(request, frontend.embed(texts, [None] * len(texts), labels))
            query, *documents = [checked(state).embedding for state in everything]
            states = everything[1:]
            scores = [cosine(query, vector) for vector in documents]
        results: list[dict[str, Any]] = []
        for index, (text, score, state) in enumerate(zip(body.documents, scores, states)):
            result: dict[str, Any] = {"score": score, "index": index,
                                      "meta_info": {"id": state.rid, "prompt_tokens": len(state.prompt_ids)}}
            if body.return_documents:
                result["document"] = text
            results.append(result)
        results.sort(key=lambda r: -r["score"])
        return JSONResponse(results[:body.top_n] if body.top_n else results)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def score_routes(context: ServerContext) -> list[Route]:
    routes = ScoreRoutes(context)
    return [Route("/v1/score", routes.score, methods=["POST"]),
            Route("/v1/rerank", routes.rerank, methods=["POST"])]
