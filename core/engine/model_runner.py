"""Loads the model through the loader and model plugins, owns the KV cache, runs forward passes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from srv.args.flags import flag_spec
from srv.backend_registry import AUTO, NONE, BackendRegistry, BackendUnavailable
from srv.engine.default_model import default_model_path
from srv.engine.expert_location import expert_placement
from srv.engine.forward_hooks import register_forward_hooks
from srv.engine.lora import LoRAAdapter, LoRAManager, lora_target_modules, parse_lora_paths
from srv.engine.pooling import Pooling
from srv.engine.tensor_dump import TensorDumper
from srv.sdk.attention import AttentionBackend, ForwardBatch, ForwardMode, KVCache, KVCacheDtype
from srv.sdk.moe import EPLBAlgorithm, FusedMoE, MoEBackends, config_num_experts
from srv.sdk.layers import use_float32_head
from srv.sdk.packed_linear import PackedLinear
from srv.sdk.models import ModelConfig, ModelImpl, ModelLoader, ModelOutput, materialize
from srv.sdk.parallel import ParallelContext, is_collective_failure, partition_starts
from srv.sdk.quantization import QuantizationMethod
from srv.sdk.system import available_memory_bytes

logger = logging.getLogger("srv.engine")

DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float": torch.float32, "float32": torch.float32}
# Without --max-total-tokens or --mem-fraction-static, the KV cache takes this share of available RAM.
DEFAULT_CPU_MEM_FRACTION = 0.1
# An idle rank 0 with ranks on other nodes sends them a command at least this often (seconds).
HEARTBEAT_S = 1.0
# A Hugging Face repository id ("org/name").
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def served_dtype(name: str, method: QuantizationMethod | None = None, embedding: bool = False) -> torch.dtype:
    if name != AUTO:
        return DTYPES[name]
    if method is not None and method.activation_dtype is not None:
        return method.activation_dtype
    if embedding:
        # An embedding server's output is the hidden state itself, compared against vectors the
        # reference computed in float32; bfloat16 moves it visibly (cosine 1 - 1e-4).
        return torch.float32
    # bfloat16 only where the CPU computes it natively (AVX512-BF16, AMX): there it runs matmuls
    # several times faster than float32. Emulated on AVX2 it is 2.6x slower at 16 rows (measured).
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native else torch.float32


def local_model_path(name: str, revision: str | None = None, download_dir: str | None = None,
                     flag: str = "--model-path", revision_flag: str = "--revision") -> Path:
    """A model's path on this machine (`flag`: --model-path, or a draft model's): a file or folder
    as given, else a Hugging Face repository id found in the local hub cache (--download-dir,
    else the hub's own) at `revision` (`revision_flag`; default: its main branch). srv never
    downloads: what is not on disk is an error."""
    path = Path(name)
    if path.exists():
        if revision is not None:
            raise ValueError(f"{revision_flag} {revision} names a version of a Hugging Face repository; "
                             f"{flag} {name} is a local path")
        return path
    if not REPO_ID.fullmatch(name):
        raise FileNotFoundError(f"{flag} {name} does not exist (srv never downloads weights)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=download_dir, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        where = download_dir or "the Hugging Face cache"
        raise FileNotFoundError(f"{flag} {name}: no such folder, and {where} has no copy of that repository"
                                f" at revision {revision or 'main'} (srv never downloads weights)") from None


def _tensor_shapes(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}


class ModelRunner:
    def __init__(self, args: Namespace, registry: BackendRegistry,
                 on_model_dir: Callable[[Path], None] | None = None, tensor_parallel: Any = None) -> None:
        """`on_model_dir` is called with the prepared model directory before the weights load.
        Under --tensor-parallel-size N > 1 this runner is rank 0, which starts the other ranks
        (srv.engine.tensor_parallel), unless `tensor_parallel` names the group of another rank;
        under --enable-dp-attention it is its group's rank (srv.engine.dp_attention)."""
        self.args, self.registry = args, registry
        if args.enable_dp_attention and tensor_parallel is None:
            from srv.engine.dp_attention import DataParallelAttention

            tensor_parallel = DataParallelAttention(args, args.data_parallel_rank, args.dp_attention_address)
        elif args.tensor_parallel_size * args.pipeline_parallel_size > 1 and tensor_parallel is None:
            from srv.engine.tensor_parallel import join_as_rank_zero

            tensor_parallel = join_as_rank_zero(args)
        self.tensor_parallel = tensor_parallel
        self.passes = 0   # forward passes run here (a data-parallel attention rank's rounds follow them)
        self.parallel: ParallelContext = tensor_parallel.context if tensor_parallel is not None else ParallelContext()
        try:
            self._load(on_model_dir)
        except BaseException:
            if tensor_parallel is not None:
                tensor_parallel.close()   # the other ranks are of no use without this one
            raise

    def _load(self, on_model_dir: Callable[[Path], None] | None) -> None:
        args, registry = self.args, self.registry
        self.quantization_name = NONE   # the method serving the weights (set by _quantization)
        self.eplb_algorithm: EPLBAlgorithm | None = None   # a MoE model's (set by _moe_backends)
        path = local_model_path(args.model_path, args.revision, args.download_dir) if args.model_path \
            else default_model_path()
        loader = self._choose_loader(path)
        loader.extra_config()   # a key the loader does not take fails before any work
        started = time.monotonic()
        self.model_dir = loader.prepare(path)
        if on_model_dir is not None:
            on_model_dir(self.model_dir)
        self.config = self._load_config()
        method = self._quantization(path)
        if method is not None:
            method.check(str(path))
        impl = self._choose_impl()
        if (self.parallel.is_parallel or self.parallel.is_pipelined) and not impl.tensor_parallel:
            raise BackendUnavailable(f"--model-impl {type(impl).__name__} does not split models across ranks: "
                                     "--tensor-parallel-size and --pipeline-parallel-size must be 1")
        impl.parallel = self.parallel
        impl.moe = self.moe = self._moe_backends()
        # An embedding server pools each prompt's final hidden states instead of generating.
        self.is_embedding = bool(args.is_embedding) or not impl.is_generation(self.config)
        # A cross-encoder's output is its classifier's score of each request (a pair of texts).
        self.is_cross_encoder = self.is_embedding and any(
            a.endswith("ForSequenceClassification") for a in getattr(self.config, "architectures", None) or [])
        self.pooling = (Pooling("score", normalize=False) if self.is_cross_encoder else Pooling.for_model(self.model_dir)) \
            if self.is_embedding else None
        # An encoder attends within each request's own tokens and keeps nothing between passes.
        self.keeps_kv = impl.is_generation(self.config)
        self.dtype = served_dtype(args.dtype, method, self.is_embedding)
        if method is not None:
            method.served_dtype = self.dtype
        self.model = self._build_model(impl, method)
        loader.load(self.model, self.model_dir)
        if method is not None:
            method.apply(self.model)
        self.model.to(self.dtype).eval()
        impl.finalize(self.model)
        if args.enable_fp32_lm_head and self.dtype != torch.float32 and not self.is_embedding:
            use_float32_head(self.model)
        if args.forward_hooks:
            register_forward_hooks(self.model, args.forward_hooks)
        if args.debug_tensor_dump_output_folder:
            TensorDumper(self.model, args.debug_tensor_dump_output_folder, self.parallel.tp_rank, self.parallel.pp_rank)
        self.lora = self._load_lora() if args.enable_lora or args.lora_paths else None
        logger.info("loaded %s (%s, %s) in %.1fs", path.name, self.config.architectures[0], self.dtype,
                    time.monotonic() - started)
        if self.pooling is not None:
            logger.info("serving embeddings: %s pooling%s", self.pooling.method,
                        ", normalized" if self.pooling.normalize else "")
        self.context_len = args.context_length or getattr(self.config, "max_position_embeddings", 4096)
        # Attention shapes from the config, whichever --model-impl built the model: this rank's
        # heads, split by key/value head group as srv.sdk.layers.QKVParallelLinear splits them.
        self.num_layers = self.config.num_hidden_layers
        start, end = self.parallel.layer_range(self.num_layers)
        self.kv_layers = end - start   # this pipeline stage's: its KV pool holds those
        total_heads = self.config.num_attention_heads
        total_kv_heads = getattr(self.config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // total_heads
        self.total_kv_heads = total_kv_heads
        self.num_kv_heads = self.parallel.attention.partition(total_kv_heads)[1]
        self.num_heads = self.num_kv_heads * (total_heads // total_kv_heads)
        self.prefill_attention = self._attention(args.prefill_attention_backend or args.attention_backend)
        self.decode_attention = self._attention(args.decode_attention_backend or args.attention_backend)
        self.sampler = registry.choose("sampling", args.sampling_backend).create(args)
        self.kv_cache_dtype: KVCacheDtype = registry.choose("kv_cache_dtype", args.kv_cache_dtype).create(args)
        self.kv_cache: KVCache | None = None

    def _load_lora(self) -> LoRAManager:
        args = self.args
        if self.is_embedding:
            raise ValueError("LoRA adapters serve generation models, not embedding models")
        adapters = [self.load_lora_adapter(name, path) for name, path in parse_lora_paths(args.lora_paths)]
        backend = self.registry.choose_default("lora_backend", args.lora_backend,
                                               flag_spec("--lora-backend").default).create(args)
        return LoRAManager(self.model, adapters, backend, self.dtype, args.max_loras_per_batch, args.max_loaded_loras,
                           args.lora_eviction_policy)

    def load_lora_adapter(self, name: str, path: str) -> LoRAAdapter:
        """A PEFT adapter read and checked against --max-lora-rank and --lora-target-modules."""
        args = self.args
        adapter = LoRAAdapter.load(name, path)
        if args.max_lora_rank is not None and adapter.rank > args.max_lora_rank:
            raise ValueError(f"adapter {adapter.name} has rank {adapter.rank}, over --max-lora-rank {args.max_lora_rank}")
        allowed = lora_target_modules(args.lora_target_modules)
        if allowed and not adapter.targets <= allowed:
            raise ValueError(f"adapter {adapter.name} targets {sorted(adapter.targets - allowed)}, outside "
                             f"--lora-target-modules {sorted(allowed)}")
        return adapter

    def _choose_loader(self, path: Path) -> ModelLoader:
        if not path.exists():
            raise FileNotFoundError(f"--model-path {path} does not exist (srv never downloads weights)")
        if self.args.load_format != AUTO:
            return self.registry.choose("load_format", self.args.load_format).create(self.args)
        for registration in sorted(self.registry.registrations("load_format"), key=lambda r: -r.priority):
            if registration.availability().ok:
                loader = registration.create(self.args)
                if loader.accepts(path):
                    return loader
        names = ", ".join(self.registry.names("load_format"))
        raise BackendUnavailable(f"no --load-format recognises {path} (installed: {names})")

    def _quantization(self, path: Path) -> QuantizationMethod | None:
        """--quantization's method; unset, the one whose `detects` claims the launch (a flag of
        its own, a GGUF file's blocks, a compressed-tensors config), else the method the
        checkpoint's config names in quantization_config, so a quantized checkpoint is served as
        it is; "none": the dequantized weights."""
        name = self.args.quantization
        if name == NONE:
            return None
        if name:
            self.quantization_name = name
            return self._splittable(self.registry.choose("quantization", name).create(self.args), name)
        for registration in sorted(self.registry.registrations("quantization"), key=lambda r: -r.priority):
            if registration.availability().ok:
                method = registration.create(self.args)
                if method.detects(str(path)):
                    if self.parallel.is_parallel and not method.tensor_parallel:
                        logger.info("quantization %s does not split across tensor-parallel ranks: serving the "
                                    "checkpoint's dequantized weights", registration.name)
                        return None
                    logger.info("quantization %s: the checkpoint's own format or the launch's flags "
                                "(--quantization none dequantizes it)", registration.name)
                    self.quantization_name = registration.name
                    return method
        declared = (getattr(self.config, "quantization_config", None) or {}).get("quant_method")
        if declared in self.registry.names("quantization"):
            logger.info("quantization %s, as the checkpoint's config declares", declared)
            self.quantization_name = declared
            return self._splittable(self.registry.choose("quantization", declared).create(self.args), declared)
        if declared:
            logger.warning("the checkpoint declares quantization %r, which no installed plugin provides", declared)
        return None

    def _splittable(self, method: QuantizationMethod, name: str) -> QuantizationMethod:
        if self.parallel.is_parallel and not method.tensor_parallel:
            raise ValueError(f"quantization {name} does not split across tensor-parallel ranks yet: "
                             "--tensor-parallel-size must be 1 with it")
        return method

    def _moe_backends(self) -> MoEBackends:
        """The MoE runner and token exchange the launch chose, for a model's sparse layers (a
        dense model's are never made: their flags have nothing to act on)."""
        args = self.args
        if not config_num_experts(self.config):
            return MoEBackends()
        # --eplb-algorithm places experts planned from counts: a dump's at launch, the recorded
        # ones under --enable-eplb.
        self.eplb_algorithm = self.registry.choose("eplb_algorithm", args.eplb_algorithm).create(args)
        return MoEBackends(self.registry.choose("moe_runner", args.moe_runner_backend).create(args),
                           self.registry.choose("moe_a2a", args.moe_a2a_backend).create(args),
                           args.expert_parallel_size, expert_placement(args, self.config, self.eplb_algorithm),
                           bool(args.enable_eplb), dense_tp_size=args.moe_dense_tp_size)

    def set_expert_placement(self, physical_to_logical: dict[int, list[int]]) -> None:
        """Every rank's MoE layers named (layer id -> its slots' logical experts) take a new
        placement of their experts (--enable-eplb)."""
        self._broadcast("set_expert_placement", physical_to_logical=physical_to_logical)
        for layer in self.model.modules():
            if isinstance(layer, FusedMoE) and layer.layer_id in physical_to_logical:
                layer.place(physical_to_logical[layer.layer_id])

    def _load_config(self) -> ModelConfig:
        return ModelConfig.read(self.model_dir, json.loads(self.args.json_model_override_args or "{}"),
                                bool(self.args.trust_remote_code))

    def _choose_impl(self) -> ModelImpl:
        impls = self.registry
        if self.args.model_impl != AUTO:
            impl = impls.choose("model_impl", self.args.model_impl).create(self.args)
            if not impl.supports(self.config):
                raise BackendUnavailable(f"--model-impl {self.args.model_impl} does not support "
                                         f"{self.config.architectures}")
        else:
            candidates = [r.create(self.args) for r in sorted(impls.registrations("model_impl"), key=lambda r: -r.priority)
                          if r.availability().ok]
            impl = next((c for c in candidates if c.supports(self.config)), None)
            if impl is None:
                raise BackendUnavailable(f"no --model-impl supports {self.config.architectures} "
                                         f"(installed: {', '.join(impls.names('model_impl'))})")
        return impl

    def _build_model(self, impl: ModelImpl, method: QuantizationMethod | None) -> torch.nn.Module:
        # Build without initialising: every parameter is about to be overwritten by the loader.
        # The quantization method's slots are put in before the weights load, in its format.
        with torch.device("meta"):
            model = impl.build(self.config)
            if method is not None:
                method.prepare(model, self.config)
        return materialize(model, self.dtype if method is None or not method.reads_float_weights else None)

    def _attention(self, name: str | None) -> AttentionBackend:
        registration = self.registry.choose("attention", name)
        return registration.create(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def kv_bytes_per_token(self) -> int:
        storage = self.kv_cache_dtype.storage_dtype(self.dtype)
        return 2 * self.kv_layers * self.num_kv_heads * self.head_dim * torch.finfo(storage).bits // 8

    def kv_capacity_tokens(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        fraction = self.args.mem_fraction_static or DEFAULT_CPU_MEM_FRACTION
        return int(fraction * available_memory_bytes() // self.kv_bytes_per_token())

    def allocate_kv_cache(self, num_slots: int) -> None:
        self._broadcast("allocate_kv_cache", num_slots=num_slots)
        if not self.keeps_kv:
            # The slots still bound how many tokens run at once; no memory backs them.
            logger.info("KV cache: none (an encoder keeps no keys and values); %d tokens at once", num_slots)
            return
        self.kv_cache = self.kv_cache_dtype.create(num_slots, self.kv_layers, self.num_kv_heads, self.head_dim,
                                                   self.dtype)
        logger.info("KV cache: %d slots in %s, %.1f MiB", num_slots, str(self.kv_cache.dtype).removeprefix("torch."),
                    num_slots * self.kv_bytes_per_token() / 2**20)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                kv_slots: torch.Tensor, prefix_lens: list[int], extend_lens: list[int],
                logits_indices: torch.Tensor | None = None, mode: ForwardMode | None = None,
                capture_layers: tuple[int, ...] = (), token_type_ids: torch.Tensor | None = None,
                lora_slots: list[int] | None = None) -> ModelOutput:
        """One forward pass (see ForwardBatch); mode defaults to DECODE when every request
        extends by one token, EXTEND otherwise."""
        decode = all(e == 1 for e in extend_lens)
        if mode is None:
            mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        if mode is ForwardMode.TARGET_VERIFY:
            # --speculative-attention-mode: which phase's backend verify passes use.
            attention = self.decode_attention if self.args.speculative_attention_mode == "decode" \
                else self.prefill_attention
        else:
            attention = self.decode_attention if decode else self.prefill_attention
        batch = ForwardBatch(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                             kv_slots=kv_slots, prefix_lens=prefix_lens, extend_lens=extend_lens,
                             kv_cache=self.kv_cache, attention=attention, logits_indices=logits_indices,
                             mode=mode, capture_layers=capture_layers, token_type_ids=token_type_ids)
        if self.lora is not None:
            self.lora.set_batch(lora_slots or [-1] * len(extend_lens), extend_lens)
        self.passes += 1
        if self.parallel.attention_data_parallel:
            self.tensor_parallel.agree(True)
        if self.tensor_parallel is not None:
            return self._forward_in_group(batch, dict(
                input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, kv_slots=kv_slots,
                prefix_lens=prefix_lens, extend_lens=extend_lens, logits_indices=logits_indices, mode=mode,
                capture_layers=capture_layers, token_type_ids=token_type_ids, lora_slots=lora_slots))
        return self._checked_output(self.model(batch), batch)

    # ---- the hierarchical cache's copies (srv.engine.hicache) ------------------------------------

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The keys and values at `slots` of every layer and key/value head, as the pools store
        them: [len(slots), num_layers, 2, total_kv_heads, head_dim]. Where the ranks split the
        pool (tensor or pipeline parallelism), rank 0 puts the ranks' shares together; the
        others send theirs and return None."""
        self._broadcast("read_kv", slots=slots)
        own = self.kv_cache.stored_rows(slots)
        if not self._kv_split:
            return own
        import torch.distributed as dist

        shares = self._kv_shares()
        with self._exit_on_collective_failure():
            if self.parallel.rank != 0:
                dist.send(_as_bytes(own.contiguous()), 0)
                return None
            rows = torch.empty(len(slots), self.num_layers, 2, self.total_kv_heads, self.head_dim, dtype=own.dtype)
            for rank, (layers, heads) in enumerate(shares):
                part = own if rank == 0 else self._kv_part(len(slots), layers, heads, own.dtype)
                if rank:
                    dist.recv(_as_bytes(part), rank)
                rows[:, layers, :, heads] = part
        return rows

    def write_kv(self, slots: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Write rows of `read_kv`'s shape at `slots`: rank 0 sends each rank its share."""
        self._broadcast("write_kv", slots=slots)
        if self._kv_split:
            import torch.distributed as dist

            shares = self._kv_shares()
            with self._exit_on_collective_failure():
                if self.parallel.rank == 0:
                    for rank, (layers, heads) in enumerate(shares[1:], 1):
                        dist.send(_as_bytes(rows[:, layers, :, heads].contiguous()), rank)
                    rows = rows[:, shares[0][0], :, shares[0][1]]
                else:
                    layers, heads = shares[self.parallel.rank]
                    rows = self._kv_part(len(slots), layers, heads, self.kv_cache.dtype)
                    dist.recv(_as_bytes(rows), 0)
        self.kv_cache.set_stored_rows(slots, rows)

    @property
    def _kv_split(self) -> bool:
        """Whether the KV pool is split over the group's ranks (not under data-parallel
        attention, where each rank's is whole)."""
        return self.tensor_parallel is not None and not self.parallel.attention_data_parallel

    def _kv_shares(self) -> list[tuple[slice, slice]]:
        """(layers, key/value heads) of each rank's KV pool, by rank in the group."""
        parallel = self.parallel
        layers = partition_starts(self.num_layers, parallel.pp_size, 1, "pipeline stages")
        heads = parallel.partition_starts(self.total_kv_heads)
        return [(slice(layers[stage], layers[stage + 1]), slice(heads[rank], heads[rank + 1]))
                for stage in range(parallel.pp_size) for rank in range(parallel.tp_size)]

    def _kv_part(self, tokens: int, layers: slice, heads: slice, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tokens, layers.stop - layers.start, 2, heads.stop - heads.start, self.head_dim, dtype=dtype)

    # ---- LoRA adapters: every rank holds its share of each --------------------------------------

    def add_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` (read and checked by `load_lora_adapter`); every rank cuts its share."""
        self.lora.add(adapter)   # refused here first, it is sent nowhere
        self._broadcast("add_lora_adapter", adapter=adapter)

    def remove_lora_adapter(self, lora_name: str) -> None:
        self.lora.remove(lora_name)
        self._broadcast("remove_lora_adapter", lora_name=lora_name)

    def activate_lora(self, names: set[str]) -> None:
        """Give a batch's adapters their slots (LoRAManager.activate), the same on every rank."""
        self.lora.activate(names)   # refused here first (too many for the slots), it is sent nowhere
        self._broadcast("activate_lora", names=names)

    # ---- the target's parts that speculative decoding reads (srv.engine.speculative) ----------

    def copy_kv(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Every layer's keys and values at slots `sources` to `targets`, on every rank's share
        (a tree draft's accepted nodes)."""
        self._broadcast("copy_kv", sources=sources, targets=targets)
        self.kv_cache.copy(sources, targets)

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids` in float32. Under tensor parallelism every rank joins: each
        holds a range of the vocabulary."""
        self._broadcast("embed", ids=ids)
        with self._exit_on_collective_failure():
            return self.model.embed_tokens(ids).float()

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary head's float32 logits of `hidden`'s rows (rank 0 gets the whole vocabulary
        where the ranks split it)."""
        self.check_head_alone("the vocabulary head outside a pass")
        self._broadcast("head_logits", hidden=hidden)
        model, hidden = self.model, hidden.to(self.dtype)
        with self._exit_on_collective_failure():
            if self.parallel.is_parallel:
                return self.parallel.vocab_logits(model.lm_head, hidden, model.vocab_starts)
            return model.lm_head(hidden).float()

    def check_head_alone(self, what: str) -> None:
        """Refuse `what` where this rank cannot run the vocabulary head on its own between passes:
        under data-parallel attention each rank schedules alone, and a split head needs all."""
        parallel = self.parallel
        if parallel.attention_data_parallel and parallel.is_parallel and not parallel.dp_lm_head:
            raise ValueError(f"{what} with --enable-dp-attention needs --enable-dp-lm-head: the vocabulary head "
                             "is split over the ranks, whose passes pair up, while a rank drafts alone")

    def prepare_when_idle(self, budget_s: float) -> bool:
        """Run the one-time work the model deferred from its load (oneDNN's reorders of its dense
        layers, `PackedLinear.pack`) for up to about `budget_s`; whether any is left. Every rank
        does its own share."""
        self._broadcast("prepare_when_idle", budget_s=budget_s)
        started = time.perf_counter()
        for module in self.model.modules() if self.model is not None else ():
            if isinstance(module, PackedLinear) and module.unpacked:
                if time.perf_counter() - started >= budget_s:
                    return True
                module.pack()
        return False

    def _broadcast(self, name: str, **payload: Any) -> None:
        """Rank 0 of a tensor-parallel group: have every rank run the same command (a rank gone
        ends this process, as in a pass)."""
        if self.tensor_parallel is not None and self.tensor_parallel.rank == 0:
            with self._exit_on_collective_failure():
                self.tensor_parallel.send(name, **payload)

    def _forward_in_group(self, batch: ForwardBatch, payload: dict[str, Any]) -> ModelOutput:
        """Every rank runs the pass; a collective that fails (a rank gone) ends this process:
        the group cannot compute without it."""
        with self._exit_on_collective_failure():
            self._broadcast("forward", **payload)
            out = self._through_stages(batch) if self.parallel.is_pipelined else self.model(batch)
        return self._checked_output(out, batch) if self.parallel.samples and not batch.is_idle else out

    @contextlib.contextmanager
    def _exit_on_collective_failure(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:
            if is_collective_failure(exc):
                logger.error("rank %d: a collective failed (%s); exiting", self.parallel.rank, exc)
                os._exit(1)
            raise

    def keep_alive(self) -> None:
        """Rank 0, after a scheduler step that ran no pass: where ranks run on other nodes, a
        command to them every HEARTBEAT_S seconds, so that a node gone ends this one while idle
        too (it fails as a pass's collective would)."""
        group = self.tensor_parallel   # a ParallelGroup here: data-parallel attention takes idle rounds
        if group is not None and group.has_remote_ranks and time.perf_counter() - group.last_sent >= HEARTBEAT_S:
            self._broadcast("heartbeat")

    def heartbeat(self) -> None:
        """The command of keep_alive: nothing to do."""

    def idle_round(self) -> None:
        """Data-parallel attention, after a scheduler step that ran no pass here: a round of
        srv.engine.dp_attention, and an IDLE pass beside the ranks that compute in it."""
        if self.tensor_parallel.agree(False):
            self._forward_in_group(ForwardBatch.idle(self.kv_cache, self.decode_attention), {})

    def _through_stages(self, batch: ForwardBatch) -> ModelOutput:
        """The pass as micro-batches of at most --pp-max-micro-batch-size requests, one after
        another through the stages: while a stage computes one, the stage before it computes the
        next. Rank 0 gets the logits. Unset, a prefill goes in as many parts as there are stages
        and a decode step whole: a part pays every layer's fixed costs, which a decode step's
        few rows do not repay (see BENCHMARKS.md)."""
        parallel = self.parallel
        size = self.args.pp_max_micro_batch_size or (
            batch.batch_size if batch.is_decode else -(-batch.batch_size // parallel.pp_size))
        parts = batch.micro_batches(size)
        # Rank 0 posts every part's receives first, in the order the last stage sends: its
        # logits, then the hidden states of its tokens that the pass captures.
        width = len(batch.capture_layers) * self.config.hidden_size
        waits = []
        for part in parts if parallel.rank == 0 else ():
            waits.append(parallel.expect_logits((part.logits_rows().numel(), self.config.vocab_size)))
            if width:
                waits.append(parallel.expect_logits((part.input_ids.shape[0], width)))
        adapters = self.lora.batch_slots if self.lora is not None and len(parts) > 1 else None
        for i, part in enumerate(parts):
            if adapters is not None:   # each part's requests' adapters, by their rows in the part
                self.lora.set_batch(adapters[i * size: i * size + part.batch_size], part.extend_lens)
            out = self.model(part)
            if parallel.is_last_stage:
                parallel.send_logits(out.logits)
                if width:
                    parallel.send_logits(out.hidden_states)
        parallel.finish_sends()
        if not waits:
            return ModelOutput(None)
        received = [wait() for wait in waits]
        step = 2 if width else 1
        return ModelOutput(torch.cat(received[::step]), torch.cat(received[1::step]) if width else None)

    def _checked_output(self, out: Any, batch: ForwardBatch) -> ModelOutput:
        extend_lens, logits_indices, capture_layers = batch.extend_lens, batch.logits_indices, batch.capture_layers
        input_ids = batch.input_ids
        if isinstance(out, torch.Tensor):   # a model written before ModelOutput: logits alone
            out = ModelOutput(out)
        rows = len(extend_lens) if logits_indices is None else len(logits_indices)
        if out.logits.shape[0] != rows:
            raise RuntimeError(f"the model returned {out.logits.shape[0]} rows of logits for {rows} asked: it must "
                               "return the rows ForwardBatch.logits_rows() names")
        if capture_layers and (out.hidden_states is None or out.hidden_states.shape[0] != input_ids.shape[0]):
            raise RuntimeError("the model did not return the hidden states of every new token the batch asked for")
        return out

    # ---- weights at run time (/update_weights_from_disk, /release_memory_occupation) ----------

    def reload_weights(self, model_path: str | None = None, load_format: str | None = None) -> None:
        """Serve the weights at `model_path` (default: the launch's), which must be a checkpoint of
        the same shapes; the attention backends, sampler and KV cache stay. The new model is built
        and loaded whole, as at launch, before it replaces the old one: a checkpoint that fails
        to load leaves the served one as it was."""
        self._refuse_in_group("new weights")
        args = Namespace(**vars(self.args))
        if model_path is not None:
            args.model_path = model_path
        if load_format is not None:
            args.load_format = load_format
        fresh = ModelRunner(args, self.registry)
        if self.model is not None:
            mine, theirs = _tensor_shapes(self.model), _tensor_shapes(fresh.model)
            if mine != theirs or fresh.dtype != self.dtype:
                differ = sorted(set(mine.items()) ^ set(theirs.items()))[:4]
                raise ValueError(f"{args.model_path} is not a checkpoint of the served model: its tensors' names, "
                                 f"shapes or dtype differ ({differ or [fresh.dtype, self.dtype]})")
        self.model, self.model_dir, self.config = fresh.model, fresh.model_dir, fresh.config
        self.quantization_name, self.args = fresh.quantization_name, args

    def release_weights(self) -> None:
        """Drop the weights (their memory goes back); `reload_weights()` brings them back."""
        self._refuse_in_group("releasing the weights")
        self.model = None

    def _refuse_in_group(self, what: str) -> None:
        if self.tensor_parallel is not None:
            raise ValueError(f"{what}: not supported with --tensor-parallel-size or --pipeline-parallel-size > 1 yet")

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def release_kv_cache(self) -> None:
        self.kv_cache = None

    def named_weight(self, name: str) -> torch.Tensor:
        """The served model's tensor `name` as the model holds it (a parameter or buffer; a
        checkpoint's name works where the model keeps it under the same name, less "model.").
        Layers repacked for a kernel hold their weights under the kernel's names."""
        if self.model is None:
            raise ValueError("the weights are released (/resume_memory_occupation brings them back)")
        tensors = self.model.state_dict(keep_vars=True)
        for candidate in (name, name.removeprefix("model.")):
            if candidate in tensors:
                return tensors[candidate]
        near = [n for n in tensors if name.split(".")[-1] in n][:5]
        raise ValueError(f"the model has no tensor {name!r}" + (f" (some it has: {near})" if near else ""))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor seen as its bytes: the ranks exchange KV rows so, whatever dtype the
    pool stores (float8 included)."""
    return tensor.view(torch.uint8)
