"""`python -m benchmarks.decode_kernels`: srv's CPU decode kernels on the default model's shapes, with
every layer's data distinct (as in a forward pass, where nothing stays in cache from one layer
to the next), interleaved and best of several repetitions (this kind of VM is noisy).

- GGUF products: one decode step's linear layers (every decoder layer's four products and the
  vocabulary head) with Q4_1 / Q8_0 weights, on the C kernels and on the dense float32 copy
  (oneDNN, prepacked), at each row count: where `DENSE_FROM_FLOAT32_ROWS` comes from.
- GGUF products in bf16 arithmetic: the same step's products as a bf16 model's decode steps run
  them, on the C kernels' AMX and AVX-512 bodies and on the dense bf16 copy: where
  `AMX_DENSE_FROM_ROWS` comes from.
- Dense products: the same step's layers with float32 or bf16 weights, on srv's row-major
  kernel (float32 rows, srv.sdk.packed_linear) and on oneDNN's blocked copy (rows in the
  weights' dtype), at each row count: where `NATIVE_ROWS` comes from.
- LoRA products: the same step's adapter products (every linear layer of every decoder layer a
  target, rank 16, the batch's rows spread over 4 adapters) on each body of srv's CPU kernel this
  CPU runs and on the `torch` LoRA backend, at each row count.
- Decode attention: one step's attention (every layer) on a float32 KV cache, at each batch
  size and context length, each request's slots contiguous; with a shared prefix, the first
  slots of every request's table are the same (a prompt they share in the prefix cache).

Figures are milliseconds a step; BENCHMARKS.md's notes quote them with this command. (Not
named `kernels`: hf_peer.py runs with this folder on its path, and transformers imports a
package of that name when it finds one.)
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import time
from collections.abc import Callable

import torch

from benchmarks.lora import LORA_RANK
from srv.engine.default_model import default_model_path
from srv.plugins.lora.cpu_backend import ISA_FLAGS, CPULoRABackend
from srv.plugins.lora.torch_backend import TorchLoRABackend
from srv.plugins.attention.cpu_attention import KV_FORMATS, decode_context, kernels as attention_kernels
from srv.plugins.models.loaders import GGUFLoader
from srv.sdk.packed_linear import PackedLinear, can_pack, kernels as dense_kernels
from srv.plugins.quantization import gguf
from srv.plugins.quantization.gguf import GROUP, Q4_1Weight, Q8_0Weight
from srv.sdk.lora import LoRAProduct, LoRASegment
from srv.sdk.models import ModelConfig
from srv.sdk.native import call_linear
from srv.sdk.registration import requires_cpu_flags


def best_ms(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each run's best time over `repeats` rounds, the runs interleaved within a round."""
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - started) * 1e3)
    return best


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's products as srv fuses them: qkv, o, gate-up, down."""
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return [(qkv, config.hidden_size), (config.hidden_size, config.hidden_size),
            (2 * config.intermediate_size, config.hidden_size), (config.hidden_size, config.intermediate_size)]


