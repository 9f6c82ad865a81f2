"""The scheduler loop: admit waiting requests (chunked prefill), continue running ones (continuous
batching), retract one when KV memory runs out, and turn sampled tokens into finished requests.

Every step feeds each scheduled request the tokens `token_ids[kv_len : kv_len + extend]`: a
prompt chunk for a prefill, the last sampled token for a decode. A request samples a token
only in the step whose input reaches the end of everything it knows.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from argparse import Namespace
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from srv.backend_registry import BackendRegistry
from srv.engine.detokenizer import IncrementalDetokenizer
from srv.engine.grammar import GrammarCompiler
from srv.engine.limits import RequestLimits
from srv.engine.memory import OutOfKVMemory, PagedSlotAllocator, ReqToTokenPool
from srv.engine.model_runner import ModelRunner
from srv.engine.hicache import make_prefix_cache
from srv.engine.request import FinishReason, Req
from srv.engine.speculative import common_prefix_len, make_worker
from srv.engine.worker import BatchResult, ScheduledReq, reportable
from srv.sdk.grammar import GrammarError
from srv.sdk.sampling import SampleOutput

logger = logging.getLogger("srv.scheduler")

# On CPU prefill is compute-bound, and a long chunk stalls every running decode and delays every
# first token of its batch until the whole chunk is done. In `make bench` (16 streams, 128-token
# prompts) 512 rather than 2048 halved TTFT p50 (1.86 to 0.92 s; 2.32 to 1.58 s with a shared
# 512-token prefix) for 6-8% less throughput (see BENCHMARKS.md).
DEFAULT_CPU_CHUNKED_PREFILL_SIZE = 512
DEFAULT_MAX_RUNNING_REQUESTS = 256
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# A waiting request whose prompt shares at least this many not-yet-cached tokens with a request
# being prefilled waits for that prefill (as SGLang's in-batch prefix caching check).
IN_BATCH_PREFIX_MIN_TOKENS = 32
# Admission counts at most this many of a request's future tokens as its KV need (SGLang's clip of
# max_new_tokens): most requests stop long before a large max_tokens, and retraction covers the rest.
CLIP_MAX_NEW_TOKENS = 4096
# A waiting request that does not fit lets the ones behind it start for this long; then
# admission waits for it (running requests end, and it fits), so it is never starved either.
MAX_SKIP_S = 5.0
# With nothing to run but requests whose prompt pages are still being read from storage, the
# loop waits this long for a read to complete before it looks for new requests again.
PREFETCH_POLL_S = 0.01
# A pause in the traffic: no step has run for PAUSE_S. The work kept out of the first requests'
# way runs in pauses: the tokenizer's background load (`load_tokenizer_when_idle`; at the latest
# TOKENIZER_LATEST_S after it was asked for), and the model's deferred one-time work
# (ModelRunner.prepare_when_idle) in stretches of at most PREPARE_STRETCH_S, so that a request
# arriving meanwhile waits little.
PAUSE_S = 0.5
TOKENIZER_LATEST_S = 5.0
PREPARE_STRETCH_S = 0.02


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    forward_steps: int = 0
    decode_steps: int = 0
    # Speculative decoding: requests verified, drafts proposed to them, and tokens they gained
    # (accepted drafts plus the target's own token): SGLang's accept length is their ratio.
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def record_verify(self, drafts: int, appended: int) -> None:
        self.spec_verifies += 1
        self.spec_draft_tokens += drafts
        self.spec_accepted_tokens += appended

    @property
    def spec_accept_length(self) -> float:
        """Tokens a verified request gained per step (1.0: no draft ever held; 0.0 before any verify)."""
        return self.spec_accepted_tokens / self.spec_verifies if self.spec_verifies else 0.0


def in_background(function: Callable[[], Any]) -> Future[Any]:
    """Run `function()` in a daemon thread; its result or exception lands in the future."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(function())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="srv-background", daemon=True).start()
    return future


