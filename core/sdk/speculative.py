"""Base class for speculative decoding algorithms (`--speculative-algorithm`), and what they are
handed.

An algorithm proposes draft tokens for decoding requests; srv verifies them with the served
(target) model in one forward pass and keeps the longest prefix the target agrees with, plus
the target's own next token. The rule (`accept_drafts`) samples the target at every draft
position with the request's own sampler and accepts a draft while the sample equals it: with
greedy decoding that is the target's greedy output, and with temperature > 0 it is speculative
sampling for a deterministic proposal (accept d with probability p(d), otherwise a token from p
without d), so the output's distribution is the target's. Drafts are a chain (the tokens the
next steps would produce) or a tree (`DraftTree`: several candidates a position); in a tree the
target's sample at a node picks the child to follow, which keeps the rule exact.

A verify pass lays each request's last token and drafts out as decode rows (one row per node,
each attending to the cache and its own ancestors), so every attention backend that decodes
verifies chains and trees alike, with the decode step's arithmetic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from srv.sdk.sampling import SamplingParams

if TYPE_CHECKING:   # annotations only: the launch flags are checked without importing torch
    import torch


@dataclass(frozen=True)
class NgramConfig:
    """The `--speculative-ngram-*` flags."""

    min_match_window_size: int = 1
    max_match_window_size: int = 12
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"         # BFS: the most recent continuation; PROB: the most frequent
    branch_length: int = 18          # the longest continuation the index keeps per match
    capacity: int = 10_000_000       # token positions the index holds over all requests


@dataclass(frozen=True)
class SpeculativeConfig:
    """The `--speculative-*` flags, built once at launch."""

    algorithm: str
    # Tokens one verify pass feeds a request: its last token and up to num_draft_tokens - 1 drafts.
    num_draft_tokens: int
    num_steps: int
    eagle_topk: int = 1
    draft_model_path: str | None = None
    token_map: str | None = None     # a file of the vocabulary ids a head drafts over (FR-Spec's frequent tokens)
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0
    attention_mode: str = "prefill"
    ngram: NgramConfig = NgramConfig()

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1

    @classmethod
    def from_args(cls, args: Any, default_draft_tokens: int) -> SpeculativeConfig:
        """The config of `args` (a parsed launch Namespace); `default_draft_tokens` fills
        --speculative-num-draft-tokens when unset (each algorithm has its own default)."""
        steps = args.speculative_num_steps
        draft_tokens = args.speculative_num_draft_tokens
        if draft_tokens is None:
            draft_tokens = steps + 1 if steps else default_draft_tokens
        if draft_tokens < 2:
            raise ValueError("--speculative-num-draft-tokens must be at least 2 (the last token and one draft)")
        ngram = NgramConfig(
            args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size,
            args.speculative_ngram_min_bfs_breadth, args.speculative_ngram_max_bfs_breadth,
            args.speculative_ngram_match_type, args.speculative_ngram_branch_length, args.speculative_ngram_capacity)
        if not 1 <= ngram.min_match_window_size <= ngram.max_match_window_size:
            raise ValueError("--speculative-ngram-min-match-window-size must be between 1 and the max window size")
        if not 1 <= ngram.min_bfs_breadth <= ngram.max_bfs_breadth:
            raise ValueError("--speculative-ngram-min-bfs-breadth must be between 1 and the max breadth")
        return cls(algorithm=args.speculative_algorithm, num_draft_tokens=draft_tokens,
                   num_steps=steps or draft_tokens - 1, eagle_topk=args.speculative_eagle_topk or 1,
                   draft_model_path=args.speculative_draft_model_path, token_map=args.speculative_token_map,
                   accept_threshold_single=args.speculative_accept_threshold_single,
                   accept_threshold_acc=args.speculative_accept_threshold_acc,
                   attention_mode=args.speculative_attention_mode, ngram=ngram)


class DraftRequest(Protocol):
    """What an algorithm may read of a decoding request."""

    rid: str
    token_ids: list[int]        # prompt then output, every token verified
    prompt_len: int
    params: SamplingParams


class DraftModel(ABC):
    """A second model with its own KV cache, for algorithms that draft with one
    (`SpeculativeContext.load_draft_model`). It keeps each request's computed tokens: a call
    computes only what is new, and drops what no longer matches (rejected drafts)."""

    vocab_size: int

    @abstractmethod
    def next_token_logits(self, requests: Sequence[tuple[str, list[int]]]) -> torch.Tensor | None:
        """float32 logits [B, vocab] after each (rid, token ids), or None when the draft model's
        cache has no room for them (the algorithm drafts nothing this step)."""

    @abstractmethod
    def release(self, rid: str) -> None:
        """Forget a request (it finished)."""


@dataclass
class SpeculativeContext:
    """What an algorithm's factory is handed: the config, the target's vocabulary size, a loader
    for draft models (built like the target: same dtype, loaders and model plugins), the target's
    config (`srv.sdk.models.ModelConfig`), and its embedding and head, for draft heads that share
    them (ids [N] -> float32 [N, hidden]; float32 hidden [N, hidden] -> logits [N, vocab]), and
    the head's weight rows at given vocabulary ids (ids [N] -> float32 [N, hidden]), for a head
    that drafts over part of the vocabulary (--speculative-token-map).

    `config.draft_model_path` and `config.token_map` are paths on this machine (a repository
    id on the command line is resolved in the local Hugging Face cache before)."""

    config: SpeculativeConfig
    vocab_size: int
    server_args: Any = None
    draft_model_loader: Any = None   # Callable[[str], DraftModel]
    target_config: Any = None
    target_embed: Any = None
    target_head: Any = None
    target_head_rows: Any = None

    def load_draft_model(self, path: str) -> DraftModel:
        if self.draft_model_loader is None:
            raise RuntimeError("this engine cannot load draft models")
        return self.draft_model_loader(path)


class SpeculativeAlgorithm(ABC):
    """Proposes drafts; srv verifies them (see the module docstring).

    factory(context: SpeculativeContext) -> SpeculativeAlgorithm
    """

    #: The tokens a verify pass feeds a request by default (the last token and the drafts),
    #: when --speculative-num-draft-tokens and --speculative-num-steps are unset.
    default_num_draft_tokens: int = 4
    #: The target's hidden states the algorithm reads (ForwardBatch.capture_layers numbering):
    #: every forward pass then captures them, and `observe` is handed them.
    capture_layers: tuple[int, ...] = ()
    #: Whether `propose` may answer DraftTrees (--speculative-eagle-topk above 1 needs it).
    supports_trees: bool = False
    #: Whether the algorithm reads --speculative-token-map (srv refuses the flag otherwise).
    reads_token_map: bool = False

    def __init__(self, context: SpeculativeContext) -> None:
        self.context = context
        self.config = context.config

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest], budgets: Sequence[int]) -> list[list[int] | DraftTree]:
        """Up to budgets[i] draft tokens for requests[i] (fewer, or none, when unsure): a chain,
        or a DraftTree of up to budgets[i] nodes."""

    def verified(self, request: DraftRequest, proposed: int, accepted: int) -> None:
        """After a verify pass: `accepted` of the `proposed` drafts held, and request.token_ids
        holds every token now verified."""

    def observe(self, request: DraftRequest, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states (`capture_layers`) of the request's positions start ..
        start + len(hidden) - 1, all of them verified tokens: a prompt chunk's, or a verify
        pass's last token and accepted drafts."""

    def release(self, rid: str) -> None:
        """The request finished (or was aborted): drop what was kept for it."""


