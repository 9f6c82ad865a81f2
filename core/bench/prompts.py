"""Prompts made locally from a seed: random sequences of common English words, no download.

Lengths are in tokens. With a tokenizer (`--tokenizer PATH`, any Hugging Face tokenizer folder)
every prompt has exactly the drawn number of tokens under that tokenizer (the server's own
count can differ by the special tokens it adds, e.g. a BOS token or a chat template). Without
one, one word counts as one token: the embedded words are common enough that byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen, SmolLM...) mostly encode each as a single token, so lengths are
close but not exact.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

WORDS = """
the of and to in is was for on that with as by at from his it an were are which this be has
had or not but their they have one its first new after who also been two more other all time
when there can into would only most she some over years her many such may where up then these
city world state people during out three made about year him use than part while so between
known later under both each state school since city them before like through high well however
four used number great way work family long found small series including day our game because
well life water name end film music team place left did house year local show right what early
second under very good any next must large around book often power how back never war public own
same place down old national last general found major much called even within until form group
several still will house five best area law point system history best order light set help love
hand king man word land river play live came went home study open care side line face city body
fact head line mind door room week road girl boy child woman market paper money story month lot
rest job kind country field field close human level plan free young real life south north east
west art color food tree city sea sun moon star rain snow wind fire earth stone wood glass metal
gold silver iron horse bird fish dog cat cow sheep bread milk tea wine apple rice salt sugar
table chair bed window wall floor roof garden farm town village road bridge train ship car plane
bank shop hotel office church hospital park street station island mountain valley forest lake
ocean desert voice song dance game sport ball race prize gift letter note page line sign picture
image movie radio phone computer machine engine wheel tool key box bag bottle cup plate knife
spoon clock watch coat shirt dress shoe hat ring stone heart blood bone skin hair eye ear nose
mouth tooth arm leg foot finger doctor teacher student worker driver farmer writer artist leader
player friend mother father sister brother son daughter husband wife baby parent guest enemy
army police court judge price cost value trade trust truth peace health science nature energy
reason result effect cause change chance choice course design detail event example feeling
future idea interest issue matter method model moment nation period position problem process
program question record report role rule season sense service situation size skill society
source space speed step subject success surface term test theory thing thought type unit view
simple quick quiet happy strong short tall warm cold hot dry wet dark bright clean fresh full
empty heavy light soft hard rich poor easy busy ready safe sure true wide deep fast slow late
early near far green blue red white black brown yellow gray pink
""".split()
# De-duplicated, order kept: the draw depends only on the seed.
WORDS = list(dict.fromkeys(WORDS))


@dataclass
class Prompt:
    text: str
    input_len: int      # tokens by the local tokenizer, or words without one
    output_len: int
    token_ids: list[int] | None = None


def draw_lengths(rng: random.Random, count: int, length: int, range_ratio: float) -> list[int]:
    """`count` lengths uniform in [length * range_ratio, length] (SGLang's random dataset)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1], not {range_ratio}")
    low = max(1, int(math.ceil(length * range_ratio))) if length > 0 else 0
    return [rng.randint(low, length) if length > 0 else 0 for _ in range(count)]




class PromptGenerator:
    """Word sequences of exact token lengths (with a tokenizer) or of that many words (without)."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.words = list(WORDS)
            self._cost_first = self._cost_next = {w: 1 for w in WORDS}
            return
        # The token cost of each word at the start of a text and after a space; byte-level BPE
        # splits on spaces first, so a text's length is the sum of its words' costs.
        encode = self._encode
        self._cost_first = {w: len(encode(w)) for w in WORDS}
        self._cost_next = {w: len(encode(" " + w)) for w in WORDS}
        self.words = [w for w in WORDS if self._cost_first[w] == 1 and self._cost_next[w] == 1] or list(WORDS)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self._encode(text)) if self.tokenizer is not None else len(text.split())

    def words_for(self, rng: random.Random, tokens: int, first: bool = True) -> list[str]:
        """Random words costing `tokens` in all (each word 1 token where the tokenizer allows)."""
        words: list[str] = []
        total, misses = 0, 0
        while total < tokens and misses < 100:   # `text` fixes what a miss leaves short
            word = rng.choice(self.words)
            cost = (self._cost_first if first and not words else self._cost_next)[word]
            if total + cost > tokens:
                misses += 1
                continue
            words.append(word)
            total += cost
        return words

    def text(self, rng: random.Random, tokens: int, prefix: str = "") -> tuple[str, list[int] | None]:
        """`prefix` followed by words: exactly `tokens` more tokens when a tokenizer is set."""
        body = self.words_for(rng, tokens, first=not prefix)
        text = self._join(prefix, body)
        if self.tokenizer is None:
            return text, None
        # Merges across words are rare but possible: trim or extend one word at a time.
        target = self.count(prefix) + tokens if prefix else tokens
        for _ in range(64):
            ids = self._encode(text)
            if len(ids) == target:
                return text, ids
            if len(ids) > target and body:
                body.pop()
            else:
                body.append(rng.choice(self.words))
            text = self._join(prefix, body)
        raise RuntimeError(f"could not build a prompt of exactly {target} tokens")

    @staticmethod
    def _join(prefix: str, words: list[str]) -> str:
        body = " ".join(words)
        return f"{prefix} {body}" if prefix and body else prefix or body


def generate_prompts(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 1.0,
                     seed: int = 0, shared_prefix_len: int = 0, tokenizer: Any | None = None,
                     num_shared_prefixes: int = 1) -> list[Prompt]:
    """`num_prompts` prompts, the same for the same arguments.

    Each prompt is the shared prefix (`shared_prefix_len` tokens, identical in every prompt)
    followed by its own words: `input_len` is drawn in [input_len * range_ratio, input_len]
    and counts the prompt's own part, so a prompt has shared_prefix_len + input_len tokens.
    With `num_shared_prefixes` N > 1 there are N distinct prefixes, prompt i taking prefix i mod N
    (N system prompts cycled by the clients).
    """
    rng = random.Random(seed)
    generator = PromptGenerator(tokenizer)
    input_lens = draw_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = draw_lengths(rng, num_prompts, output_len, range_ratio)
    prefixes = [generator.text(rng, shared_prefix_len)[0] if shared_prefix_len > 0 else ""
                for _ in range(max(1, num_shared_prefixes))]
    prompts = []
    for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
        text, ids = generator.text(rng, n_in, prefixes[i % len(prefixes)])
        length = len(ids) if ids is not None else len(text.split())
        prompts.append(Prompt(text, length, n_out, ids))
    return prompts


def random_token_ids(rng: random.Random, length: int, vocab_size: int, low: int = 10) -> list[int]:
    """Random token ids in [low, vocab_size): the offline benchmarks' prompts."""
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def arrival_times(count: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of `request_rate` requests per
    second: exponential gaps from a seeded generator; all zero for an infinite rate."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, not {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times