def gguf_layers(config: ModelConfig, dtype: torch.dtype) -> list[tuple[gguf.BlockWeight, PackedLinear]]:
    """One decode step's products as GGUF blocks (Q4_1 layers, a Q8_0 head), each with its dense
    copy in `dtype`."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for n, k in linear_shapes(config) * config.num_hidden_layers:
        q = torch.randint(0, 16, (n, k), generator=generator)
        scale = torch.rand(n, k // GROUP, generator=generator) * 0.01
        low = -torch.rand(n, k // GROUP, generator=generator) * 0.05
        dense = (q.float().view(n, -1, GROUP) * scale[..., None] + low[..., None]).view(n, k)
        layers.append((Q4_1Weight.from_blocks(q, scale, low), PackedLinear(dense.to(dtype), None)))
    q8 = torch.randint(-127, 128, (config.vocab_size, config.hidden_size), generator=generator)
    scale8 = torch.rand(config.vocab_size, config.hidden_size // GROUP, generator=generator) * 0.001
    head_dense = (q8.float().view(config.vocab_size, -1, GROUP) * scale8[..., None]).view(q8.shape)
    layers.append((Q8_0Weight.from_blocks(q8, scale8), PackedLinear(head_dense.to(dtype), None)))
    return layers


def gguf_products(config: ModelConfig, rows: list[int], repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    layers = gguf_layers(config, torch.float32)
    avx512 = torch.cpu._is_avx512_supported()
    print("| rows | C kernels | C kernels, AVX2 rows | dense float32 copy |\n| ---: | ---: | ---: | ---: |")
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=generator) for k in {w.in_features for w, _ in layers}}

        def kernels() -> None:
            for weight, _ in layers:
                weight.matmul(inputs[weight.in_features])

        def avx2_kernels() -> None:
            gguf.set_isa("avx2")
            kernels()
            gguf.set_isa(None)

        def dense() -> None:
            for weight, packed in layers:
                packed(inputs[weight.in_features])

        runs = {"kernels": kernels, "dense": dense} | ({"avx2": avx2_kernels} if avx512 else {})
        with torch.inference_mode():
            best = best_ms(runs, repeats)
        avx2 = f"{best['avx2']:.1f} ms" if avx512 else "(the same)"
        print(f"| {m} | {best['kernels']:.1f} ms | {avx2} | {best['dense']:.1f} ms |", flush=True)


def gguf_bf16_products(config: ModelConfig, rows: list[int], repeats: int) -> None:
    """The same step's products in bf16 arithmetic (a bf16 model's decode steps): the C kernels on
    AMX's tiles and in AVX-512 (vdpbf16ps), and the dense bf16 copy (oneDNN)."""
    if not gguf.has_bf16_products():
        print("(this CPU has no bf16 products)")
        return
    generator = torch.Generator().manual_seed(0)
    layers = gguf_layers(config, torch.bfloat16)
    print("| rows | C kernels, AMX | C kernels, AVX-512 | dense bf16 copy |\n| ---: | ---: | ---: | ---: |")
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=generator) for k in {w.in_features for w, _ in layers}}
        rounded = {k: x.bfloat16() for k, x in inputs.items()}

        def kernels(isa: str) -> Callable[[], None]:
            def run() -> None:
                gguf.set_isa(isa)
                for weight, _ in layers:
                    call_linear(weight.bf16_kernel, inputs[weight.in_features], weight.out_features)
                gguf.set_isa(None)
            return run

        def dense() -> None:
            for weight, packed in layers:
                packed(rounded[weight.in_features])

        runs = {"avx512": kernels("avx512"), "dense": dense} | ({"amx": kernels("amx")} if gguf.has_amx() else {})
        with torch.inference_mode():
            best = best_ms(runs, repeats)
        amx = f"{best['amx']:.1f} ms" if "amx" in best else "(no AMX here)"
        print(f"| {m} | {amx} | {best['avx512']:.1f} ms | {best['dense']:.1f} ms |", flush=True)


def dense_products(config: ModelConfig, rows: list[int], repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = linear_shapes(config) * config.num_hidden_layers + [(config.vocab_size, config.hidden_size)]
    print("| weights | rows | row-major kernel | oneDNN blocked |\n| --- | ---: | ---: | ---: |")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k, generator=generator).to(dtype) for n, k in shapes]
        # The kernel called directly, at row counts the layer itself would give oneDNN.
        kept = [PackedLinear(w, None, keep_rows=True) for w in weights]   # they hold the kernels' contexts
        contexts = [layer.native_linear(1).context for layer in kept]
        blocked_layers = [PackedLinear(w, None) for w in weights]
        for m in rows:
            inputs = {k: torch.randn(m, k, generator=generator) for k in {w.shape[1] for w in weights}}
            out = torch.empty(m, max(n for n, _ in shapes))

            def kernel() -> None:
                for w, context in zip(weights, contexts):
                    dense_kernels().srv_dense_linear(context, inputs[w.shape[1]].data_ptr(), m, out.data_ptr())

            def blocked() -> None:
                for layer in blocked_layers:
                    layer(inputs[layer.in_features].to(dtype))

            runs = {"kernel": kernel} | ({"blocked": blocked} if can_pack(dtype) else {})
            with torch.inference_mode():
                best = best_ms(runs, repeats)
            other = f"{best['blocked']:.1f} ms" if "blocked" in best else "(no oneDNN bf16 here)"
            print(f"| {str(dtype).removeprefix('torch.')} | {m} | {best['kernel']:.1f} ms | {other} |", flush=True)