class Scheduler:
    def __init__(self, args: Namespace, runner: ModelRunner, registry: BackendRegistry) -> None:
        self.args, self.runner, self.registry = args, runner, registry
        self._tokenizer: Future[Any] | None = None
        self._load_tokenizer: Callable[[], Any] | None = None
        self._tokenizer_due: float | None = None   # the latest time.monotonic() to start loading it
        self._busy_at = time.monotonic()           # when the last step ran a batch
        self._awaiting_tokenizer: list[Req] = []   # requests added while it loads (see add)
        self._preparing = True   # the model may have deferred work for a pause (prepare_when_idle)
        self._started_at = time.monotonic()
        page_size = args.page_size
        capacity = runner.kv_capacity_tokens()
        self.allocator = PagedSlotAllocator(capacity // page_size + 1, page_size)
        runner.allocate_kv_cache(self.allocator.num_slots)
        self.max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        max_context = -(-runner.context_len // page_size) * page_size
        self.req_pool = ReqToTokenPool(self.max_running, max_context)
        # An embedding pools every token of its prompt, so none may come from the prefix cache.
        self.tree = make_prefix_cache(args, runner, self.allocator, registry)
        self.policy = registry.choose("schedule_policy", args.schedule_policy).create(args)
        self.chunk_size = args.chunked_prefill_size or DEFAULT_CPU_CHUNKED_PREFILL_SIZE
        if self.chunk_size <= 0:   # SGLang's -1: chunking off
            self.chunk_size = args.max_prefill_tokens
        # Share of the running requests' remaining output to keep free when admitting more;
        # it decays while decoding goes well and resets on a retraction, as in SGLang.
        self.init_new_token_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness)
        self.min_new_token_ratio = min(self.init_new_token_ratio, MIN_NEW_TOKEN_RATIO * args.schedule_conservativeness)
        self.new_token_ratio = self.init_new_token_ratio
        self.eos_ids = self._eos_ids(runner)
        # SGLang types --crash-on-nan as a string; "true"/"1"/"yes" switch it on.
        self.crash_on_nan = str(args.crash_on_nan).lower() in ("true", "1", "yes")
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        # While set, waiting requests are not admitted (the running ones go on): a weight update
        # waits for the running requests to end.
        self.hold_admission = False
        # Each session's latest turn, locked in the prefix cache until the next turn or the close.
        self.session_nodes: dict[str, Any] = {}
        self.failed: list[Req] = []     # ended by an error since the loop last asked
        self._in_step: list[Req] = []   # what the current step scheduled or is admitting
        self.stats = SchedulerStats()
        self.worker = make_worker(args, runner, registry, self.req_pool, self.eos_ids, self.fail, self.crash_on_nan,
                                  self.stats)

    def set_tokenizer_loader(self, load: Callable[[], Any] | None) -> None:
        """How to load the tokenizer stop strings and grammars need (None under
        --skip-tokenizer-init). Importing transformers takes seconds, so it is not loaded now:
        `start_loading_tokenizer` (or `load_tokenizer_when_idle`) loads it in the background; a
        request that needs it before then waits apart (see `add`)."""
        self._load_tokenizer = load

    def start_loading_tokenizer(self) -> None:
        if self._tokenizer is None and self._load_tokenizer is not None:
            self._tokenizer = in_background(self._load_tokenizer)

    def load_tokenizer_when_idle(self) -> None:
        """Start the tokenizer's background load at the first pause in the traffic (or after
        TOKENIZER_LATEST_S): importing transformers is most of a second of one core's work, which
        would slow the first requests' steps on a machine of few cores."""
        self._tokenizer_due = time.monotonic() + TOKENIZER_LATEST_S

    def _start_tokenizer_if_due(self, idle: bool) -> None:
        now = time.monotonic()
        if not idle:
            self._busy_at = now
        if self._tokenizer_due is not None and (now >= self._tokenizer_due or now - self._busy_at >= PAUSE_S):
            self._tokenizer_due = None
            self.start_loading_tokenizer()

    @property
    def settled(self) -> bool:
        """Whether nothing is left for the pauses: the tokenizer's load started (or none is
        asked for) and the model's deferred work done."""
        return self._tokenizer_due is None and not self._preparing

    @property
    def preparing_now(self) -> bool:
        """Whether the model's deferred work is left and the traffic has paused for it."""
        return self._preparing and not self.has_work and time.monotonic() - self._busy_at >= PAUSE_S

    @property
    def tokenizer(self) -> Any:
        self.start_loading_tokenizer()
        return None if self._tokenizer is None else self._tokenizer.result()

    @functools.cached_property
    def grammars(self) -> GrammarCompiler | None:
        if self.tokenizer is None:
            return None
        return GrammarCompiler(self.args, self.registry, self.tokenizer, self.runner.config.vocab_size, self.eos_ids)

    @staticmethod
    def _eos_ids(runner: ModelRunner) -> list[int]:
        eos = getattr(runner.config, "eos_token_id", None)
        return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def request_limits(self) -> RequestLimits:
        """What one request may ask (the front end holds every request to it before queueing)."""
        return RequestLimits(self.runner.context_len, self.runner.config.vocab_size, self.allocator.capacity_tokens,
                             bool(self.args.allow_auto_truncate), self.runner.is_embedding)

    # ---- requests in and out -------------------------------------------------------------

    def add(self, req: Req) -> None:
        if req.params.lora_path is not None:
            if self.runner.lora is None:
                raise ValueError("LoRA adapters need --enable-lora (or --lora-paths) at launch")
            # Unloaded since the front end checked: refused.
            req.cache_namespace = self.runner.lora.adapter(req.params.lora_path).cache_namespace
        if self._waits_for_tokenizer(req):
            # Its stop strings or grammar need the tokenizer, still loading: the request waits
            # apart while the others step on, and `step` queues it once the tokenizer is there.
            self.start_loading_tokenizer()
            self._awaiting_tokenizer.append(req)
            return
        self._queue(req)

    def _waits_for_tokenizer(self, req: Req) -> bool:
        needs = req.params.grammar is not None or bool(req.params.stop or req.params.stop_regex)
        loaded = self._tokenizer is not None and self._tokenizer.done()
        return needs and self._load_tokenizer is not None and not loaded

    def _queue_awaiting_tokenizer(self) -> None:
        """Queue the requests that waited for the tokenizer, once it is there; one it cannot
        take (a grammar that does not compile, a tokenizer that failed to load) fails alone."""
        if not self._awaiting_tokenizer or not self._tokenizer.done():
            return
        awaiting, self._awaiting_tokenizer = self._awaiting_tokenizer, []
        for req in awaiting:
            try:
                self._queue(req)
            except Exception as exc:
                self.fail(req, str(exc))

    def _queue(self, req: Req) -> None:
        spec = req.params.grammar
        if spec is not None:
            if self.grammars is None:
                raise GrammarError("constrained decoding needs the tokenizer (--skip-tokenizer-init is set)")
            req.grammar = self.grammars.matcher(spec)
        if (req.params.stop or req.params.stop_regex) and self.tokenizer is not None:
            req.stop_matcher = IncrementalDetokenizer.for_request(self.tokenizer, req.params)
        self.waiting.append(req)
        if self._caches(req) and not req.params.return_hidden_states:
            self.tree.prefetch(req.rid, req.cache_keys(req.seq_len - 1))

    def abort(self, rid: str) -> Req | None:
        for queue in (self._awaiting_tokenizer, self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = FinishReason.ABORT
                    self._release(req)
                    return req
        return None

    def fail(self, req: Req, error: str) -> None:
        """End `req` with an error (it ends as ABORT and its KV is freed); the loop reports it."""
        for queue in (self.waiting, self.running):
            if any(r is req for r in queue):
                queue.remove(req)
        req.finish_reason, req.error = FinishReason.ABORT, error
        self._release(req)
        self.failed.append(req)

    def fail_step(self, error: str) -> None:
        """A step raised: fail the requests it had scheduled or was admitting, and keep the rest.
        A failure before any request was in hand (a policy plugin's, say) would recur at every
        step, so it fails the waiting requests."""
        for req in self._in_step or list(self.waiting):
            if not req.finished:
                self.fail(req, error)
        self._in_step = []

    def take_failed(self) -> list[Req]:
        failed, self.failed = self.failed, []
        return failed

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queued(self) -> list[Req]:
        """The requests not running yet: those waiting for the tokenizer, then the waiting queue."""
        return [*self._awaiting_tokenizer, *self.waiting]

    # ---- KV memory -----------------------------------------------------------------------

    def _make_room(self, tokens: int) -> bool:
        if self.allocator.free_tokens < tokens and self.tree is not None:
            self.tree.evict(tokens - self.allocator.free_tokens)
        return self.allocator.free_tokens >= tokens

    def _reserve(self, req: Req, new_len: int) -> None:
        """Give `req` cache slots for its first `new_len` tokens (whole pages)."""
        self._reserve_all([(req, new_len)])

    def _reserve_all(self, wanted: list[tuple[Req, int]]) -> None:
        """Give each (request, length) cache slots for the request's first `length` tokens (whole
        pages): all of them, or none and OutOfKVMemory. Written through the table's NumPy view, a
        request's slots at a time (see ReqToTokenPool.array)."""
        page = self.allocator.page_size
        needs = [(req, pages) for req, new_len in wanted if (pages := -(-new_len // page) - req.allocated // page) > 0]
        total = sum(pages for _, pages in needs)
        if not total:
            return
        if not self._make_room(total * page):
            raise OutOfKVMemory
        pages = self.allocator.allocate_pages(total)
        taken = 0
        for req, count in needs:
            self.req_pool.write(req.row, req.allocated, [p * page + k for p in pages[taken:taken + count]
                                                         for k in range(page)])
            taken += count
            req.allocated += count * page

    def _admit(self, req: Req) -> None:
        """Give a waiting request a table row and its cached prefix."""
        req.row = self.req_pool.allocate()
        req.cached_prefix_len = 0
        if self._caches(req):
            # The last token must be computed to sample from it, so it never comes from the cache;
            # nor may the positions whose logits give prompt log-probabilities still wanted.
            limit = req.seq_len - 1
            wanted = req.next_prompt_logprob
            if wanted is not None:
                limit = min(limit, max(wanted - 1, 0))
            if req.params.return_hidden_states and not req.output_ids:
                limit = 0   # every position's hidden state is computed, none taken from the cache
            slots, node = self.tree.load_prefix(req.cache_keys(limit), req.rid)
            self.tree.lock(node)
            req.cache_node = node
            req.cached_prefix_len = slots.numel()
            self.req_pool.table[req.row, : slots.numel()] = slots
        req.kv_len = req.allocated = req.cached_prefix_len

    def _caches(self, req: Req) -> bool:
        """Whether the request's KV goes to (and comes from) the prefix cache (keyed on its
        `cache_keys`: an adapter's KV is found only under that adapter)."""
        return self.tree is not None

    def _release(self, req: Req) -> None:
        """Return a request's KV: full pages go to the prefix cache, the rest back to the pool."""
        self.worker.release(req)
        if self.tree is not None:
            self.tree.forget(req.rid)
        if req.row is None:
            return
        page = self.allocator.page_size
        slots = self.req_pool.table[req.row, :req.allocated].clone()
        if self._caches(req):
            aligned = req.kv_len // page * page
            already = self.tree.insert(req.cache_keys(aligned), slots[:aligned])
            self.allocator.free_slots(slots[req.cached_prefix_len: already])
            self.allocator.free_slots(slots[aligned:])
            self.tree.unlock(req.cache_node)
            if req.session_id is not None and req.finished:
                self._pin_session(req.session_id, req.cache_keys(aligned))
        else:
            self.allocator.free_slots(slots)
        self.req_pool.free(req.row)
        req.row, req.kv_len, req.allocated, req.cached_prefix_len, req.cache_node = None, 0, 0, 0, None

    def _cache_computed_prefix(self, req: Req) -> None:
        """Put a running request's computed pages in the prefix cache now, not only when it
        ends, so that requests admitted while it runs share them (a common system prompt sent
        by many clients at once is computed once)."""
        aligned = req.kv_len // self.allocator.page_size * self.allocator.page_size
        if aligned <= req.cached_prefix_len:
            return
        slots = self.req_pool.table[req.row, :aligned].clone()
        already = self.tree.insert(req.cache_keys(aligned), slots)
        # Pages another request cached meanwhile: use the cached copies, free ours.
        self.allocator.free_slots(slots[req.cached_prefix_len: already])
        cached, node = self.tree.match_prefix(req.cache_keys(aligned))
        self.req_pool.table[req.row, :aligned] = cached
        self.tree.lock(node)
        self.tree.unlock(req.cache_node)
        req.cache_node, req.cached_prefix_len = node, aligned

    def _retract(self, victim: Req | None = None, why: str = "KV memory full") -> None:
        """Free the KV of a running request (by default the most recent) and queue it again; it
        resumes later from its prompt and output so far (mostly found again in the prefix cache)."""
        victim = victim or max(self.running, key=lambda r: r.arrival_index)
        self.running.remove(victim)
        self._release(victim)
        victim.retractions += 1
        self.stats.retractions += 1
        self.new_token_ratio = self.init_new_token_ratio
        self.waiting.insert(0, victim)
        logger.info("retracted request %s (%s), %d running", victim.rid, why, len(self.running))

    def retract_all(self, why: str) -> None:
        """Retract every running request (its KV to the prefix cache; it resumes later)."""
        while self.running:
            self._retract(why=why)

    def _priority_key(self, req: Req) -> int:
        return req.priority if self.args.schedule_low_priority_values_first else -req.priority

    def _preempt_for(self, req: Req, scheduled: list[Req]) -> bool:
        """With --enable-priority-scheduling, retract the lowest-priority running request (not
        already in this step's batch) when `req` outranks it by more than
        --priority-scheduling-preemption-threshold."""
        candidates = [r for r in self.running if all(r is not s for s in scheduled)]
        if not self.args.enable_priority_scheduling or not candidates:
            return False
        victim = max(candidates, key=lambda r: (self._priority_key(r), r.arrival_index))
        if self._priority_key(victim) - self._priority_key(req) <= self.args.priority_scheduling_preemption_threshold:
            return False
        self._retract(victim, f"preempted by higher-priority request {req.rid}")
        return True

    def _decode_headroom(self) -> int:
        """KV tokens to keep free for the running requests' future output when admitting more:
        their remaining max_new_tokens, scaled by the adaptive new-token ratio."""
        remaining = sum(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) for r in self.running)
        return int(remaining * self.new_token_ratio) + len(self.running) * self.allocator.page_size

    # ---- one step ------------------------------------------------------------------------

    def _schedule_prefill(self) -> list[ScheduledReq]:
        if self.policy.needs_prefix_match and self.tree is not None:
            for req in self.waiting:
                slots, req.prefix_node = self.tree.match_prefix(req.cache_keys(req.seq_len - 1))
                req.cached_prefix_len = slots.numel()
        budget = min(self.args.max_prefill_tokens, self.chunk_size)
        scheduled: list[ScheduledReq] = []
        partial = [r for r in self.running if r.kv_len + 1 < r.seq_len]
        waiting = self.policy.order(self.waiting)
        if self.args.enable_priority_scheduling:
            waiting.sort(key=self._priority_key)
        for req in partial + waiting:
            if budget <= 0:
                break
            self._in_step = [req]
            if self.runner.is_embedding and scheduled and req.seq_len - req.kv_len > budget:
                break   # an embedding runs its prompt whole (one pass): in a step of its own
            if req.row is None:
                if self.hold_admission:
                    break
                if self._shares_uncached_prefix(req, [item.req for item in scheduled]):
                    continue
                if self.tree is not None and not self.tree.prefetch_ready(req.rid):
                    continue   # its prompt's pages are still coming from storage
                if not self._try_admit(req, budget, [item.req for item in scheduled]):
                    if self._may_pass_over(req):
                        continue
                    break
                req.skipped_since = None
            extend = req.seq_len - req.kv_len if self.runner.is_embedding else min(req.seq_len - req.kv_len, budget)
            try:
                self._reserve(req, req.kv_len + extend)
            except OutOfKVMemory:
                break
            scheduled.append(ScheduledReq(req, extend))
            budget -= extend
        return scheduled

    @staticmethod
    def _may_pass_over(req: Req) -> bool:
        """Whether requests behind `req`, which does not fit now, may start before it."""
        now = time.monotonic()
        if req.skipped_since is None:
            req.skipped_since = now
        return now - req.skipped_since < MAX_SKIP_S

    def _shares_uncached_prefix(self, req: Req, scheduled: list[Req]) -> bool:
        """Whether `req` starts with a long prefix that a request in this step is computing:
        it waits one step and finds that prefix in the cache instead of computing it again."""
        if self.tree is None or not scheduled:
            return False
        tokens = req.token_ids
        shared = max((common_prefix_len(tokens, other.token_ids) for other in scheduled
                      if other.cache_namespace == req.cache_namespace), default=0)
        if shared < IN_BATCH_PREFIX_MIN_TOKENS:
            return False
        cached, _ = self.tree.match_prefix(req.cache_keys(req.seq_len - 1))
        return shared - cached.numel() >= IN_BATCH_PREFIX_MIN_TOKENS

    def _try_admit(self, req: Req, budget: int, scheduled: list[Req]) -> bool:
        """Admit a waiting request if a row and KV memory for its next chunk (plus the running
        requests' headroom) are available, preempting lower-priority work where allowed. A LoRA
        request waits while the running requests use --max-loras-per-batch other adapters."""
        lora, adapter = self.runner.lora, req.params.lora_path
        if lora is not None and adapter is not None:
            running = {r.params.lora_path for r in self.running if r.params.lora_path is not None}
            if adapter not in running and len(running) >= lora.capacity:
                return False
        while True:
            if len(self.running) < self.max_running and self.req_pool.free_rows:
                self._admit(req)
                extend = min(req.seq_len - req.kv_len, budget)
                own_output = int(self.new_token_ratio * min(req.max_new_tokens - len(req.output_ids),
                                                            CLIP_MAX_NEW_TOKENS))
                if self._make_room(extend + own_output + self._decode_headroom()):
                    break
                self._release(req)
            if not self._preempt_for(req, scheduled):
                return False
        self.waiting.remove(req)
        self.running.append(req)
        self.stats.prompt_tokens += req.prompt_len
        req.cached_tokens += req.cached_prefix_len
        self.stats.cached_prompt_tokens += req.cached_prefix_len
        return True

    def _schedule_decode(self) -> list[ScheduledReq]:
        """Every running request whose prompt is in the cache, with KV slots for its next token
        and the drafts the worker may give it; short of memory, drafts go first, then requests
        are retracted."""
        decoding = self._in_step = [r for r in self.running if r.kv_len + 1 == r.seq_len]
        if decoding:
            self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        budgets = {id(r): self.worker.draft_budget(r) for r in decoding}
        while decoding:
            try:
                self._reserve_all([(req, req.kv_len + 1 + budgets[id(req)]) for req in decoding])
                break
            except OutOfKVMemory:
                if any(budgets.values()):
                    for req in decoding:
                        self._trim(req)
                    budgets = dict.fromkeys(budgets, 0)
                    continue
                if len(self.running) == 1:
                    self.fail(self.running[0], "the KV cache is full: this request's context does not fit it")
                    return []
                self._retract()
                decoding = [r for r in self.running if r.kv_len + 1 == r.seq_len]
        return [ScheduledReq(r, 1, budgets.get(id(r), 0)) for r in decoding]

    def _trim(self, req: Req) -> None:
        """Give back the whole pages booked past a request's next token (drafts that verification
        rejected, or that were never proposed); what they held was never in the prefix cache."""
        page = self.allocator.page_size
        keep = -(-req.seq_len // page) * page
        if req.allocated > keep:
            self.allocator.free_slots(self.req_pool.table[req.row, keep:req.allocated].clone())
            self.req_pool.table[req.row, keep:req.allocated] = 0
            req.allocated = keep

    def step(self) -> list[Req]:
        """Run one forward pass; returns the requests that got tokens (finished ones included).
        A request whose computation raises is failed (see `fail`), the others go on."""
        started = time.perf_counter()
        self._queue_awaiting_tokenizer()
        self._in_step = []
        batch = self._schedule_prefill() if self.waiting or any(r.kv_len + 1 < r.seq_len for r in self.running) else []
        if batch and self.args.enable_mixed_chunk:
            scheduled = {id(item.req) for item in batch}
            batch = [item for item in self._schedule_decode() if id(item.req) not in scheduled] + batch
        if not batch:
            batch = self._schedule_decode()
        self._start_tokenizer_if_due(idle=not batch)
        if not batch:
            if self.waiting and self.tree is not None:
                self.tree.wait_for_prefetch(PREFETCH_POLL_S)
            elif self.preparing_now:
                self._preparing = self.runner.prepare_when_idle(PREPARE_STRETCH_S)
                if not self._preparing:
                    logger.info("the model's deferred preparation is done (in the pauses since %.1f s after launch)",
                                time.monotonic() - self._started_at)
            return []
        self._in_step = [item.req for item in batch]
        scheduled_at = time.perf_counter()
        result = self.worker.run(batch)
        if not result.results:
            return []
        if self.tree is not None:
            for item in result.results:
                if item.item.extend > 1 and self._caches(item.req):
                    self._cache_computed_prefix(item.req)
        forwarded_at = time.perf_counter()
        reqs = self._process(result)
        if all(item.extend == 1 for item in batch):
            self.stats.decode_steps += 1
        if self.args.show_time_cost:
            logger.info("step: %d requests, %d tokens; schedule %.1f ms, forward and sample %.1f ms, process %.1f ms",
                        len(batch), sum(item.extend + len(item.drafts) for item in batch),
                        (scheduled_at - started) * 1e3, (forwarded_at - scheduled_at) * 1e3,
                        (time.perf_counter() - forwarded_at) * 1e3)
        return reqs

    @torch.inference_mode()
    def _process(self, result: BatchResult) -> list[Req]:
        """Append each request's new tokens until one ends it; a verify pass's request keeps the
        KV of the tokens it appended and gives back the pages booked for rejected drafts."""
        done = []
        self._in_step = [r.req for r in result.results]
        for item in result.results:
            req = item.req
            if not item.rows:
                # max_new_tokens=0 only fills the cache (the prompt of an n > 1 request).
                if req.kv_len == req.seq_len and req.max_new_tokens == 0:
                    req.finish_reason = FinishReason.LENGTH
                    self.running.remove(req)
                    self._release(req)
                    done.append(req)
                continue
            appended = 0
            try:
                for i, (token, row) in enumerate(zip(item.tokens, item.rows)):
                    if item.token_ids_logprobs:
                        req.token_ids_logprobs.append(item.token_ids_logprobs[i])
                    self._append_token(req, token, result.sample, row)
                    appended += 1
                    if req.finished:
                        break
            except Exception as exc:
                logger.exception("request %s failed after sampling", req.rid)
                self.fail(req, f"{type(exc).__name__}: {exc}")
                continue
            if item.item.drafts:
                # The KV of the last token and the accepted drafts is kept (all that was appended
                # but the final token, whose KV the next step computes).
                req.kv_len += appended
                self.stats.record_verify(len(item.item.drafts), appended)
            done.append(req)
            if req.finished:
                self.running.remove(req)
                self._release(req)
            elif item.item.draft_budget:
                self._trim(req)
        return done

    def _append_token(self, req: Req, token: int, out: SampleOutput, row: int) -> None:
        req.output_ids.append(token)
        if req.grammar is not None and not req.grammar.accept_token(token):
            logger.error("request %s: the sampler chose token %d, which its grammar forbids", req.rid, token)
            req.finish_reason = FinishReason.ABORT
        if out.logprobs is not None:
            req.logprobs.append(reportable(float(out.logprobs[row])))
        if out.top_logprobs is not None and req.params.top_logprobs:
            values, ids = out.top_logprobs
            k = req.params.top_logprobs
            req.top_logprobs.append(list(zip(ids[row, :k].tolist(), map(reportable, values[row, :k].tolist()))))
        self.stats.generated_tokens += 1
        self._check_finished(req)

    def _check_finished(self, req: Req) -> None:
        token, params = req.output_ids[-1], req.params
        stop_string = None
        if req.stop_matcher is not None:
            req.stop_matcher.push([token])
            stop_string = req.stop_matcher.stopped
        if req.finished:
            return
        if req.grammar is not None and req.grammar.is_terminated():
            req.finish_reason, req.matched_stop = FinishReason.STOP, token
            return
        if len(req.output_ids) >= params.min_new_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
                req.finish_reason, req.matched_stop = FinishReason.STOP, token
                return
            if stop_string is not None:
                req.finish_reason, req.matched_stop = FinishReason.STOP, stop_string
                return
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.runner.context_len:
            req.finish_reason = FinishReason.LENGTH

    # ---- introspection ---------------------------------------------------------------------

    def close(self) -> None:
        """The loop ended: let the prefix cache finish its writes to storage, and stop the other
        tensor-parallel ranks."""
        if self.tree is not None:
            self.tree.close()
        self.runner.close()

    def kv_tokens_in_use(self) -> int:
        """Slots held by requests or the prefix cache (what must be zero after a flush when idle)."""
        return self.allocator.capacity_tokens - self.allocator.free_tokens

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests wait or run, as in SGLang: a
        running request holds a node of the tree even before it has a page cached."""
        if self.has_work:
            return False
        return True if self.tree is None else self.tree.flush()

    def drop_prefix_cache(self) -> None:
        """Empty the prefix cache, its KV made by weights no longer served (no request may be
        running; waiting ones hold nothing of it); sessions compute their next turn whole."""
        if self.running:
            raise RuntimeError("the prefix cache cannot be dropped while requests run")
        for session_id in list(self.session_nodes):
            self.unpin_session(session_id)
        if self.tree is not None:
            self.tree.flush()

    def _pin_session(self, session_id: str, tokens: list[int]) -> None:
        _, node = self.tree.match_prefix(tokens)
        self.tree.lock(node)
        self.unpin_session(session_id)
        self.session_nodes[session_id] = node

    def unpin_session(self, session_id: str) -> None:
        node = self.session_nodes.pop(session_id, None)
        if node is not None:
            self.tree.unlock(node)
