"""STANDALONE speculative decoding: a smaller model with the target's vocabulary
(--speculative-draft-model-path) drafts each step's tokens greedily, one draft-model pass per
draft (--speculative-num-steps), on its own KV cache."""

from __future__ import annotations

from typing import Sequence

from srv.sdk.speculative import DraftRequest, SpeculativeAlgorithm, SpeculativeContext


class StandaloneAlgorithm(SpeculativeAlgorithm):
    default_num_draft_tokens = 4

    def __init__(self, context: SpeculativeContext) -> None:
        super().__init__(context)
        if not self.config.draft_model_path:
            raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path")
        self.draft = context.load_draft_model(self.config.draft_model_path)
        self.steps = min(self.config.num_steps, self.config.max_drafts)

    def release(self, rid: str) -> None:
        self.draft.release(rid)

    def propose(self, requests: Sequence[DraftRequest], budgets: Sequence[int]) -> list[list[int]]:
        contexts = [req.token_ids for req in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        for _ in range(self.steps):
            active = [i for i, budget in enumerate(budgets) if len(drafts[i]) < budget]
            if not active:
                break
            logits = self.draft.next_token_logits([(requests[i].rid, contexts[i] + drafts[i]) for i in active])
            if logits is None:   # the draft model's cache is full: draft what there is
                break
            for i, token in zip(active, logits.argmax(-1).tolist()):
                drafts[i].append(token)
        return drafts
