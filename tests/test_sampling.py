"""The built-in PyTorch sampler plugin (srv.plugins.sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from srv.plugins.sampling.pytorch_sampler import PyTorchSampler, _argmax_kernel, first_argmax
from srv.sdk.sampling import SampleOutput, SamplingBatch, SamplingParams

V = 8
EOS = 7


def make_batch(params, token_ids=None, prompt_lens=None, eos=(EOS,)):
    n = len(params)
    token_ids = token_ids if token_ids is not None else [[0, 1, 2] for _ in range(n)]
    prompt_lens = prompt_lens if prompt_lens is not None else [len(t) for t in token_ids]
    return SamplingBatch(params=list(params), token_ids=[list(t) for t in token_ids],
                         prompt_lens=list(prompt_lens), eos_token_ids=list(eos))


@pytest.fixture
def sampler():
    return PyTorchSampler(None)


def random_logits(b, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


def test_greedy_is_argmax(sampler):
    logits = random_logits(5)
    out = sampler.sample(logits, make_batch([SamplingParams(temperature=0.0)] * 5))
    assert isinstance(out, SampleOutput)
    assert out.next_token_ids.dtype == torch.int64 and out.next_token_ids.shape == (5,)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_greedy_ties_take_the_first_largest_as_argmax_does(sampler, rows):
    """Logits rounded to bf16 tie often: greedy must pick what torch.argmax (HF's greedy) picks,
    the first of equal largest values, and a NaN before any number, at every batch size."""
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 49152, generator=g).bfloat16().float()
    for r in range(rows):
        logits[r, torch.randint(0, 49152, (4,), generator=g)] = logits[r].max() + 1
    logits[0, [300, 40]] = float("nan")
    out = sampler.sample(logits, make_batch([SamplingParams(temperature=0.0)] * rows))
    assert torch.equal(out.next_token_ids, torch.argmax(logits, -1))
    assert int(out.next_token_ids[0]) == 40


@pytest.mark.parametrize("body", [0, 1, 2], ids=["c", "avx2", "avx512"])
def test_greedy_kernel_takes_the_first_largest_on_every_body(body):
    """argmax.c's bodies (a body the CPU lacks runs its best instead): ties, NaNs, infinities,
    signed zeros, rows shorter than a vector and rows apart in memory, against torch.max."""
    kernel = _argmax_kernel()
    if kernel is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(body)
    kernel.srv_argmax_set_body(body)
    try:
        for rows, n in [(1, 49152), (3, 1001), (2, 17), (1, 1), (5, 7)]:
            for case in range(5):
                x = torch.randn(rows, n, generator=g)
                if case == 1:
                    x = torch.randint(-3, 3, (rows, n), generator=g).float()
                elif case == 2:
                    x[:, ::5] = float("nan")
                elif case == 3:
                    x.fill_(-math.inf)
                    x[-1, n // 2] = math.inf
                elif case == 4:
                    x.fill_(0.0)
                    x[:, ::2] = -0.0
                assert torch.equal(first_argmax(x), x.max(dim=-1).indices), (rows, n, case)
        wide = torch.randn(4, 300, generator=g)[:, 10:290]
        assert torch.equal(first_argmax(wide), wide.max(dim=-1).indices)
    finally:
        kernel.srv_argmax_set_body(-1)


def test_input_logits_are_not_modified(sampler):
    logits = random_logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5, frequency_penalty=0.5,
                             logit_bias={1: 2.0})] * 3
    sampler.sample(logits, make_batch(params))
    assert torch.equal(logits, before)


def test_low_temperature_behaves_like_greedy(sampler):
    logits = random_logits(4)
    torch.manual_seed(0)
    for _ in range(50):
        out = sampler.sample(logits, make_batch([SamplingParams(temperature=1e-3)] * 4))
        assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_top_k_one_equals_greedy(sampler):
    logits = random_logits(6)
    torch.manual_seed(1)
    for _ in range(30):
        out = sampler.sample(logits, make_batch([SamplingParams(temperature=1.5, top_k=1)] * 6))
        assert torch.equal(out.next_token_ids, logits.argmax(-1))


def draw_many(sampler, logits_row, params, n=2000, seed=1234):
    torch.manual_seed(seed)
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    return sampler.sample(logits, make_batch([params] * n)).next_token_ids


def test_top_k_stays_in_the_top_k(sampler):
    row = torch.tensor([1.0, 0.5, 0.9, 0.1, 0.8, 0.0, 0.2, 0.3])
    ids = draw_many(sampler, row, SamplingParams(temperature=1.0, top_k=3))
    allowed = set(row.topk(3).indices.tolist())  # {0, 2, 4}
    assert set(ids.tolist()) == allowed


def test_top_p_stays_in_the_nucleus(sampler):
    probs = torch.tensor([0.4, 0.05, 0.3, 0.05, 0.1, 0.04, 0.03, 0.03])
    row = probs.log()
    ids = draw_many(sampler, row, SamplingParams(temperature=1.0, top_p=0.75))
    # sorted: 0.4 (before 0), 0.3 (before 0.4), 0.1 (before 0.7), 0.05 (before 0.8 > 0.75: dropped)
    assert set(ids.tolist()) == {0, 2, 4}


def test_min_p_drops_unlikely_tokens(sampler):
    probs = torch.tensor([0.5, 0.2, 0.15, 0.04, 0.04, 0.03, 0.02, 0.02])
    row = probs.log()
    ids = draw_many(sampler, row, SamplingParams(temperature=1.0, min_p=0.25))  # threshold 0.125
    assert set(ids.tolist()) == {0, 1, 2}


def test_filters_are_per_row(sampler):
    row = torch.tensor([1.0, 0.5, 0.9, 0.1, 0.8, 0.0, 0.2, 0.3])
    n = 500
    logits = row.unsqueeze(0).repeat(2 * n, 1)
    params = [SamplingParams(top_k=2), SamplingParams()] * n
    torch.manual_seed(5)
    ids = sampler.sample(logits, make_batch(params)).next_token_ids
    assert set(ids[0::2].tolist()) == {0, 2}
    assert len(set(ids[1::2].tolist())) > 4


def test_sampling_approximates_softmax(sampler):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 40000
    ids = draw_many(sampler, row, SamplingParams(temperature=1.0), n=n, seed=7)
    freq = torch.bincount(ids, minlength=V).float() / n
    assert torch.allclose(freq, torch.softmax(row, -1), atol=0.01)


def test_temperature_sharpens_the_distribution(sampler):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 40000
    ids = draw_many(sampler, row, SamplingParams(temperature=0.5), n=n, seed=8)
    freq = torch.bincount(ids, minlength=V).float() / n
    assert torch.allclose(freq, torch.softmax(row / 0.5, -1), atol=0.01)




def penalised(sampler, logits_row, params, token_ids, prompt_len):
    """The sampler's penalised logits for one row, through its (internal) penalty steps."""
    x = logits_row.unsqueeze(0).clone().float()
    batch = make_batch([params], token_ids=[token_ids], prompt_lens=[prompt_len])
    sampler._apply_logit_bias(x, batch.params)
    sampler._apply_repetition_penalty(x, batch)
    sampler._apply_frequency_presence(x, batch)
    sampler._apply_min_new_tokens(x, batch)
    return x[0]


def test_repetition_penalty_matches_hand_computation(sampler):
    row = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0, 0.0, 3.0, -2.0])
    tokens = [0, 1, 1, 3]  # prompt [0, 1], output [1, 3]
    got = penalised(sampler, row, SamplingParams(repetition_penalty=2.0), tokens, 2)
    want = torch.tensor([1.0, -2.0, 0.5, -1.0, 1.0, 0.0, 3.0, -2.0])
    assert torch.allclose(got, want)