@dataclass(frozen=True)
class DraftTree:
    """Drafts as a tree: node j is token tokens[j] following node parents[j] (-1: the request's
    last token); a parent comes before its children. A chain's parents are -1, 0, 1, ..."""

    tokens: list[int]
    parents: list[int]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} parents")
        for j, parent in enumerate(self.parents):
            if not -1 <= parent < j:
                raise ValueError(f"node {j}'s parent {parent}: a parent must come before its child (or be -1)")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def path(self, j: int) -> list[int]:
        """The nodes from the root's child down to node j."""
        nodes = []
        while j >= 0:
            nodes.append(j)
            j = self.parents[j]
        return nodes[::-1]

    def depth(self, j: int) -> int:
        return len(self.path(j))

    def first(self, n: int) -> DraftTree:
        """The tree of its first n nodes (parents come first: still a tree)."""
        return DraftTree(self.tokens[:n], self.parents[:n])


def accept_tree(samples: Sequence[int], tree: DraftTree) -> tuple[list[int], list[int]]:
    """(the tokens a verify pass appends, the nodes accepted). samples[0] is the target's
    sample after the request's last token, samples[1 + j] after node j: from the root, the
    child whose token is the sample is followed while there is one; the last sample ends it."""
    if len(samples) != len(tree.tokens) + 1:
        raise ValueError(f"{len(samples)} samples for {len(tree.tokens)} drafts: one more sample than drafts is needed")
    out, nodes, node = [], [], -1
    while True:
        sample = samples[node + 1]
        out.append(sample)
        child = next((j for j, (token, parent) in enumerate(zip(tree.tokens, tree.parents))
                      if parent == node and token == sample), None)
        if child is None:
            return out, nodes
        nodes.append(child)
        node = child


def accept_drafts(samples: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """accept_tree for a chain of drafts: the drafts while the target's sample at each position
    equals them, then the target's sample where it differs (or after the last draft)."""
    return accept_tree(samples, DraftTree.chain(drafts))[0]
