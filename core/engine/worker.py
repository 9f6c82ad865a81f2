"""The worker: runs a scheduled batch through the model and the sampler, and says which tokens
each request gets (`Worker.run(batch) -> BatchResult`).

The scheduler decides what runs and owns KV memory; the worker computes. A request may come with
draft tokens, a chain or a tree (speculative decoding, `srv.engine.speculative`): its last token
and drafts run as decode rows in the same pass (ForwardMode.TARGET_VERIFY), each seeing the
cache and its ancestors; the sampler draws the target's token at every row, and
`srv.sdk.speculative.accept_tree` keeps the drafts the target agrees with.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy
import torch

from srv.engine.model_runner import ModelRunner
from srv.engine.memory import ReqToTokenPool
from srv.engine.request import Req
from srv.sdk.attention import ForwardMode
from srv.sdk.grammar import allocate_bitmask
from srv.sdk.sampling import SampleOutput, SamplingBatch, SamplingParams
from srv.sdk.speculative import DraftTree, accept_tree

logger = logging.getLogger("srv.scheduler")

# What a log-probability of -inf (a token the model gives no probability) is reported as.
LOGPROB_FLOOR = -9999.0


@dataclass(eq=False)
class ScheduledReq:
    """One request of a step: it feeds `token_ids[kv_len : kv_len + extend]`, then `drafts`.
    draft_budget: the KV slots the scheduler booked past the last token, the most drafts it may
    be given this step (0: none)."""

    req: Req
    extend: int
    draft_budget: int = 0
    drafts: list[int] = field(default_factory=list)
    tree: DraftTree | None = None   # the drafts' tree, when they are not a chain
    # The target's hidden states of this request's rows, from position hidden_start on, when the
    # worker captures them (ForwardBatch.capture_layers).
    hidden: torch.Tensor | None = None
    hidden_start: int = 0


@dataclass
class RequestResult:
    """What a step gave one request: its new tokens in order (empty for a prefill chunk that
    does not reach the end of the prompt), and each token's row in the step's SampleOutput."""

    item: ScheduledReq
    tokens: list[int]
    rows: list[int]
    nodes: list[int] = field(default_factory=list)   # the draft nodes accepted (row 1 + j of the item)
    # params.token_ids_logprob's log-probabilities at each of `rows`.
    token_ids_logprobs: list[list[float]] = field(default_factory=list)

    @property
    def req(self) -> Req:
        return self.item.req


@dataclass
class BatchResult:
    """The step's requests that computed (those that failed are absent: the worker failed them)."""

    results: list[RequestResult]
    sample: SampleOutput | None = None


