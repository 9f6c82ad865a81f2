"""A batched sampler on PyTorch's operators following SGLang / Hugging Face conventions (greedy
rows' argmax in a small C kernel, argmax.c, where a compiler is at hand).

Per step, on a float32 copy of the logits [B, V]:
  1. logit_bias (added per token);
  2. repetition_penalty, HF-style, over every token id seen so far (prompt and output):
     positive logits are divided by the penalty, negative ones multiplied;
  3. frequency_penalty (penalty * count in the output) and presence_penalty (penalty once
     per token present in the output) are subtracted;
  4. while a request has produced fewer than min_new_tokens, its eos and stop token ids are
     set to -inf;
  5. tokens the batch's vocab mask (a grammar's constraint) forbids are set to -inf;
  6. greedy rows (temperature 0, or top_k 1) take the argmax; the others are divided by their
     temperature, filtered by top_k, top_p (SGLang: cumulative mass before a token > top_p
     drops it) and min_p (relative to the largest probability), then sampled.

Sampling uses the exponential race (argmax of probs / Exp(1) noise), in vocabulary order.
Unseeded rows share one batched draw from the global torch RNG; a row with `seed` set draws
its noise from its own generator seeded with (seed, output length), so its token does not
depend on what else is in the batch nor on the batch order.

logprobs / top_logprobs are the raw log-softmax of the model's logits (before penalties,
temperature and the vocab mask), computed only when some request asks for them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from srv.sdk.native import optional_c_library
from srv.sdk.sampling import SampleOutput, Sampler, SamplingBatch, SamplingParams

# Temperatures at or below this are treated as greedy (dividing by them would overflow).
_TEMPERATURE_EPS = 1e-5
_SEED_MULTIPLIER = 1_000_003
_SEED_MODULUS = 2**63


@functools.cache
def _argmax_kernel() -> ctypes.CDLL | None:
    """argmax.c, or None without a C compiler (torch's max then)."""
    library = optional_c_library(Path(__file__).with_name("argmax.c"), without="greedy tokens are taken by torch's max")
    if library is None:
        return None
    size = ctypes.c_int64
    library.srv_argmax_rows.argtypes = [ctypes.c_void_p, size, size, size, ctypes.c_void_p]
    library.srv_argmax_set_body.argtypes = [ctypes.c_int]
    return library


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (a NaN first of all): torch.max(x, -1).indices,
    by argmax.c for float32 rows on the CPU."""
    kernel = _argmax_kernel()
    if kernel is None or x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1 or x.device.type != "cpu" \
            or not x.shape[1]:
        return x.max(dim=-1).indices
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel.srv_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def _is_greedy(p: SamplingParams) -> bool:
    return p.greedy or p.temperature <= _TEMPERATURE_EPS


def _row_seed(seed: int, output_len: int) -> int:
    return (seed * _SEED_MULTIPLIER + output_len) % _SEED_MODULUS


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """A [R, L] int64 tensor of the id lists, padded with `pad` (L >= 1)."""
    width = max(1, max((len(r) for r in rows), default=0))
    data = [r + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(data, dtype=torch.int64, device=device)


def _token_mask(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Counts [R, V] of each token id per row (ids outside [0, V) are ignored)."""
    clean = [[t for t in r if 0 <= t < vocab] for r in rows]
    ids = _padded(clean, vocab, device)  # pad with an extra column that is dropped
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


class PyTorchSampler(Sampler):
    """Turns logits [B, V] into next tokens; see the module docstring for the semantics."""

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    # ------------------------------------------------------------------ penalties
    def _apply_logit_bias(self, x: torch.Tensor, params: list[SamplingParams]) -> None:
        vocab = x.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                for tok, bias in p.logit_bias.items():
                    tok = int(tok)
                    if 0 <= tok < vocab:
                        rows.append(i)
                        cols.append(tok)
                        vals.append(float(bias))
        if rows:
            dev = x.device
            x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                         torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)

    def _apply_repetition_penalty(self, x: torch.Tensor, batch: SamplingBatch) -> None:
        rows = [i for i, p in enumerate(batch.params) if p.repetition_penalty != 1.0]
        if not rows:
            return
        dev = x.device
        idx = torch.tensor(rows, device=dev)
        seen = _token_mask([batch.token_ids[i] for i in rows], x.shape[1], dev) > 0
        penalty = torch.tensor([batch.params[i].repetition_penalty for i in rows],
                               dtype=x.dtype, device=dev).unsqueeze(1)
        sub = x.index_select(0, idx)
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        x.index_copy_(0, idx, torch.where(seen, penalised, sub))

    def _apply_frequency_presence(self, x: torch.Tensor, batch: SamplingBatch) -> None:
        rows = [i for i, p in enumerate(batch.params)
                if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if not rows:
            return
        dev = x.device
        idx = torch.tensor(rows, device=dev)
        outputs = [batch.token_ids[i][batch.prompt_lens[i]:] for i in rows]
        counts = _token_mask(outputs, x.shape[1], dev)
        freq = torch.tensor([batch.params[i].frequency_penalty for i in rows],
                            dtype=x.dtype, device=dev).unsqueeze(1)
        pres = torch.tensor([batch.params[i].presence_penalty for i in rows],
                            dtype=x.dtype, device=dev).unsqueeze(1)
        delta = freq * counts + pres * (counts > 0).to(x.dtype)
        x.index_add_(0, idx, -delta)

    def _apply_min_new_tokens(self, x: torch.Tensor, batch: SamplingBatch) -> None:
        vocab = x.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(batch.params):
            if p.min_new_tokens > 0 and batch.output_len(i) < p.min_new_tokens:
                for tok in set(batch.eos_token_ids) | set(p.stop_token_ids):
                    if 0 <= tok < vocab:
                        rows.append(i)
                        cols.append(tok)
        if rows:
            dev = x.device
            x[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")

    # ------------------------------------------------------------------ sampling
    def _filtered_probs(self, x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Probabilities [R, V] (vocabulary order, not renormalised) after temperature,
        top_k, top_p and min_p, for non-greedy rows `x` [R, V] with `params`."""
        dev = x.device
        vocab = x.shape[1]
        temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)
        x = x / temps.unsqueeze(1)
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        need_k = any(k < vocab for k in top_ks)
        need_p = any(tp < 1.0 for tp in top_ps)
        need_min_p = any(mp > 0.0 for mp in min_ps)
        if not (need_k or need_p or need_min_p):
            return torch.softmax(x, dim=-1)

        probs_sort, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True, stable=True)
        if need_p:
            # mass strictly before each token, taken before the other filters (SGLang)
            mass_before = torch.cumsum(probs_sort, dim=-1) - probs_sort
        if need_k:
            ks = torch.tensor(top_ks, device=dev).unsqueeze(1)
            positions = torch.arange(vocab, device=dev).unsqueeze(0)
            probs_sort = probs_sort.masked_fill(positions >= ks, 0.0)
        if need_p:
            ps = torch.tensor(top_ps, dtype=x.dtype, device=dev).unsqueeze(1)
            probs_sort = probs_sort.masked_fill(mass_before > ps, 0.0)
        if need_min_p:
            mps = torch.tensor(min_ps, dtype=x.dtype, device=dev).unsqueeze(1)
            threshold = probs_sort[:, :1] * mps
            probs_sort = probs_sort.masked_fill(probs_sort < threshold, 0.0)
        return torch.zeros_like(probs_sort).scatter_(1, order, probs_sort)

    @staticmethod
    def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Exponential race: argmax(probs / Exp(1)) samples from probs (renormalised)."""
        noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return torch.argmax(probs / noise, dim=-1)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(f"logits must be [batch={len(batch)}, vocab], got {tuple(logits.shape)}")
        params = batch.params
        dev = logits.device
        # A copy only for the penalties, which write into it: the logprobs are the model's own. At 64
        # rows, copying every step's logits cost more than the argmax.
        adjusted = batch.vocab_mask is not None or any(
            p.logit_bias or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0 or p.min_new_tokens > 0 for p in params)
        x = logits.to(torch.float32, copy=adjusted)

        self._apply_logit_bias(x, params)
        self._apply_repetition_penalty(x, batch)
        self._apply_frequency_presence(x, batch)
        self._apply_min_new_tokens(x, batch)
        batch.mask_logits(x)

        next_ids = first_argmax(x)
        sampled = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if sampled:
            idx = torch.tensor(sampled, device=dev)
            sub_params = [params[i] for i in sampled]
            probs = self._filtered_probs(x.index_select(0, idx), sub_params)
            noise = torch.empty_like(probs)
            unseeded = [j for j, p in enumerate(sub_params) if p.seed is None]
            if len(unseeded) == len(sub_params):
                noise.exponential_()
            else:
                if unseeded:
                    noise[torch.tensor(unseeded, device=dev)] = torch.empty(
                        len(unseeded), probs.shape[1], dtype=probs.dtype, device=dev).exponential_()
                for j, p in enumerate(sub_params):
                    if p.seed is not None:
                        gen = torch.Generator(device=dev)
                        gen.manual_seed(_row_seed(p.seed, batch.output_len(sampled[j])))
                        noise[j].exponential_(generator=gen)
            next_ids = next_ids.index_copy(0, idx, self._race(probs, noise))

        out = SampleOutput(next_token_ids=next_ids.to(torch.int64))
        want_top = max((p.top_logprobs for p in params), default=0)
        if want_top > 0 or any(p.logprobs for p in params):
            logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
            out.logprobs = logp.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
            k = min(want_top, logp.shape[1])
            if k > 0:
                values, ids = torch.topk(logp, k, dim=-1)
                out.top_logprobs = (values, ids)
        return out
