"""Conformance kit for samplers (`--sampling-backend`)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from srv.sdk.sampling import Sampler, SamplingBatch, SamplingParams
from srv.sdk.testing.registry import create, registration

VOCAB = 64
EOS = 2


def make_batch(params: list[SamplingParams], histories: list[tuple[list[int], list[int]]] | None = None,
               eos_token_ids: tuple[int, ...] = (EOS,)) -> SamplingBatch:
    """A SamplingBatch; histories[i] = (prompt ids, output ids so far) of row i."""
    histories = histories or [([3, 4, 5], []) for _ in params]
    return SamplingBatch(params=params, token_ids=[p + o for p, o in histories],
                         prompt_lens=[len(p) for p, _ in histories], eos_token_ids=list(eos_token_ids))


def geometric_logits(ratio: float = 0.85, seed: int = 0) -> torch.Tensor:
    """Logits [VOCAB] whose probabilities decay geometrically over a random permutation of ids.

    No ties, and every filter boundary used by the kit is far from any token's mass."""
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    logits = torch.empty(VOCAB)
    logits[order] = torch.arange(VOCAB, dtype=torch.float32) * torch.log(torch.tensor(ratio))
    return logits


def allowed_tokens(logits: torch.Tensor, p: SamplingParams, eps: float = 1e-6) -> set[int]:
    """Tokens a sampler may pick under p.temperature, top_k, top_p and min_p.

    top_p as SGLang: a token is dropped when the probability mass of the tokens before it
    exceeds top_p; min_p: a token is dropped below min_p times the largest probability."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if 0 < p.top_k < VOCAB:
        keep &= torch.arange(VOCAB) < p.top_k
    keep &= mass_before <= p.top_p + eps
    keep &= sorted_probs >= p.min_p * sorted_probs[0] - eps
    return set(order[keep].tolist())


class SamplerKit:
    """Checks a sampler against the Sampler contract and srv's reference sampler.

        class TestMySampler(SamplerKit):
            backend_name = "my_sampler"          # the name your plugin registers, or:
            # sampler_factory = MySampler        # (server_args) -> Sampler

    `server_args` is what the factory receives (None unless you set it). Greedy rows after
    penalties are compared with `reference_name` (srv's "pytorch" sampler) on the same inputs.
    """

    backend_name: str | None = None
    sampler_factory: Callable[..., Sampler] | None = None
    reference_name: str = "pytorch"
    server_args: Any = None

    def make_sampler(self) -> Sampler:
        return create(self, "sampling", "backend_name", "sampler_factory", self.server_args)

    def make_reference(self) -> Sampler:
        return registration("sampling", self.reference_name).create(self.server_args)

    # ---- the tests -------------------------------------------------------------------------

    def test_returns_int64_token_per_row(self) -> None:
        params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                  SamplingParams(temperature=0.7, top_k=5, seed=3), SamplingParams(top_p=0.5)]
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(0))
        tokens = self.make_sampler().sample(logits, make_batch(params)).next_token_ids
        assert tokens.dtype == torch.int64, f"next_token_ids is {tokens.dtype}, must be int64"
        assert tokens.shape == (len(params),), f"next_token_ids is {tuple(tokens.shape)}, must be [B]"
        assert ((tokens >= 0) & (tokens < VOCAB)).all(), f"token ids outside the vocabulary: {tokens.tolist()}"

    def test_does_not_modify_logits(self) -> None:
        params = [SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={4: 2.0}),
                  SamplingParams(temperature=0.5, top_p=0.9, frequency_penalty=0.5)]
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
        before = logits.clone()
        self.make_sampler().sample(logits, make_batch(params, [([3, 4], [4, 5])] * 2))
        assert torch.equal(logits, before), "sample() changed the logits it was given"

    def test_greedy_rows_are_argmax(self) -> None:
        params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                  SamplingParams(top_k=1), SamplingParams(temperature=0, top_p=0.3, min_p=0.5),
                  SamplingParams(temperature=2.0, seed=5), SamplingParams(temperature=0, seed=9)]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
        for _ in range(3):
            tokens = self.make_sampler().sample(logits, make_batch(params)).next_token_ids
            assert tokens[greedy].tolist() == logits[greedy].argmax(-1).tolist(), "a greedy row is not the argmax"

    def test_seeded_rows_do_not_depend_on_the_batch(self) -> None:
        """A seeded row gets the same token whatever else is in the batch.

        Alone, among other rows (seeded or not, before or after it), and whatever the global
        torch RNG state."""
        g = torch.Generator().manual_seed(3)
        flat = torch.randn(VOCAB, generator=g) * 0.3  # many plausible tokens
        seeds = [11, 22, 33, 44, 55, 66, 77, 88]
        sampler = self.make_sampler()

        def tokens_of(rows: list[tuple[int | None, torch.Tensor]], rng_state: int) -> list[int]:
            params = [SamplingParams(temperature=1.0, seed=s) for s, _ in rows]
            logits = torch.stack([row for _, row in rows])
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(rng_state)
                return sampler.sample(logits, make_batch(params)).next_token_ids.tolist()

        alone = [tokens_of([(s, flat)], rng_state=1)[0] for s in seeds]
        noise = [(None, torch.randn(VOCAB, generator=g)), (1234, torch.randn(VOCAB, generator=g)), (None, flat)]
        together = tokens_of([(s, flat) for s in seeds] + noise, rng_state=2)[:len(seeds)]
        reversed_mixed = tokens_of(noise + [(s, flat) for s in reversed(seeds)], rng_state=3)[len(noise):][::-1]
        assert together == alone, f"seeded tokens changed with the batch: alone {alone}, batched {together}"
        assert reversed_mixed == alone, f"seeded tokens changed with the row order: {alone} vs {reversed_mixed}"
        assert len(set(alone)) > 1, f"eight seeds over {VOCAB} near-uniform tokens all gave {alone[0]}: not sampling"

    @pytest.mark.parametrize("filters", [
        dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(temperature=0.7, top_p=0.8),
        dict(top_k=8, top_p=0.9, min_p=0.05), dict(temperature=1.5, min_p=0.3),
    ], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
    def test_filters_never_choose_a_masked_token(self, filters: dict[str, float]) -> None:
        logits = geometric_logits()
        rows = 256
        params = [SamplingParams(**{"temperature": 1.0, **filters}, seed=i if i % 2 else None) for i in range(rows)]
        tokens = self.make_sampler().sample(logits.expand(rows, VOCAB).clone(), make_batch(params)).next_token_ids
        allowed = allowed_tokens(logits, params[0])
        chosen = set(tokens.tolist())
        assert chosen <= allowed, \
            f"{filters}: chose masked tokens {sorted(chosen - allowed)} (allowed {sorted(allowed)})"
        assert len(chosen) > 1, f"{filters}: {rows} draws over {len(allowed)} allowed tokens all gave one token"

    def test_penalties_match_reference(self) -> None:
        """Greedy rows after penalties pick the reference sampler's token.

        Penalties: logit_bias, repetition / frequency / presence penalties and min_new_tokens
        (see srv's pytorch sampler for the documented rules); rows without penalties stay the
        plain argmax."""
        g = torch.Generator().manual_seed(4)
        # (params, top token, runner-up, prompt, output so far, logit shift); the top two are
        # 3.0 and 2.7 (+ shift) so that every penalty below can swap them.
        specs = [
            (dict(repetition_penalty=1.5), [0], [1], 0.0),          # seen top: divided (positive logit)
            (dict(repetition_penalty=1.5), [0], [1], -6.0),         # seen top: multiplied (negative logit)
            (dict(repetition_penalty=0.8), [1], [], 0.0),           # < 1 rewards the seen runner-up
            (dict(frequency_penalty=0.2), [], [0, 0], 0.0),         # 2 x 0.2 in the output
            (dict(frequency_penalty=0.5), [0, 0], [1], 0.0),        # counts the output only
            (dict(frequency_penalty=-0.4), [], [1], 0.0),           # negative: rewards repeats
            (dict(presence_penalty=0.2), [], [0, 0, 0], 0.0),       # once, however often (2.8 > 2.7)
            (dict(presence_penalty=0.5), [0], [], 0.0),             # the prompt does not count
            (dict(logit_bias={"B": 0.5}), [], [], 0.0),             # bias on the runner-up
            (dict(logit_bias={"T": -1.0}, repetition_penalty=1.2, presence_penalty=0.1), [0], [0], 0.0),
            (dict(min_new_tokens=3), [], [5], 0.0),                 # eos (the top) masked, 1 < 3
            (dict(min_new_tokens=1), [], [5], 0.0),                 # satisfied: eos allowed
            (dict(min_new_tokens=2, stop_token_ids=["T"]), [], [], 0.0),
            (dict(), [0], [0, 0], 0.0),                             # no penalty: argmax
        ]
        params, histories, rows = [], [], []
        ids = (torch.randperm(VOCAB - 6, generator=g) + 6).tolist()  # never EOS nor the filler 5
        for i, (kwargs, prompt, output, shift) in enumerate(specs):
            top = EOS if "min_new_tokens" in kwargs and "stop_token_ids" not in kwargs else ids[2 * i]
            runner_up = ids[2 * i + 1]
            names = {0: top, 1: runner_up, 5: 5}
            kwargs = dict(kwargs, temperature=0)
            if "logit_bias" in kwargs:
                kwargs["logit_bias"] = {(runner_up if k == "B" else top): v for k, v in kwargs["logit_bias"].items()}
            if "stop_token_ids" in kwargs:
                kwargs["stop_token_ids"] = [top]
            row = torch.randn(VOCAB, generator=g) * 0.5
            row[top], row[runner_up] = 3.0, 2.7
            rows.append(row + shift)
            params.append(SamplingParams(**kwargs))
            histories.append(([3, 4] + [names[t] for t in prompt], [names[t] for t in output]))
        logits = torch.stack(rows)
        batch = make_batch(params, histories)
        expected = self.make_reference().sample(logits, batch).next_token_ids
        actual = self.make_sampler().sample(logits, batch).next_token_ids
        changed = (expected != logits.argmax(-1)).sum()
        assert changed >= len(specs) // 2, "kit self-check: the penalties should change most rows"
        wrong = [f"row {i} {specs[i][0]}: {a} (reference {e})"
                 for i, (a, e) in enumerate(zip(actual.tolist(), expected.tolist())) if a != e]
        assert not wrong, "greedy tokens after penalties differ from the reference:\n" + "\n".join(wrong)

    def test_logprobs_are_raw_log_softmax(self) -> None:
        """logprobs and top_logprobs are the raw log-softmax, before penalties and temperature.

        logprobs: [B], of the chosen tokens; top_logprobs: (values, ids), [B, k] for the
        largest k any row asked for."""
        params = [SamplingParams(temperature=0, logprobs=True),
                  SamplingParams(temperature=2.0, top_k=10, seed=1, logprobs=True, top_logprobs=3),
                  SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=1.0, top_logprobs=5),
                  SamplingParams(temperature=1.0, seed=2)]
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(5)) * 2
        out = self.make_sampler().sample(logits, make_batch(params, [([3, 4], [4, 7])] * len(params)))
        reference = torch.log_softmax(logits.double(), -1)
        assert out.logprobs is not None, "logprobs were requested but SampleOutput.logprobs is None"
        assert out.logprobs.shape == (len(params),), f"logprobs is {tuple(out.logprobs.shape)}, must be [B]"
        chosen = reference.gather(1, out.next_token_ids[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs.double(), chosen, atol=1e-5, rtol=1e-5)
        assert out.top_logprobs is not None, "top_logprobs were requested but SampleOutput.top_logprobs is None"
        values, ids = out.top_logprobs
        assert values.shape == ids.shape == (len(params), 5), f"top_logprobs are {tuple(values.shape)}, want [B, 5]"
        torch.testing.assert_close(values.double(), reference.topk(5, -1).values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reference.gather(1, ids.long()), values.double(), atol=1e-5, rtol=1e-5)

    def test_vocab_mask_is_obeyed_and_logprobs_stay_the_models(self) -> None:
        """No row chooses a token its vocab mask forbids (greedy, sampled, seeded), a free row
        is untouched, and the log-probabilities are the model's own, before the mask."""
        from srv.sdk.grammar import allocate_bitmask, bitmask_to_bool

        params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
                  SamplingParams(temperature=1.0, seed=4, logprobs=True, top_logprobs=5),
                  SamplingParams(temperature=0.8, top_p=0.9, logprobs=True, top_logprobs=5),
                  SamplingParams(temperature=0, logprobs=True, top_logprobs=5)]
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(6)) * 3
        bitmask = allocate_bitmask(len(params), VOCAB)
        favourites = logits.topk(8, -1).indices
        for row in range(3):   # rows 0-2 may choose only among three tokens the model likes little
            bitmask[row] = 0
            for token in logits[row].topk(VOCAB).indices[-3:].tolist():
                bitmask[row, token // 32] |= 1 << (token % 32)
        allowed = bitmask_to_bool(bitmask, VOCAB)
        batch = make_batch(params)
        batch.vocab_mask = bitmask
        for _ in range(5):
            out = self.make_sampler().sample(logits, batch)
            tokens = out.next_token_ids.tolist()
            bad = [f"row {i}: token {t}" for i, t in enumerate(tokens) if not allowed[i, t]]
            assert not bad, "a sampled token is one the vocab mask forbids: " + ", ".join(bad)
        assert tokens[3] == int(logits[3].argmax()), "a row the mask leaves free is not its argmax"
        reference = torch.log_softmax(logits.double(), -1)
        torch.testing.assert_close(out.logprobs.double(), reference.gather(1, out.next_token_ids[:, None]).squeeze(1),
                                   atol=1e-5, rtol=1e-5)
        values, ids = out.top_logprobs
        assert torch.isfinite(values).all(), "top log-probabilities must be finite: they are the model's, unmasked"
        assert ids[:, 0].tolist() == favourites[:, 0].tolist(), "top log-probabilities were taken after the mask"