def test_frequency_and_presence_penalties_use_the_output_only(sampler):
    row = torch.zeros(V)
    tokens = [4, 4, 4, 1, 1, 1, 2]  # prompt [4, 4, 4], output [1, 1, 1, 2]
    got = penalised(sampler, row, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), tokens, 3)
    want = torch.zeros(V)
    want[1] = -(0.5 * 3 + 0.25)
    want[2] = -(0.5 * 1 + 0.25)
    assert torch.allclose(got, want)


def test_penalties_change_the_greedy_choice(sampler):
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0]] * 3)
    tokens = [[0, 2, 2, 2]] * 3  # prompt [0], output [2, 2, 2]
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    out = sampler.sample(logits, make_batch(params, token_ids=tokens, prompt_lens=[1] * 3))
    assert out.next_token_ids.tolist() == [2, 3, 3]


def test_logit_bias_forces_a_token(sampler):
    logits = random_logits(4)
    params = [SamplingParams(temperature=1.0, logit_bias={5: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={"3": 100.0}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_p=0.9, logit_bias={0: 1e4})]
    torch.manual_seed(3)
    for _ in range(20):
        out = sampler.sample(logits, make_batch(params))
        assert out.next_token_ids.tolist() == [5, 3, logits[2].argmax().item(), 0]


def test_min_new_tokens_blocks_eos_until_reached(sampler):
    logits = torch.full((1, V), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 6] = 9.0
    logits[0, 2] = 1.0
    p = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[6])
    prompt = [0, 1]
    for produced in range(3):
        batch = make_batch([p], token_ids=[prompt + [2] * produced], prompt_lens=[2])
        assert sampler.sample(logits, batch).next_token_ids.item() == 2
    batch = make_batch([p], token_ids=[prompt + [2] * 3], prompt_lens=[2])
    assert sampler.sample(logits, batch).next_token_ids.item() == EOS


