"""Speculative decoding in the engine: the worker that asks an algorithm (a plugin of the
speculative_algorithm family) for drafts and verifies them, and the draft models algorithms
load through `SpeculativeContext.load_draft_model`."""

from __future__ import annotations

import copy
import dataclasses
import logging
from argparse import Namespace
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from srv.backend_registry import BackendRegistry
from srv.engine.memory import PagedSlotAllocator
from srv.engine.model_runner import REPO_ID, ModelRunner, local_model_path
from srv.engine.request import Req
from srv.engine.worker import BatchResult, EmbeddingWorker, ScheduledReq, Worker
from srv.sdk.attention import ForwardMode
from srv.sdk.speculative import DraftModel, DraftTree, SpeculativeAlgorithm, SpeculativeConfig, SpeculativeContext

logger = logging.getLogger("srv.scheduler")


def make_worker(args: Namespace, runner: ModelRunner, registry: BackendRegistry, req_pool: Any, eos_ids: list[int],
                fail: Callable[[Req, str], None], crash_on_nan: bool, stats: Any) -> Worker:
    """The plain worker, or with --speculative-algorithm the speculative worker around it; on
    an embedding server the embedding worker."""
    if runner.is_embedding:
        if args.speculative_algorithm:
            raise ValueError("--speculative-algorithm drafts tokens: an embedding server generates none")
        return EmbeddingWorker(runner, req_pool, eos_ids, fail, crash_on_nan, stats)
    if not args.speculative_algorithm:
        return Worker(runner, req_pool, eos_ids, fail, crash_on_nan, stats)
    registration = registry.choose("speculative_algorithm", args.speculative_algorithm)
    factory = registration.load_factory()
    config = SpeculativeConfig.from_args(args, getattr(factory, "default_num_draft_tokens", 4))
    if config.token_map and not getattr(factory, "reads_token_map", False):
        raise ValueError(f"--speculative-token-map: {registration.name} reads no token map (it narrows the "
                         "drafts of a head that drafts over the target's vocabulary, as EAGLE's does)")
    config = dataclasses.replace(config, **local_draft_paths(args, config))
    capacity = int(getattr(args, "max_total_tokens", None) or 0) or None

    def load_draft_model(path: str) -> DraftModel:
        return EngineDraftModel(args, registry, path, capacity or runner.kv_capacity_tokens())

    # runner.model at each call: /update_weights_from_disk replaces it. A rank's share of a
    # split head has no rows of the others: the head is then read off its products.
    def target_head_rows(ids: torch.Tensor) -> torch.Tensor:
        head = runner.head_logits if runner.parallel.is_parallel else runner.model.lm_head
        return head_rows(head, ids, runner.config.hidden_size, runner.dtype)

    context = SpeculativeContext(config, runner.config.vocab_size, args, load_draft_model, runner.config,
                                 runner.embed, runner.head_logits, target_head_rows)
    algorithm = factory(context)
    if algorithm.capture_layers:   # an algorithm drafting from hidden states reads the target's head
        runner.check_head_alone(f"--speculative-algorithm {registration.name}")
    if config.eagle_topk > 1 and not algorithm.supports_trees:
        raise ValueError(f"--speculative-eagle-topk {config.eagle_topk}: {registration.name} drafts chains "
                         "(--speculative-eagle-topk 1)")
    logger.info("speculative decoding: %s, up to %d drafts a step", registration.name, config.max_drafts)
    return SpeculativeWorker(runner, req_pool, eos_ids, fail, crash_on_nan, stats, algorithm, config)


