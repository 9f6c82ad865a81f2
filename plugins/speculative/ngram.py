"""NGRAM speculative decoding: the tokens that followed the request's latest n tokens where
they occurred before, in its prompt or its output, are its drafts (prompt lookup decoding).

Each request's n-grams (n from the min to the max match window) are indexed as its tokens are
verified, keeping the latest max-bfs-breadth places each ended. A step matches the longest
window first; the places it matched are branches (fewer for longer matches, from max down to
min breadth), each the tokens after it (reading on into the drafts past the sequence's end), and
the drafts follow them token by token, up to branch-length: BFS takes the most recent branch
still agreeing with the drafts so far, PROB the token most of those branches agree on. A request
is offered fewer drafts after a failed verify and more after one where all held, and none for a
while after one where none did (see `limits`).
The index holds at most --speculative-ngram-capacity token places over all requests; past it,
requests draft from what was already indexed.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from srv.sdk.speculative import DraftRequest, SpeculativeAlgorithm, SpeculativeContext


# Drafts offered to a request before any was verified.
INITIAL_DRAFTS = 4
# The longest a request whose drafts keep failing goes without drafts (decode steps).
MAX_PAUSE_STEPS = 16


class RequestIndex:
    """The n-grams of one request's tokens -> the latest positions where they ended."""

    def __init__(self, min_n: int, max_n: int, breadth: int) -> None:
        self.min_n, self.max_n, self.breadth = min_n, max_n, breadth
        self.ends: dict[tuple[int, ...], deque[int]] = {}
        self.tokens: list[int] = []

    def extend(self, tokens: list[int], limit: int) -> None:
        """Index `tokens` (the request's whole sequence, a continuation of what was indexed) up
        to `limit` new positions."""
        start = len(self.tokens)
        if len(tokens) < start or (start and tokens[start - 1] != self.tokens[-1]):
            self.ends.clear()   # not a continuation (a request's verified tokens only grow)
            self.tokens, start = [], 0
        stop = min(len(tokens), start + limit)
        self.tokens.extend(tokens[start:stop])
        for end in range(start, stop):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                key = tuple(self.tokens[end - n + 1: end + 1])
                places = self.ends.get(key)
                if places is None:
                    places = self.ends[key] = deque(maxlen=self.breadth)
                places.append(end)

    def match(self) -> tuple[int, list[int]]:
        """The longest window of the latest tokens seen before: (its length, where it ended
        before, oldest first); (0, []) when none was."""
        tokens, last = self.tokens, len(self.tokens) - 1
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            places = self.ends.get(tuple(tokens[last - n + 1:]))
            if places:
                earlier = [p for p in places if p < last]
                if earlier:
                    return n, earlier
        return 0, []


class NgramAlgorithm(SpeculativeAlgorithm):
    default_num_draft_tokens = 8

    def __init__(self, context: SpeculativeContext) -> None:
        super().__init__(context)
        self.ngram = self.config.ngram
        if self.ngram.match_type not in ("BFS", "PROB"):
            raise ValueError(f"--speculative-ngram-match-type {self.ngram.match_type!r}: BFS or PROB")
        self.indexes: dict[str, RequestIndex] = {}
        self.indexed = 0   # token places held over all requests
        # Drafts to offer each request next: a verify row costs a share of a decode step on a CPU,
        # so a request whose drafts fail gets fewer (one more than it last accepted), and one
        # whose drafts all held gets twice as many, up to the budget. One whose drafts fail
        # outright skips drafting for a while, twice as long each time (text that does not
        # repeat itself then costs almost nothing).
        self.limits: dict[str, int] = {}
        self.pauses: dict[str, tuple[int, int]] = {}   # rid -> (steps left, the next pause's length)

    def verified(self, request: DraftRequest, proposed: int, accepted: int) -> None:
        limit = 2 * proposed if accepted == proposed else accepted + 1
        self.limits[request.rid] = max(1, min(self.config.max_drafts, limit))
        if accepted:
            self.pauses.pop(request.rid, None)
        else:
            _, length = self.pauses.get(request.rid, (0, 1))
            self.pauses[request.rid] = (length, min(2 * length, MAX_PAUSE_STEPS))

    def release(self, rid: str) -> None:
        self.limits.pop(rid, None)
        self.pauses.pop(rid, None)
        index = self.indexes.pop(rid, None)
        if index is not None:
            self.indexed -= len(index.tokens)

    def _breadth(self, n: int) -> int:
        """Branches to follow for a match of n tokens: a longer match is surer, so fewer."""
        c = self.ngram
        span = c.max_match_window_size - c.min_match_window_size
        if span == 0:
            return c.max_bfs_breadth
        share = (n - c.min_match_window_size) / span
        return round(c.max_bfs_breadth - share * (c.max_bfs_breadth - c.min_bfs_breadth))

    def propose(self, requests: Sequence[DraftRequest], budgets: Sequence[int]) -> list[list[int]]:
        return [self._propose_one(req, budget) for req, budget in zip(requests, budgets)]

    def _propose_one(self, req: DraftRequest, budget: int) -> list[int]:
        c = self.ngram
        left, length = self.pauses.get(req.rid, (0, 0))
        if left:
            self.pauses[req.rid] = (left - 1, length)
            return []
        index = self.indexes.get(req.rid)
        if index is None:
            index = self.indexes[req.rid] = RequestIndex(c.min_match_window_size, c.max_match_window_size,
                                                         c.max_bfs_breadth)
        tokens = req.token_ids
        before = len(index.tokens)
        index.extend(tokens, max(0, c.capacity - self.indexed))
        self.indexed += len(index.tokens) - before
        if len(index.tokens) < len(tokens):
            return []   # over capacity: the latest tokens are not indexed, so nothing matches them
        n, places = index.match()
        if not n:
            return []
        length = min(budget, c.branch_length, self.limits.get(req.rid, INITIAL_DRAFTS))
        drafts: list[int] = []

        def token_at(i: int) -> int:   # of the sequence the drafts continue
            return tokens[i] if i < len(tokens) else drafts[i - len(tokens)]

        # Where each branch reads its next token. A branch that reaches the sequence's end reads
        # on into the drafts: a match that close to the end is text repeating itself with that
        # period (a word over and over), and the drafts repeat it too.
        live = [p + 1 for p in places[-self._breadth(n):]]
        while len(drafts) < length and live:
            if c.match_type == "BFS":
                token = token_at(live[-1])
            else:
                counts = Counter(token_at(i) for i in live)
                best = max(counts.values())
                token = next(token_at(i) for i in reversed(live) if counts[token_at(i)] == best)
            drafts.append(token)
            live = [i + 1 for i in live if token_at(i) == token]
        return drafts