def test_seed_is_independent_of_batch_composition_and_order(sampler):
    g = torch.Generator().manual_seed(11)
    vocab = 50
    logits_a = torch.randn(vocab, generator=g)  # flat-ish: many plausible tokens
    logits_other = torch.randn(3, vocab, generator=g)
    pa = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=7),
              SamplingParams(temperature=0.0)]
    prompt = [1, 2, 3]

    seq_alone, seq_front, seq_back, seq_other_seed = [], [], [], []
    for step in range(12):
        tokens_a = prompt + list(range(step))
        alone = sampler.sample(logits_a.unsqueeze(0), make_batch([pa], token_ids=[tokens_a], prompt_lens=[3]))
        seq_alone.append(alone.next_token_ids.item())

        torch.manual_seed(step)
        batch = make_batch([pa] + others, token_ids=[tokens_a] + [prompt] * 3, prompt_lens=[3] * 4)
        out = sampler.sample(torch.cat([logits_a.unsqueeze(0), logits_other]), batch)
        seq_front.append(out.next_token_ids[0].item())

        torch.manual_seed(1000 + step)
        batch = make_batch(others[::-1] + [pa], token_ids=[prompt] * 3 + [tokens_a], prompt_lens=[3] * 4)
        out = sampler.sample(torch.cat([logits_other.flip(0), logits_a.unsqueeze(0)]), batch)
        seq_back.append(out.next_token_ids[3].item())

        pb = SamplingParams(temperature=1.0, top_p=0.95, seed=43)
        out = sampler.sample(logits_a.unsqueeze(0), make_batch([pb], token_ids=[tokens_a], prompt_lens=[3]))
        seq_other_seed.append(out.next_token_ids.item())

    assert seq_alone == seq_front == seq_back
    assert len(set(seq_alone)) > 1  # the seed advances with the position
    assert seq_other_seed != seq_alone


def test_seeded_rows_follow_the_distribution(sampler):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20000
    logits = row.unsqueeze(0).repeat(n, 1)
    batch = make_batch([SamplingParams(seed=s) for s in range(n)], token_ids=[[0]] * n)
    ids = sampler.sample(logits, batch).next_token_ids
    freq = torch.bincount(ids, minlength=V).float() / n
    assert torch.allclose(freq, torch.softmax(row, -1), atol=0.015)


def test_logprobs_are_raw_log_softmax(sampler):
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.3, logprobs=True),
              SamplingParams(temperature=0.0, top_logprobs=3, logit_bias={2: 50.0}),
              SamplingParams(temperature=1.0, top_logprobs=1)]
    torch.manual_seed(2)
    out = sampler.sample(logits, make_batch(params))
    raw = torch.log_softmax(logits, -1)
    chosen = out.next_token_ids
    assert chosen[1].item() == 2
    assert torch.allclose(out.logprobs, raw.gather(1, chosen.unsqueeze(1)).squeeze(1))
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (3, 3)
    want_values, want_ids = raw.topk(3, dim=-1)
    assert torch.allclose(values, want_values) and torch.equal(ids, want_ids)


def test_logprobs_without_top_logprobs(sampler):
    logits = random_logits(2)
    out = sampler.sample(logits, make_batch([SamplingParams(temperature=0.0, logprobs=True),
                                             SamplingParams(temperature=0.0)]))
    assert out.top_logprobs is None
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1))


def test_half_precision_logits(sampler):
    logits = random_logits(3).to(torch.bfloat16)
    out = sampler.sample(logits, make_batch([SamplingParams(temperature=0.0, logprobs=True)] * 3))
    assert torch.equal(out.next_token_ids, logits.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32 and all(math.isfinite(v) for v in out.logprobs.tolist())


def test_plugin_is_registered():
    from srv.plugin_manager import PluginManager

    pm = PluginManager()
    pm.load_entry_points()
    registry = pm.build_registry()
    registration = registry.choose("sampling", "pytorch")
    assert registration.priority == 10 and registration.description
    assert isinstance(registration.create(None), PyTorchSampler)