def lora_products(config: ModelConfig, rows: list[int], repeats: int, adapters: int = 4) -> None:
    generator = torch.Generator().manual_seed(0)
    head_dim = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    # Each layer as srv fuses it: (in_features, its targets' output widths side by side).
    fused = [(config.hidden_size, (q, kv, kv)), (q, (config.hidden_size,)),
             (config.hidden_size, (config.intermediate_size,) * 2), (config.intermediate_size, (config.hidden_size,))]
    bodies = [isa for isa, flags in ISA_FLAGS.items() if requires_cpu_flags(*flags)().ok]
    print(f"| weights | rows | {' | '.join(f'kernel, {isa}' for isa in bodies)} | torch backend |\n"
          f"| --- | ---: |{' ---: |' * (len(bodies) + 1)}")
    for dtype in (torch.float32, torch.bfloat16):
        layers = []
        for in_features, widths in fused * config.num_hidden_layers:
            offsets = list(itertools.accumulate(widths, initial=0))
            products = [[LoRAProduct(offset, torch.randn(LORA_RANK, in_features, generator=generator).to(dtype) / 10,
                                     torch.randn(width, LORA_RANK, generator=generator).to(dtype) / 10, 2.0)
                         for offset, width in zip(offsets, widths)] for _ in range(adapters)]
            layers.append((products, in_features, offsets[-1]))
        for m in rows:
            segments = [LoRASegment(a, m * a // adapters, m * (a + 1) // adapters) for a in range(adapters)]
            segments = [s for s in segments if s.end > s.start]
            inputs = {k: torch.randn(m, k, generator=generator).to(dtype) for k, _ in fused}
            outputs = {n: torch.zeros(m, n, dtype=dtype) for _, _, n in layers}

            def step(backend) -> Callable[[], None]:
                return lambda: [backend.add(outputs[n], inputs[k], products, segments) for products, k, n in layers]

            backends = {isa: CPULoRABackend() for isa in bodies}
            for isa, backend in backends.items():
                backend.isa = isa
            runs = {isa: step(backend) for isa, backend in backends.items()} | {"torch": step(TorchLoRABackend())}
            with torch.inference_mode():
                best = best_ms(runs, repeats)
            print(f"| {str(dtype).removeprefix('torch.')} | {m} | "
                  f"{' | '.join(f'{best[name]:.2f} ms' for name in runs)} |", flush=True)


def decode_attention(config: ModelConfig, batches: list[int], contexts: list[int], shared_prefixes: list[int],
                     repeats: int) -> None:
    library = attention_kernels()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    layers = config.num_hidden_layers
    print("| batch | context | shared prefix | decode attention |\n| ---: | ---: | ---: | ---: |")
    for batch, context, shared in itertools.product(batches, contexts, shared_prefixes):
        if shared >= context:
            continue
        own = torch.arange(batch * (context - shared)).view(batch, context - shared) + shared
        slots = torch.cat([torch.arange(shared).expand(batch, shared), own], dim=1).contiguous()
        seq_lens = torch.full((batch,), context, dtype=torch.int64)
        new_slots = slots[:, -1].contiguous()   # the step's own token, stored by the kernel
        q = torch.randn(batch, heads, head_dim)
        k_new, v_new = torch.randn(batch, kv_heads, head_dim), torch.randn(batch, kv_heads, head_dim)
        out = torch.empty_like(q)
        shape = (shared + batch * (context - shared), kv_heads, head_dim)
        k_caches, v_caches = ([torch.randn(shape) for _ in range(layers)] for _ in range(2))
        k_addresses, v_addresses = ((ctypes.c_void_p * layers)(*(b.data_ptr() for b in buffers))
                                    for buffers in (k_caches, v_caches))
        # groups: the tensor the context points into, alive as long as it is
        context_of_step, groups = decode_context(k_addresses, v_addresses, KV_FORMATS[torch.float32], None,
                                                 new_slots, slots, seq_lens, heads, kv_heads, head_dim,
                                                 head_dim ** -0.5)

        def step() -> None:
            for layer in range(layers):
                library.srv_decode_attention_layer(ctypes.addressof(context_of_step), layer, q.data_ptr(),
                                                   q.stride(0), k_new.data_ptr(), v_new.data_ptr(),
                                                   k_new.stride(0), out.data_ptr())

        print(f"| {batch} | {context} | {shared} | {best_ms({'step': step}, repeats)['step']:.1f} ms |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    parser.add_argument("--bf16-rows", type=int, nargs="+", default=[8, 12, 16, 32, 48, 64, 128])
    parser.add_argument("--dense-rows", type=int, nargs="+", default=[1, 2, 4, 7, 8, 12, 16])
    parser.add_argument("--lora-rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[170, 700])
    parser.add_argument("--shared-prefixes", type=int, nargs="+", default=[0, 512],
                        help="tokens at the start of every request's context that all share (W2 shares 512)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    config = ModelConfig.read(GGUFLoader().prepare(default_model_path()))
    print(f"torch threads: {torch.get_num_threads()}\n\nGGUF products, one decode step:")
    gguf_products(config, args.rows, args.repeats)
    print("\nGGUF products in bf16 arithmetic, one decode step:")
    gguf_bf16_products(config, args.bf16_rows, args.repeats)
    print("\nDense products, one decode step:")
    dense_products(config, args.dense_rows, args.repeats)
    print("\nLoRA products, one decode step:")
    lora_products(config, args.lora_rows, args.repeats)
    print("\nDecode attention, one step:")
    decode_attention(config, args.batches, args.contexts, args.shared_prefixes, args.repeats)


if __name__ == "__main__":
    main()