def local_draft_paths(args: Namespace, config: SpeculativeConfig) -> dict[str, str]:
    """--speculative-draft-model-path and --speculative-token-map on this machine: a path as
    given, else found in the local Hugging Face cache (a repository id at
    --speculative-draft-model-revision; a token map's `org/name/file`), never downloaded."""
    paths = {}
    if config.draft_model_path:
        paths["draft_model_path"] = str(local_model_path(
            config.draft_model_path, args.speculative_draft_model_revision, args.download_dir,
            flag="--speculative-draft-model-path", revision_flag="--speculative-draft-model-revision"))
    elif args.speculative_draft_model_revision:
        raise ValueError("--speculative-draft-model-revision names a version of the draft model: "
                         "--speculative-draft-model-path is unset")
    if config.token_map and not Path(config.token_map).exists():
        repo, _, file = config.token_map.rpartition("/")
        if not REPO_ID.fullmatch(repo):
            raise FileNotFoundError(f"--speculative-token-map {config.token_map} does not exist")
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            paths["token_map"] = hf_hub_download(repo, file, cache_dir=args.download_dir, local_files_only=True)
        except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
            where = args.download_dir or "the Hugging Face cache"
            raise FileNotFoundError(f"--speculative-token-map {config.token_map}: no such file, and {where} has "
                                    f"no copy of {file} in {repo} (srv never downloads)") from None
    return paths


