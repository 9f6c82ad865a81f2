"""The measured workloads: one concurrency sweep whose points double as W1 and W3, W2 in two shapes,
and W1 again beside a CPU hog.

Every request has 128 prompt tokens and 128 output tokens (ignore_eos), so the requests of a wave
start and finish together and a second wave would only repeat the first: from 16 streams up one
wave is sent (64 streams already take a minute per engine on two cores), below that two waves, at
least 4 requests, give the latencies a few more samples for a few seconds. The quick mode sends
one wave per point, at least 2 requests.

W2 shares a 512-token prefix: as a burst (16 clients start at once, one request each: the first
minutes of a new system prompt) and steady (16 clients, three requests each, each client sending
its next when its last ends: the shape a served system prompt sees most of the time). W1 beside a
hog is W1 while another process keeps one of the machine's cores busy, as on a shared machine.

W5 is one stream whose output repeats its input (a chat request to repeat 128 words): what n-gram
speculative decoding is for. It and W3 run once more on srv with `--speculative-algorithm NGRAM`
(workloads named `-ngram`), the rows that compare speculation with srv's default.

W3, W1 and the 64-stream point run again on srv with `--quantization w8a8_int8` (`-int8`), and W1
and the 64-stream point on srv's dense float32 (`--quantization none --dtype float32`,
`-float32`): the rows that compare int8 compute with float32 and with the peers.

W3 and W1 run again on srv split four ways: `--tp-size 2` (two ranks of one torch thread),
`--pp-size 2` (two pipeline stages of one thread), `--dp-size 2` (two scheduler groups of one
thread) and data-parallel attention (two scheduler groups whose feed-forward blocks split across
both), against srv's default (one process of two threads) in the same repetition: `-tp2`,
`-pp2`, `-dp2` and `-dpattn`.

W1 runs once more on srv serving four random LoRA adapters (rank 16, every linear layer), each
request on one of them in turn (`-lora4`): what serving many fine-tunes of one model costs; and
again on the `torch` LoRA backend (`-lora4-torch`): what srv's own CPU kernel is worth.

W6 does not fit the KV pool: 8 distinct 1,024-token system prompts cycled by 16 clients, on srv
launched with a pool of about two requests' context (`--max-total-tokens`), without and with
the hierarchical cache (a host tier holding all eight prompts): what the host tier is for. Eight
warm-up requests, one with each prompt, come first: a server meets these prompts all day, and
the measured requests are that steady state, not the first computation of each prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

INPUT_LEN = 128
OUTPUT_LEN = 128
SHARED_PREFIX_LEN = 512
SWEEP = (1, 4, 16, 64)
W1_CONCURRENCY = 16
W3_CONCURRENCY = 1
W2_CONCURRENCY = 16


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    num_prompts: int
    input_len: int = INPUT_LEN
    output_len: int = OUTPUT_LEN
    shared_prefix_len: int = 0
    hog: bool = False          # a busy process on one core while it runs
    endpoint: str = "completions"
    instruction: str = ""      # before each prompt's words (srv bench serve --instruction)
    srv_flags: tuple[str, ...] = ()   # served by srv launched with these flags, not by the peers
    num_shared_prefixes: int = 1      # distinct shared prefixes, cycled (srv bench serve --num-shared-prefixes)
    warmup_requests: int = 1          # sent one at a time before the measured ones
    lora_adapters: int = 0            # srv serves this many random adapters, requests cycle through them

    @property
    def speculative(self) -> bool:
        return "--speculative-algorithm" in self.srv_flags

    @property
    def context_tokens(self) -> int:
        """Tokens one request occupies at its end: what a server slot must hold."""
        return self.shared_prefix_len + self.input_len + self.output_len


TWO_WAVES_UP_TO = 8     # prompts


def num_prompts(concurrency: int, quick: bool) -> int:
    if quick:
        return max(concurrency, 2)
    return max(concurrency, min(2 * concurrency, TWO_WAVES_UP_TO), 4)


def sweep_name(concurrency: int) -> str:
    return f"c{concurrency}"


W1 = sweep_name(W1_CONCURRENCY)
W3 = sweep_name(W3_CONCURRENCY)
W2 = f"prefix{W2_CONCURRENCY}"
W2_STEADY = f"{W2}-steady"
W1_HOG = f"{W1}-hog"
STEADY_REQUESTS_PER_CLIENT = 3
W5 = "repeat"
W5_NGRAM = f"{W5}-ngram"
W3_NGRAM = f"{W3}-ngram"
REPEAT_INSTRUCTION = "Repeat this text exactly:"
NGRAM_FLAGS = ("--speculative-algorithm", "NGRAM")
INT8_FLAGS = ("--quantization", "w8a8_int8")
FLOAT32_FLAGS = ("--quantization", "none", "--dtype", "float32")
C64 = sweep_name(64)
W3_INT8, W1_INT8, C64_INT8 = (f"{w}-int8" for w in (W3, W1, C64))
W3_FLOAT32, W1_FLOAT32, C64_FLOAT32 = (f"{w}-float32" for w in (W3, W1, C64))
# The file dequantized, in the served dtype (bf16 where the CPU computes it, else float32): a
# dense checkpoint's decode, against its bandwidth floor.
DENSE_FLAGS = ("--quantization", "none")
W3_DENSE = f"{W3}-dense"
W6_PREFIXES, W6_PREFIX_LEN, W6_OUTPUT_LEN, W6_REQUESTS_PER_CLIENT = 8, 1024, 32, 2
# About two requests' context (1,024 + 128 in, 32 out): the pool holds two of the eight prompts.
W6_POOL_TOKENS = 2400
W6 = f"prefixes{W6_PREFIXES}"
W6_HICACHE = f"{W6}-hicache"
W6_FLAGS = ("--max-total-tokens", str(W6_POOL_TOKENS))
# A host tier of four pools (9,600 tokens) holds all eight prompts.
W6_HICACHE_FLAGS = (*W6_FLAGS, "--enable-hierarchical-cache", "--hicache-ratio", "4")


TP2_FLAGS = ("--tp-size", "2")
PP2_FLAGS = ("--pp-size", "2")
DP2_FLAGS = ("--dp-size", "2")
DP_ATTENTION_FLAGS = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--enable-dp-lm-head")
W3_TP2, W1_TP2 = (f"{w}-tp2" for w in (W3, W1))
W3_PP2, W1_PP2 = (f"{w}-pp2" for w in (W3, W1))
W3_DP2, W1_DP2 = (f"{w}-dp2" for w in (W3, W1))
W3_DP_ATTENTION, W1_DP_ATTENTION = (f"{w}-dpattn" for w in (W3, W1))
LORA_ADAPTERS = 4
W1_LORA = f"{W1}-lora{LORA_ADAPTERS}"
LORA_FLAGS = ("--max-loras-per-batch", str(LORA_ADAPTERS))   # and --lora-paths, made by the srv engine
W1_LORA_TORCH = f"{W1_LORA}-torch"
LORA_TORCH_FLAGS = LORA_FLAGS + ("--lora-backend", "torch")


# What a peer's candidate configurations are compared on: one wave of W1.
PROBE = Workload("probe", W1_CONCURRENCY, W1_CONCURRENCY)


def workloads(quick: bool) -> list[Workload]:
    """The sweep in increasing concurrency, the shared-prefix workload (burst, then steady), W1
    beside a hog, W5; then W3 and W5 again for srv with NGRAM, the int8, float32 and dense points, W6, and W3
    and W1 split four ways, and W1 on LoRA adapters."""
    sweep = [Workload(sweep_name(c), c, num_prompts(c, quick)) for c in SWEEP]
    burst = Workload(W2, W2_CONCURRENCY, num_prompts(W2_CONCURRENCY, quick), shared_prefix_len=SHARED_PREFIX_LEN)
    steady = Workload(W2_STEADY, W2_CONCURRENCY, W2_CONCURRENCY * (1 if quick else STEADY_REQUESTS_PER_CLIENT),
                      shared_prefix_len=SHARED_PREFIX_LEN)
    hog = Workload(W1_HOG, W1_CONCURRENCY, num_prompts(W1_CONCURRENCY, quick), hog=True)
    repeat = Workload(W5, 1, num_prompts(1, quick), endpoint="chat", instruction=REPEAT_INSTRUCTION)
    speculative = [Workload(W3_NGRAM, 1, num_prompts(1, quick), srv_flags=NGRAM_FLAGS),
                   Workload(W5_NGRAM, 1, num_prompts(1, quick), endpoint="chat", instruction=REPEAT_INSTRUCTION,
                            srv_flags=NGRAM_FLAGS)]
    int8 = [Workload(name, c, num_prompts(c, quick), srv_flags=INT8_FLAGS)
            for name, c in ((W3_INT8, 1), (W1_INT8, W1_CONCURRENCY), (C64_INT8, 64))]
    float32 = [Workload(name, c, num_prompts(c, quick), srv_flags=FLOAT32_FLAGS)
               for name, c in ((W3_FLOAT32, 1), (W1_FLOAT32, W1_CONCURRENCY), (C64_FLOAT32, 64))]
    dense = [Workload(W3_DENSE, 1, num_prompts(1, quick), srv_flags=DENSE_FLAGS)]
    hierarchical = [Workload(name, W2_CONCURRENCY, W2_CONCURRENCY * (1 if quick else W6_REQUESTS_PER_CLIENT),
                             output_len=W6_OUTPUT_LEN, shared_prefix_len=W6_PREFIX_LEN,
                             num_shared_prefixes=W6_PREFIXES, warmup_requests=W6_PREFIXES, srv_flags=flags)
                    for name, flags in ((W6, W6_FLAGS), (W6_HICACHE, W6_HICACHE_FLAGS))]
    parallel = [Workload(name, c, num_prompts(c, quick), srv_flags=flags)
                for name, c, flags in ((W3_TP2, 1, TP2_FLAGS), (W1_TP2, W1_CONCURRENCY, TP2_FLAGS),
                                       (W3_PP2, 1, PP2_FLAGS), (W1_PP2, W1_CONCURRENCY, PP2_FLAGS),
                                       (W3_DP2, 1, DP2_FLAGS), (W1_DP2, W1_CONCURRENCY, DP2_FLAGS),
                                       (W3_DP_ATTENTION, 1, DP_ATTENTION_FLAGS),
                                       (W1_DP_ATTENTION, W1_CONCURRENCY, DP_ATTENTION_FLAGS))]
    lora = [Workload(name, W1_CONCURRENCY, num_prompts(W1_CONCURRENCY, quick), srv_flags=flags,
                     lora_adapters=LORA_ADAPTERS)
            for name, flags in ((W1_LORA, LORA_FLAGS), (W1_LORA_TORCH, LORA_TORCH_FLAGS))]
    return sweep + [burst, steady, hog, repeat] + speculative + int8 + float32 + dense + hierarchical + parallel + lora