class Worker:
    """The plain worker: one forward pass, one sampling pass."""

    def __init__(self, runner: ModelRunner, req_pool: ReqToTokenPool, eos_ids: list[int],
                 fail: Callable[[Req, str], None], crash_on_nan: bool, stats: Any) -> None:
        """fail(req, why) ends a request the worker cannot compute; stats counts forward_steps."""
        self.runner, self.req_pool, self.eos_ids = runner, req_pool, eos_ids
        self.fail, self.crash_on_nan, self.stats = fail, crash_on_nan, stats
        self.detect_nan = bool(getattr(runner.args, "enable_nan_detection", False))
        self.capture_layers: tuple[int, ...] = ()   # hidden states every forward pass returns

    def draft_budget(self, req: Req) -> int:
        """How many drafts `req` may be given in its next decode step (the plain worker drafts none)."""
        return 0

    def release(self, req: Req) -> None:
        """`req` finished or was retracted: drop whatever the worker keeps for it."""

    def run(self, batch: list[ScheduledReq]) -> BatchResult:
        batch, logits = self._forward_isolating_failures(batch)
        if not batch:
            return BatchResult([])
        if self.crash_on_nan and torch.isnan(logits).any():
            raise FloatingPointError(f"NaN in the logits of requests {[i.req.rid for i in batch]} (--crash-on-nan)")
        if self.detect_nan:
            logits = self._without_nan(batch, logits)
        return self._sample(batch, logits)

    def _without_nan(self, batch: list[ScheduledReq], logits: torch.Tensor) -> torch.Tensor:
        """--enable-nan-detection: log the requests whose logits hold a NaN, and sample them with
        each NaN read as -1e5 (as SGLang does), so the sampler never sees one."""
        rows = torch.isnan(logits).any(-1)
        if not bool(rows.any()):
            return logits
        rids, start = [], 0
        for item in batch:   # each request's rows: its last token's, then its drafts'
            end = start + 1 + len(item.drafts)
            if bool(rows[start:end].any()):
                rids.append(item.req.rid)
            start = end
        logger.warning("NaN in the logits of requests %s (--enable-nan-detection): sampled with each NaN as -1e5",
                       rids)
        return logits.masked_fill(torch.isnan(logits), -1e5)

    # ---- forward -------------------------------------------------------------------------

    def _forward_isolating_failures(self, batch: list[ScheduledReq]) -> tuple[list[ScheduledReq], torch.Tensor]:
        """The batch's logits; when the batch's forward raises, each request runs alone and those
        that still raise are failed, so one bad request cannot take its batch down with it."""
        try:
            return batch, self._forward(batch)
        except Exception as exc:
            if len(batch) == 1:
                raise
            logger.warning("a forward pass of %d requests raised %s; running them one by one", len(batch),
                           type(exc).__name__)
        kept, rows = [], []
        for item in batch:
            try:
                rows.append(self._forward([item]))
                kept.append(item)
            except Exception as exc:
                logger.exception("request %s failed in the forward pass", item.req.rid)
                self.fail(item.req, f"the forward pass failed: {type(exc).__name__}: {exc}")
        return kept, torch.cat(rows) if rows else torch.empty(0)

    def _forward(self, batch: list[ScheduledReq]) -> torch.Tensor:
        """The logits of each request's last new token, then of each of its drafts, [rows, vocab];
        prompt log-probabilities a request wants from this chunk are recorded on the way (their
        rows come after those). A request with drafts runs as decode rows, one a position,
        sharing its KV row: row j sees the cache up to its own position. The step's positions and
        slots are gathered in NumPy (the request table's view), a torch tensor each at the end,
        rather than torch operators for every request (see ReqToTokenPool.array)."""
        ids: list[int] = []
        positions, locs, table_rows, lens, prompt_rows = [], [], [], [], []
        prefix_lens, extends = [], []
        tree_rows: list[tuple[int, numpy.ndarray]] = []   # (row, its slots) of tree nodes
        for item in batch:
            req, extend = item.req, item.extend
            tokens = req.token_ids
            wanted = req.next_prompt_logprob
            if wanted is not None:
                if wanted == 0:   # the first prompt token has no log-probability
                    req.input_logprobs.append(None)
                    req.input_top_logprobs.append([])
                # Position p's logits give token p + 1: (request, row in the batch, that token).
                prompt_rows += [(req, len(ids) + p - req.kv_len, tokens[p + 1])
                                for p in range(max(wanted - 1, req.kv_len), min(req.kv_len + extend, req.prompt_len - 1))]
            table = self.req_pool.array[req.row]
            if item.drafts:
                n = 1 + len(item.drafts)
                ids += tokens[req.kv_len: req.kv_len + 1] + item.drafts
                depths = [0] + ([item.tree.depth(j) for j in range(n - 1)] if item.tree else list(range(1, n)))
                positions.append(req.kv_len + numpy.array(depths, dtype=numpy.int64))
                locs.append(table[req.kv_len: req.kv_len + n])
                if item.tree is not None:
                    # Node j's slot is kv_len + 1 + j; it sees the cache, the last token and its ancestors.
                    for j in range(n - 1):
                        path = numpy.array(item.tree.path(j), dtype=numpy.int64) + req.kv_len + 1
                        tree_rows.append((len(table_rows) + 1 + j, numpy.concatenate([table[:req.kv_len + 1], table[path]])))
                table_rows += [req.row] * n
                lens += [req.kv_len + 1 + d for d in depths]
                prefix_lens += [req.kv_len + d for d in depths]
                extends += [1] * n
            else:
                ids += tokens[req.kv_len: req.kv_len + extend]
                positions.append(numpy.arange(req.kv_len, req.kv_len + extend, dtype=numpy.int64))
                locs.append(table[req.kv_len: req.kv_len + extend])
                table_rows.append(req.row)
                lens.append(req.kv_len + extend)
                prefix_lens.append(req.kv_len)
                extends.append(extend)
        max_len = max(lens)
        # Past its own tokens a row may hold slots reserved for later ones, never written yet
        # (or a verify row's later drafts): point them at slot 0 as ForwardBatch promises, or
        # masked attention would read garbage.
        kv_slots = self.req_pool.array[table_rows, :max_len]   # a copy: rows picked by a list
        kv_slots[numpy.arange(max_len) >= numpy.array(lens)[:, None]] = 0
        for row, slots in tree_rows:
            kv_slots[row, :len(slots)] = slots
        logits_indices = None
        if prompt_rows:
            last = torch.tensor(extends).cumsum(0) - 1
            logits_indices = torch.cat([last, torch.tensor([row for _, row, _ in prompt_rows])])
        verify = any(item.drafts for item in batch)
        # A request that wants its hidden states gets the final norm's output of every row (the
        # speculative workers, which capture layers of their own, are refused such requests).
        capture = self.capture_layers or ((self.runner.num_layers,) if any(
            item.req.params.return_hidden_states for item in batch) else ())
        segments = None
        if any(item.req.token_type_ids for item in batch):
            segments = torch.tensor([t for item in batch for t in (item.req.token_type_ids or [0] * item.req.seq_len)
                                     [item.req.kv_len: item.req.kv_len + item.extend]])
        lora = self.runner.lora
        if lora is not None:
            self.runner.activate_lora({item.req.params.lora_path for item in batch
                                       if item.req.params.lora_path is not None})
        slots = None if lora is None else [lora.slot(item.req.params.lora_path)
                                           for item in batch for _ in range(1 + len(item.drafts) if item.drafts else 1)]
        out = self.runner.forward(torch.tensor(ids), torch.from_numpy(numpy.concatenate(positions)),
                                  torch.from_numpy(numpy.concatenate(locs)), torch.from_numpy(kv_slots), prefix_lens,
                                  extends, logits_indices, ForwardMode.TARGET_VERIFY if verify else None, capture,
                                  segments, slots)
        logits = out.logits
        if capture:
            offset = 0
            for item in batch:
                n = 1 + len(item.drafts) if item.drafts else item.extend
                item.hidden, item.hidden_start = out.hidden_states[offset: offset + n], item.req.kv_len
                if item.req.params.return_hidden_states:
                    # Rows of positions recorded before a retraction are computed again: skip them.
                    known = len(item.req.hidden_states) - item.req.kv_len
                    item.req.hidden_states += item.hidden[max(known, 0):].tolist()
                offset += n
        if prompt_rows:
            self._record_prompt_logprobs(prompt_rows, logits[len(extends):])
            logits = logits[:len(extends)]
        for item in batch:
            if not item.drafts:   # a verify pass's KV length is set by what verification accepts
                item.req.kv_len += item.extend
        self.stats.forward_steps += 1
        return logits

    @staticmethod
    def _record_prompt_logprobs(rows: list[tuple[Req, int, int]], logits: torch.Tensor) -> None:
        """The log-probability of each row's next prompt token (and the top ones, if asked),
        appended to its request's prompt log-probabilities."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_k = max(req.params.top_logprobs for req, _, _ in rows)
        top = torch.topk(logprobs, top_k, dim=-1) if top_k else None
        for j, (req, _, token) in enumerate(rows):
            req.input_logprobs.append(reportable(float(logprobs[j, token])))
            k = req.params.top_logprobs
            req.input_top_logprobs.append(list(zip(top.indices[j, :k].tolist(), map(reportable, top.values[j, :k].tolist())))
                                          if top is not None and k else [])

    # ---- sampling ------------------------------------------------------------------------

    @torch.inference_mode()
    def _sample(self, batch: list[ScheduledReq], logits: torch.Tensor) -> BatchResult:
        """Sample every request whose input reached the end of what it knows, at each of its
        rows (its last token's, then its drafts'), each row seeing the tokens before it."""
        results, rows, params, token_ids, prompt_lens, constrained = [], [], [], [], [], []
        row = 0
        for item in batch:
            req, n = item.req, 1 + len(item.drafts)
            ready = bool(item.drafts) or req.kv_len == req.seq_len
            if ready and req.max_new_tokens > 0:
                results.append(RequestResult(item, [], list(range(len(params), len(params) + n))))
                rows += range(row, row + n)
                tree = (item.tree or DraftTree.chain(item.drafts)) if item.drafts else None
                for j in range(n):
                    if req.grammar is not None:
                        constrained.append((len(params), req))
                    params.append(req.params)
                    # Row 0 samples after the last token, row 1 + i after node i and its ancestors.
                    token_ids.append(req.token_ids + [item.drafts[a] for a in tree.path(j - 1)] if j else req.token_ids)
                    prompt_lens.append(req.prompt_len)
            else:
                results.append(RequestResult(item, [], []))
            row += n
        if not params:
            return BatchResult(results)
        mask = None
        if constrained:
            mask = allocate_bitmask(len(params), logits.shape[-1])
            for j, req in constrained:
                req.grammar.fill_bitmask(mask, j)
        if len(rows) < logits.shape[0]:
            logits = logits[rows]
        logits = self._apply_logit_processors(logits, params)
        sampling = SamplingBatch(params, token_ids, prompt_lens, self.eos_ids, mask)
        sample = self.runner.sampler.sample(logits, sampling)
        samples = sample.next_token_ids.tolist()
        moves: list[tuple[list[int], list[int]]] = []   # (sources, targets) of accepted tree nodes' KV
        for result in results:
            if result.rows and not result.item.drafts:
                result.tokens = [samples[result.rows[0]]]
            elif result.rows:
                item = result.item
                tree = item.tree or DraftTree.chain(item.drafts)
                result.tokens, result.nodes = accept_tree([samples[j] for j in result.rows], tree)
                result.rows = [result.rows[0]] + [result.rows[1 + j] for j in result.nodes]
                if item.tree is not None:
                    moves.append(self._accepted_kv_moves(item, result.nodes))
        if any(sources for sources, _ in moves):
            self.runner.copy_kv(torch.tensor([s for sources, _ in moves for s in sources], dtype=torch.int64),
                                torch.tensor([t for _, targets in moves for t in targets], dtype=torch.int64))
        self._record_token_ids_logprobs(results, logits)
        return BatchResult(results, sample)

    @staticmethod
    def _apply_logit_processors(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each custom logit processor on the rows of the requests that name it."""
        named: dict[str, list[int]] = {}
        for row, p in enumerate(params):
            if p.custom_logit_processor is not None:
                named.setdefault(p.custom_logit_processor, []).append(row)
        if not named:
            return logits
        from srv.sdk.logit_processor import CustomLogitProcessor

        logits = logits.clone()
        for text, rows in named.items():
            index = torch.tensor(rows)
            logits[index] = CustomLogitProcessor.from_str(text)(logits[index], [params[r].custom_params for r in rows])
        return logits

    @staticmethod
    def _record_token_ids_logprobs(results: list[RequestResult], logits: torch.Tensor) -> None:
        """Each row's log-probabilities of the tokens its request follows (token_ids_logprob),
        from the model's own distribution (before penalties and temperature)."""
        for result in results:
            ids = result.req.params.token_ids_logprob
            if ids and result.rows:
                rows = torch.log_softmax(logits[result.rows].float(), dim=-1)[:, ids]
                result.token_ids_logprobs = [list(map(reportable, row)) for row in rows.tolist()]

    def _accepted_kv_moves(self, item: ScheduledReq, nodes: list[int]) -> tuple[list[int], list[int]]:
        """A tree's accepted node j at depth d wrote its KV at slot kv_len + 1 + j of the request's
        row; the request's sequence needs it at kv_len + d: the slots to copy from and to. (No
        target is another move's source read after it is written: the copy reads every source
        first, and the requests' rows hold slots of their own.)"""
        req, table = item.req, self.req_pool.array[item.req.row]
        moved = [(depth, j) for depth, j in enumerate(nodes, 1) if j != depth - 1]
        return ([int(table[req.kv_len + 1 + j]) for _, j in moved],
                [int(table[req.kv_len + depth]) for depth, _ in moved])