def head_rows(head: torch.nn.Module, ids: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows of a head's weight at vocabulary ids, float32 [len(ids), hidden]: its dense
    weight where it has one, else read off its products with unit vectors (a quantized head's
    weights as it computes them)."""
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2 \
            and weight.shape[1] == hidden_size and not weight.is_meta:
        return weight[ids].float()
    rows = torch.empty(len(ids), hidden_size)
    with torch.inference_mode():
        for start in range(0, hidden_size, 256):   # a few unit vectors at a time: [256, vocab] at most
            count = min(256, hidden_size - start)
            units = torch.zeros(count, hidden_size, dtype=dtype)
            units[torch.arange(count), start + torch.arange(count)] = 1
            rows[:, start:start + count] = head(units).float()[:, ids].T
    return rows


class SpeculativeWorker(Worker):
    """Asks the algorithm for drafts for the decoding requests the scheduler booked slots for,
    and has the plain worker verify them in the same pass."""

    def __init__(self, runner: ModelRunner, req_pool: Any, eos_ids: list[int], fail: Callable[[Req, str], None],
                 crash_on_nan: bool, stats: Any, algorithm: SpeculativeAlgorithm, config: SpeculativeConfig) -> None:
        super().__init__(runner, req_pool, eos_ids, fail, crash_on_nan, stats)
        self.algorithm, self.config = algorithm, config
        self.vocab_size = runner.config.vocab_size
        self.capture_layers = tuple(algorithm.capture_layers)

    def draft_budget(self, req: Req) -> int:
        # A grammar's mask after a draft needs the grammar advanced over it: such rows decode
        # one token a step.
        if req.grammar is not None:
            return 0
        # The last of a step's tokens is the target's own: drafts leave room for it.
        room = min(req.max_new_tokens - len(req.output_ids), self.runner.context_len - req.seq_len) - 1
        return max(0, min(self.config.max_drafts, room))

    def release(self, req: Req) -> None:
        self.algorithm.release(req.rid)

    def run(self, batch: list[ScheduledReq]) -> BatchResult:
        drafting = [item for item in batch if item.draft_budget > 0]
        if drafting:
            self._propose(drafting)
        result = super().run(batch)
        for r in result.results:
            item = r.item
            if item.drafts:
                self.algorithm.verified(r.req, len(item.drafts), len(r.tokens) - 1)
            if item.hidden is not None:
                # Of a verify pass's rows, the last token's and the accepted nodes' hold the request's.
                hidden = item.hidden[[0] + [1 + j for j in r.nodes]] if item.drafts else item.hidden
                self.algorithm.observe(r.req, item.hidden_start, hidden)
        return result

    def _propose(self, items: list[ScheduledReq]) -> None:
        try:
            proposals = self.algorithm.propose([item.req for item in items], [item.draft_budget for item in items])
        except Exception:
            # Drafts only speed decoding up: without them every request still decodes.
            logger.exception("the speculative algorithm failed to propose drafts; decoding without them")
            return
        for item, drafts in zip(items, proposals):
            tree = drafts if isinstance(drafts, DraftTree) else DraftTree.chain([int(t) for t in drafts])
            tree = tree.first(item.draft_budget)
            bad = next((i for i, t in enumerate(tree.tokens) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                tree = tree.first(bad)
            item.drafts = [int(t) for t in tree.tokens]
            item.tree = None if tree.is_chain else tree


class EngineDraftModel(DraftModel):
    """A draft model built like the target (loaders, model and quantization plugins, dtype) with
    a KV cache of its own, one slot a token; each request's computed tokens are kept until it
    ends, and the least recently used requests' are dropped when the cache is full."""

    def __init__(self, args: Namespace, registry: BackendRegistry, path: str, capacity_tokens: int) -> None:
        draft_args = copy.copy(args)
        draft_args.model_path, draft_args.quantization, draft_args.max_total_tokens = path, None, capacity_tokens
        # The draft model runs whole in the process that schedules (the target's rank 0), where
        # its drafts are read: its passes wait on no other rank.
        draft_args.tensor_parallel_size = draft_args.pipeline_parallel_size = draft_args.expert_parallel_size = 1
        draft_args.enable_dp_attention = False
        # The target's adapters are of the target's shapes: the draft drafts as its base model,
        # and verification keeps each request's adapter's output.
        draft_args.enable_lora, draft_args.lora_paths = False, None
        draft_args.json_model_override_args = None
        draft_args.revision = None   # --revision is the target's; the draft's path is resolved already
        # A draft model's sparse layers run on their own MoE runner and token exchange where the
        # launch names them, else on the target's.
        draft_args.moe_runner_backend = args.speculative_moe_runner_backend or args.moe_runner_backend
        draft_args.moe_a2a_backend = args.speculative_moe_a2a_backend or args.moe_a2a_backend
        self.runner = ModelRunner(draft_args, registry)
        self.vocab_size = self.runner.config.vocab_size
        self.allocator = PagedSlotAllocator(capacity_tokens + 1, 1)
        self.runner.allocate_kv_cache(self.allocator.num_slots)
        # rid -> (computed tokens, their slots), least recently used first
        self.cached: OrderedDict[str, tuple[list[int], torch.Tensor]] = OrderedDict()

    def release(self, rid: str) -> None:
        entry = self.cached.pop(rid, None)
        if entry is not None:
            self.allocator.free_slots(entry[1])

    def _room(self, needed: int, keep: set[str]) -> bool:
        while self.allocator.free_tokens < needed:
            victim = next((rid for rid in self.cached if rid not in keep), None)
            if victim is None:
                return False
            self.release(victim)
        return True

    @torch.inference_mode()
    def next_token_logits(self, requests: Sequence[tuple[str, list[int]]]) -> torch.Tensor | None:
        plan = []
        for rid, tokens in requests:
            computed, slots = self.cached.pop(rid, ([], torch.empty(0, dtype=torch.int64)))
            # Keep the computed tokens still in `tokens` (rejected drafts drop out); the last
            # token is always computed, to give its logits.
            keep = min(common_prefix_len(computed, tokens), len(tokens) - 1)
            self.allocator.free_slots(slots[keep:])
            self.cached[rid] = (computed[:keep], slots[:keep])
            plan.append((rid, tokens, keep))
        needed = sum(len(tokens) - keep for _, tokens, keep in plan)
        if not self._room(needed, {rid for rid, _ in requests}):
            return None
        ids, positions, locs, tables = [], [], [], []
        for rid, tokens, keep in plan:
            new = torch.tensor(self.allocator.allocate_pages(len(tokens) - keep))
            slots = torch.cat([self.cached[rid][1], new])
            self.cached[rid] = (list(tokens), slots)
            ids += tokens[keep:]
            positions.append(torch.arange(keep, len(tokens)))
            locs.append(new)
            tables.append(slots)
        width = max(t.numel() for t in tables)
        kv_slots = torch.zeros(len(tables), width, dtype=torch.int64)
        for i, slots in enumerate(tables):
            kv_slots[i, :slots.numel()] = slots
        extends = [len(tokens) - keep for _, tokens, keep in plan]
        out = self.runner.forward(torch.tensor(ids), torch.cat(positions), torch.cat(locs), kv_slots,
                                  [keep for _, _, keep in plan], extends, mode=ForwardMode.DRAFT_EXTEND)
        return out.logits


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
