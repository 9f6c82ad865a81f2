"""The front end of the engine: tokenize and check requests, send them to the scheduler loop,
and turn its outputs into per-request state (incrementally detokenized).

It runs on an asyncio event loop and talks to the scheduler through `send(message)`; whoever
receives the scheduler's outputs calls `dispatch` on that loop. `srv.Engine` wires it to a
scheduler thread, the HTTP server to a scheduler process over ZMQ. Tokenizing and other work
that grows with the size of a request runs in a worker thread (or the tokenizer processes of
--tokenizer-worker-num), never on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, TypeVar

from srv.engine.batch_tokenizer import DynamicBatchTokenizer, encode_batch
from srv.engine.grammar import GrammarCompiler
from srv.engine.io import AbortRequest, ControlRequest, ControlResult, GenerateRequest, RequestOutput
from srv.engine.limits import RequestLimits
from srv.engine.lora import parse_lora_paths
from srv.engine.errors import InvalidRequest
from srv.engine.params import SamplingParamsInput, choice_seed, make_sampling_params, max_new_tokens_given
from srv.engine.request_state import RequestState
from srv.engine.sessions import Sessions, SessionParams
from srv.engine.tokenizer import TokenizerPool
from srv.sdk.sampling import SamplingParams

T = TypeVar("T")
RawParams = dict[str, Any] | SamplingParamsInput | None


def _one_choice(raw: RawParams) -> RawParams:
    """`raw`, if it asks for one choice (`Frontend.stream` follows one request)."""
    if isinstance(raw, SamplingParamsInput):
        n = raw.n
    else:
        n = raw.get("n") if isinstance(raw, dict) else None
    if n not in (None, 1):
        raise InvalidRequest("streaming one request takes n = 1", "n")
    return raw


# An embedding computes its prompt and generates nothing.
EMBEDDING_PARAMS = SamplingParams(max_new_tokens=0)


class QueueFull(Exception):
    """--max-queued-requests requests are already waiting to start."""


class EngineDead(Exception):
    """The scheduler stopped; no request can be served."""


def check_text(text: str, what: str = "the prompt") -> str:
    """`text` if it can be encoded (JSON's \\ud800 escapes give lone surrogates, which no
    tokenizer takes), else InvalidRequest."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{what} is not valid Unicode: {exc.reason} at position {exc.start}") from None
    return text


def checked_prompt(prompt: Any) -> str:
    """A text prompt as a tokenizer takes it, else InvalidRequest."""
    if not isinstance(prompt, str):
        raise InvalidRequest("the prompt must be a string")
    return check_text(prompt)