def reportable(logprob: float) -> float:
    """A log-probability JSON can carry (no -inf, no NaN)."""
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class EmbeddingWorker(Worker):
    """An embedding server's worker: one forward pass over whole prompts, each pooled
    (srv.engine.pooling) from its final hidden states into `req.embedding`. Nothing is sampled;
    the scheduler ends each request once its prompt is computed (max_new_tokens 0)."""

    def __init__(self, runner: ModelRunner, *args: Any) -> None:
        super().__init__(runner, *args)
        self.scores = runner.pooling.method == "score"
        self.capture_layers = () if self.scores else (runner.num_layers,)

    def run(self, batch: list[ScheduledReq]) -> BatchResult:
        batch, logits = self._forward_isolating_failures(batch)
        if self.scores:   # the model's own output, a row a request
            for item, row in zip(batch, logits.tolist()):
                item.req.embedding = row
            return BatchResult([RequestResult(item, [], []) for item in batch])
        for item in batch:
            if item.hidden.shape[0] != item.req.prompt_len:
                raise RuntimeError(f"request {item.req.rid}: an embedding needs its prompt in one pass")
            if self.crash_on_nan and torch.isnan(item.hidden).any():
                raise FloatingPointError(f"NaN in the hidden states of request {item.req.rid} (--crash-on-nan)")
            item.req.embedding = self.runner.pooling(item.hidden).tolist()
            item.hidden = None
        return BatchResult([RequestResult(item, [], []) for item in batch])