class Frontend:
    def __init__(self, send: Callable[[Any], None], tokenizer: Any | None, server_args: Namespace,
                 limits: RequestLimits, model_dir: str, grammars: GrammarCompiler | None = None) -> None:
        self.send, self.tokenizer, self.args, self.limits = send, tokenizer, server_args, limits
        # Compiles each request's grammar before it is queued, so an invalid one is the caller's error.
        self.grammars = grammars
        self._tokenizer_pool = (TokenizerPool(server_args, model_dir, server_args.tokenizer_worker_num)
                                if tokenizer is not None and server_args.tokenizer_worker_num > 1 else None)
        # One thread for the front end's CPU work (tokenizing, chat templates): a 5 MB prompt
        # takes seconds to tokenize, and the event loop must answer /health meanwhile.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="srv-frontend-worker")
        self._batcher = (DynamicBatchTokenizer(tokenizer, server_args.dynamic_batch_tokenizer_batch_size,
                                               server_args.dynamic_batch_tokenizer_batch_timeout, self.off_loop)
                         if tokenizer is not None and server_args.enable_dynamic_batch_tokenizer else None)
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._not_started: set[str] = set()
        self.sessions = Sessions()
        self.lora_names = [name for name, _ in parse_lora_paths(server_args.lora_paths)]
        self.dead: str | None = None
        # Called with (state, output) after every update: the server's metrics, logs and traces.
        self.observers: list[Callable[[RequestState, RequestOutput], None]] = []

    @property
    def context_len(self) -> int:
        return self.limits.context_len

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` in the front end's worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, function, *args)

    # ---- from the scheduler -------------------------------------------------------------------

    def dispatch(self, out: RequestOutput | ControlResult) -> None:
        if isinstance(out, ControlResult):
            future = self._calls.pop(out.call_id, None)
            if future is not None and not future.done():
                if out.error is not None:
                    future.set_exception(InvalidRequest(out.error))
                else:
                    future.set_result(out.value)
            return
        self._not_started.discard(out.rid)
        queue = self._queues.get(out.rid)
        if queue is not None:
            queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """The scheduler is gone: every waiting caller gets an error instead of hanging."""
        self.dead = reason
        for rid, queue in self._queues.items():
            queue.put_nowait(RequestOutput(rid, error=reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        self._calls.clear()

    # ---- requests -------------------------------------------------------------------------------

    async def tokenize(self, prompt: str | None, input_ids: list[int] | None,
                       add_special_tokens: bool = True) -> list[int]:
        if input_ids is not None:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in input_ids):
                raise InvalidRequest("input_ids must be a list of integers", "input_ids")
            return input_ids
        if prompt is None:
            raise InvalidRequest("give a prompt or input_ids")
        if self.tokenizer is None:
            raise InvalidRequest("the tokenizer is skipped (--skip-tokenizer-init): send input_ids")
        checked_prompt(prompt)
        try:
            if self._tokenizer_pool is not None and add_special_tokens:
                return await self._tokenizer_pool.encode(prompt)
            if self._batcher is not None:
                return await self._batcher.encode(prompt, add_special_tokens)
            return await self.off_loop(lambda: self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError) as exc:   # what tokenizers raise on text they cannot take
            raise InvalidRequest(f"the prompt could not be tokenized: {exc}") from None

    async def tokenize_together(self, prompts: list[str | None],
                                input_ids: list[list[int] | None]) -> list[list[int] | None]:
        """--enable-tokenizer-batch-encode: the ids of a call's text prompts, encoded in one
        tokenizer call where it has several (given ids are kept; a text is checked as `tokenize`
        checks it)."""
        texts = [i for i, (p, ids) in enumerate(zip(prompts, input_ids)) if ids is None and p is not None]
        if len(texts) < 2 or self.tokenizer is None or not self.args.enable_tokenizer_batch_encode:
            return input_ids
        for i in texts:
            checked_prompt(prompts[i])
        try:
            encoded = await self.off_loop(lambda: encode_batch(self.tokenizer, [prompts[i] for i in texts]))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the prompts could not be tokenized: {exc}") from None
        together = list(input_ids)
        for i, ids in zip(texts, encoded):
            together[i] = ids
        return together

    async def check_logit_processor(self, text: str) -> None:
        if not self.args.enable_custom_logit_processor:
            raise InvalidRequest("custom logit processors are code: the server runs them only with "
                                 "--enable-custom-logit-processor", "custom_logit_processor")
        from srv.sdk.logit_processor import CustomLogitProcessor

        try:
            await self.off_loop(CustomLogitProcessor.from_str, text)
        except Exception as exc:
            raise InvalidRequest(f"the custom logit processor could not be loaded: {type(exc).__name__}: {exc}",
                                 "custom_logit_processor") from None

    async def check_grammar(self, params: SamplingParams) -> None:
        spec = params.grammar
        if spec is None:
            return
        if self.grammars is None:
            raise InvalidRequest("constrained decoding needs the tokenizer (--skip-tokenizer-init is set)")
        await asyncio.to_thread(self.grammars.check, spec)

    async def prepare(self, prompt: str | None, input_ids: list[int] | None,
                      raw_params: RawParams) -> tuple[list[int], SamplingParams]:
        """A request's tokens and sampling parameters, checked and fitted to the model's limits."""
        if self.limits.embedding:
            raise InvalidRequest("the served model is an embedding model: it generates no text "
                                 "(use /v1/embeddings or /encode)")
        params = make_sampling_params(raw_params)
        if params.lora_path is not None and params.lora_path not in self.lora_names:
            raise InvalidRequest(f"no LoRA adapter {params.lora_path!r} is loaded (loaded: "
                                 f"{', '.join(self.lora_names) or 'none: launch with --lora-paths'})", "lora_path")
        if params.custom_logit_processor is not None:
            await self.check_logit_processor(params.custom_logit_processor)
        if params.return_hidden_states:
            if not self.args.enable_return_hidden_states:
                raise InvalidRequest("return_hidden_states needs --enable-return-hidden-states", "return_hidden_states")
            if self.args.speculative_algorithm:
                raise InvalidRequest("return_hidden_states is not available with --speculative-algorithm",
                                     "return_hidden_states")
        ids, params = self.limits.fit(await self.tokenize(prompt, input_ids), params,
                                      max_new_tokens_given(raw_params))
        await self.check_grammar(params)
        return ids, params

    def _check_can_submit(self, priority: int | None, count: int = 1) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if priority is not None and not self.args.enable_priority_scheduling:
            raise InvalidRequest("a request priority needs --enable-priority-scheduling", "priority")
        limit = self.args.max_queued_requests
        if limit is not None and len(self._not_started) + count > limit:
            raise QueueFull(f"{len(self._not_started)} requests are queued and this one adds {count} "
                            f"(--max-queued-requests {limit})")

    def _check_dp_rank(self, dp_rank: int | None) -> None:
        groups = self.args.data_parallel_size
        if dp_rank is not None and not 0 <= dp_rank < groups:
            raise InvalidRequest(f"data-parallel rank {dp_rank} does not exist: the server runs {groups} "
                                 f"data-parallel group{'s' if groups > 1 else ''} (ranks 0 to {groups - 1})",
                                 "routed_dp_rank")

    def _submit(self, input_ids: list[int], params: SamplingParams, priority: int | None,
                rid: str | None = None, labels: dict[str, str] | None = None,
                session: SessionParams | None = None, token_type_ids: list[int] | None = None,
                dp_rank: int | None = None) -> RequestState:
        if rid is not None and rid in self._queues:
            raise InvalidRequest(f"a request with rid {rid!r} is already running", "rid")
        state = RequestState(rid or uuid.uuid4().hex, input_ids, params, self.tokenizer, labels)
        state.session = session
        self._queues[state.rid] = asyncio.Queue()
        self._not_started.add(state.rid)
        try:
            self.send(GenerateRequest(state.rid, input_ids, params, priority or 0, session.id if session else None,
                                      token_type_ids, dp_rank))
        except InvalidRequest:   # the data-parallel router's: a rank other than the session's
            del self._queues[state.rid]
            self._not_started.discard(state.rid)
            raise
        return state

    async def _follow(self, state: RequestState, interval: int = 1) -> AsyncIterator[RequestState]:
        """Yield `state` as outputs arrive (every `interval` tokens, and at the end); abort the
        request if the caller stops listening first."""
        queue = self._queues.get(state.rid)
        if queue is None:   # released before anyone listened
            return
        pending = 0
        try:
            while not state.finished:
                out = await queue.get()
                state.update(out)
                for observer in self.observers:
                    observer(state, out)
                pending += len(out.new_ids)
                if state.finished or pending >= interval:
                    pending = 0
                    yield state
        finally:
            if state.session is not None and state.finished and state.error is None \
                    and state.finish_reason != "abort":
                self.sessions.record(state.session, state.rid, state.prompt_ids, state.output_ids)
            self._drop(state)

    def _drop(self, state: RequestState) -> None:
        """Stop following a request, aborting it if it has not ended (idempotent)."""
        if self._queues.pop(state.rid, None) is None:
            return
        self._not_started.discard(state.rid)
        if not state.finished and self.dead is None:
            self.send(AbortRequest(state.rid))

    def release(self, groups: list[list[RequestState]]) -> None:
        """The caller of `submit` is gone: abort whatever of its requests has not ended."""
        for group in groups:
            for state in group:
                self._drop(state)

    async def submit(self, prompts: list[str | None], input_ids: list[list[int] | None],
                     raw_params: list[RawParams], priority: int | None = None,
                     labels: dict[str, str] | None = None, rid: str | None = None,
                     session: SessionParams | None = None, dp_rank: int | None = None) -> list[list[RequestState]]:
        """Queue every prompt, n choices each; returns their states as they start. Each choice
        is a request of its own, with a seed of its own when the prompt has one (the choices are
        independent samples, the same again for the same seed). The prompt of an n > 1 request is
        prefilled once first, so its choices find it in the prefix cache. Either every request of
        the call is queued or none is; the caller follows them (`follow`) or `release`s them.
        With `session`, the one prompt is a turn of that session (srv.engine.sessions); with
        `dp_rank`, every request goes to that data-parallel group."""
        self._check_dp_rank(dp_rank)
        input_ids = await self.tokenize_together(prompts, input_ids)
        if session is not None:
            if len(prompts) != 1:
                raise InvalidRequest("a session's turn is one prompt", "session_params")
            new_ids = await self.tokenize(prompts[0], input_ids[0])
            prompts, input_ids = [None], [self.sessions.prompt(session, new_ids)]
        prepared = [await self.prepare(p, i, r) for p, i, r in zip(prompts, input_ids, raw_params)]
        if session is not None and prepared[0][1].n != 1:
            raise InvalidRequest("a session's turn takes n = 1", "n")
        choices = sum(params.n for _, params in prepared)
        self._check_can_submit(priority, choices + sum(params.n > 1 and params.logprob_start_len < 0
                                                       for _, params in prepared))
        # (Not when the choices want the prompt's log-probabilities: each computes its prompt.)
        warmups = [self._submit(ids, replace(params, max_new_tokens=0, n=1), priority, labels=labels, dp_rank=dp_rank)
                   for ids, params in prepared if params.n > 1 and params.logprob_start_len < 0]
        await asyncio.gather(*(self._finish(warmup) for warmup in warmups))
        groups, index = [], 0
        for ids, params in prepared:
            group = []
            for i in range(params.n):
                own_rid = rid if rid is None or choices == 1 else f"{rid}_{index}"
                group.append(self._submit(ids, replace(params, n=1, seed=choice_seed(params.seed, i)), priority,
                                          own_rid, labels, session, dp_rank=dp_rank))
                index += 1
            groups.append(group)
        return groups

    async def embed(self, prompts: list[str | None], input_ids: list[list[int] | None],
                    labels: dict[str, str] | None = None) -> list[RequestState]:
        """Each prompt's embedding (`state.embedding`), on an embedding server: the prompts are
        tokenized with the model's special tokens and checked as generation prompts are; either
        all are queued or none is."""
        if not self.limits.embedding:
            raise InvalidRequest("the served model generates text: embeddings need an embedding model "
                                 "(an encoder, or --is-embedding)")
        input_ids = await self.tokenize_together(prompts, input_ids)
        prepared = [(await self.tokenize(prompt, ids), None) for prompt, ids in zip(prompts, input_ids)]
        return await self._embed_prepared(prepared, labels)

    async def embed_pairs(self, pairs: list[tuple[str, str]], labels: dict[str, str] | None = None) -> list[RequestState]:
        """A cross-encoder's score of each (query, document) pair, tokenized as the tokenizer
        joins a pair (its separators, and the second text in segment 1)."""
        if not self.limits.embedding or self.tokenizer is None:
            raise InvalidRequest("scoring text pairs needs a cross-encoder and its tokenizer")
        for query, document in pairs:
            check_text(query, "the query")
            check_text(document, "a document")

        def encode(pair: tuple[str, str]) -> tuple[list[int], list[int] | None]:
            encoded = self.tokenizer(*pair)
            return encoded["input_ids"], encoded.get("token_type_ids")

        prepared = [await self.off_loop(encode, pair) for pair in pairs]
        return await self._embed_prepared(prepared, labels)

    async def _embed_prepared(self, prepared: list[tuple[list[int], list[int] | None]],
                              labels: dict[str, str] | None) -> list[RequestState]:
        fitted = []
        for ids, types in prepared:
            kept = self.limits.fit(ids, EMBEDDING_PARAMS, True)[0]
            fitted.append((kept, types[len(types) - len(kept):] if types else None))   # cut alike

        self._check_can_submit(None, len(fitted))
        states = [self._submit(ids, EMBEDDING_PARAMS, None, labels=labels, token_type_ids=types)
                  for ids, types in fitted]
        return [state for [state] in await self.wait([[state] for state in states])]

    async def probe(self) -> RequestState:
        """One request through the whole path (warm-up, health checks): a token of token id 0,
        or on an embedding server its embedding."""
        if self.limits.embedding:
            [state] = await self.embed([None], [[0]])
            return state
        [[state]] = await self.generate([None], [[0]], [{"max_new_tokens": 1, "temperature": 0}])
        return state

    async def follow(self, groups: list[list[RequestState]], interval: int = 1) -> AsyncIterator[tuple[int, RequestState]]:
        """(choice index, state) as each choice of `submit`'s groups advances (every `interval`
        tokens, and at its end), in the order updates arrive; a state may come again unchanged.
        Closing the iterator aborts the choices that have not ended."""
        states = [state for group in groups for state in group]
        updates: asyncio.Queue[tuple[int, RequestState | None]] = asyncio.Queue()

        async def pump(index: int, state: RequestState) -> None:
            try:
                async for update in self._follow(state, interval):
                    updates.put_nowait((index, update))
            finally:
                updates.put_nowait((index, None))

        tasks = [asyncio.ensure_future(pump(i, state)) for i, state in enumerate(states)]
        try:
            running = len(tasks)
            while running:
                index, state = await updates.get()
                if state is None:
                    running -= 1
                else:
                    yield index, state
        finally:
            for task in tasks:
                task.cancel()
            self.release(groups)

    async def stream(self, prompt: str | None, input_ids: list[int] | None, raw_params: RawParams,
                     priority: int | None = None, interval: int = 1, rid: str | None = None,
                     labels: dict[str, str] | None = None, session: SessionParams | None = None,
                     dp_rank: int | None = None) -> AsyncIterator[RequestState]:
        """One request (n = 1), its state after each update. Checks run before the first yield."""
        [[state]] = await self.submit([prompt], [input_ids], [_one_choice(raw_params)], priority, labels, rid,
                                      session, dp_rank)
        return self._follow(state, interval)

    async def generate(self, prompts: list[str | None], input_ids: list[list[int] | None],
                       raw_params: list[RawParams], priority: int | None = None,
                       labels: dict[str, str] | None = None) -> list[list[RequestState]]:
        """Every prompt, n choices each (see `submit`), run to the end."""
        return await self.wait(await self.submit(prompts, input_ids, raw_params, priority, labels))

    async def wait(self, groups: list[list[RequestState]]) -> list[list[RequestState]]:
        """`submit`'s groups once every choice has ended. One gather for all: cancelling the
        wait (its client left) aborts every request of the call."""
        try:
            await asyncio.gather(*(self._finish(state) for group in groups for state in group))
        finally:
            self.release(groups)
        return groups

    async def _finish(self, state: RequestState) -> RequestState:
        async for _ in self._follow(state):
            pass
        return state

    def abort(self, rid: str) -> None:
        self.send(AbortRequest(rid))

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        self.lora_names = await self.control("load_lora_adapter", lora_name=name, lora_path=path)
        return self.lora_names

    async def unload_lora_adapter(self, name: str) -> list[str]:
        self.lora_names = await self.control("unload_lora_adapter", lora_name=name)
        return self.lora_names

    def open_session(self, capacity: int, session_id: str | None = None) -> str:
        return self.sessions.open(capacity, session_id)

    async def close_session(self, session_id: str) -> None:
        """Forget the session's turns and let the scheduler's prefix cache evict their KV."""
        self.sessions.close(session_id)
        await self.control("close_session", session_id=session_id)

    def abort_all(self) -> int:
        """Abort every request the front end follows; returns how many."""
        rids = list(self._queues)
        for rid in rids:
            self.send(AbortRequest(rid))
        return len(rids)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.close()

    async def control(self, method: str, **args: Any) -> Any:
        if self.dead is not None:
            raise EngineDead(self.dead)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self.send(ControlRequest(call_id, method, args))
        return await future
