"""LoRA adapters (`--enable-lora`, `--lora-paths`): PEFT-format adapters on srv's native models,
a batch mixing requests of several adapters and of the base model.

Each targeted linear layer is wrapped in a `LoRALayer`: the base product for every row, then
the `--lora-backend` plugin adds each request's adapter's product into the columns of the
projection it targets (q, k and v share the fused qkv_proj; gate and up share gate_up_proj).
A backend with C kernels gives each wrapped layer one (base product, then the adapters'), so
a model's C decode steps keep running with adapters loaded.
The model runner tells the layers which rows belong to which adapter before each forward pass
(`LoRAManager.set_batch`). A request names its adapter by `lora_path` (or the OpenAI routes'
`model`); adapters are loaded at launch, in the order given, slot 0 first.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("srv.engine")

# PEFT's module names on srv's layers: (fused layer, position of the shard in it).
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}
PEFT_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def lora_target_modules(values: list[str] | str | None) -> set[str]:
    """--lora-target-modules as PEFT module names (the fused names stand for their parts); empty:
    any ("all", or unset)."""
    values = [values] if isinstance(values, str) else list(values or [])
    if not values or "all" in values:
        return set()
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    return {part for value in values for part in fused.get(value, [value])}


def parse_lora_paths(values: list[str] | None) -> list[tuple[str, str]]:
    """(name, path) of each --lora-paths entry: PATH, NAME=PATH, or SGLang's JSON
    {"lora_name": ..., "lora_path": ...}."""
    adapters = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            entry = json.loads(value)
            name, path = entry["lora_name"], entry["lora_path"]
        elif "=" in value:
            name, path = value.split("=", 1)
        else:
            name, path = Path(value).name, value
        if any(name == known for known, _ in adapters):
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        adapters.append((name, path))
    return adapters


EVICTION_POLICIES = ("lru", "fifo")
# Token ids stay below 2**32; an adapter's namespace is a multiple of that, below 2**63.
NAMESPACE_SHIFT, NAMESPACE_BITS = 32, 31


def cache_namespace(path: Path) -> int:
    """An adapter's prefix-cache namespace: a hash of its files (resolved path, size, modified
    time), so the same files share KV under any name, across reloads and restarts (with
    hierarchical-cache storage), and changed files never meet the old KV."""
    files = sorted(p for p in Path(path).iterdir() if p.is_file())
    identity = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    digest = int(hashlib.sha256(json.dumps(identity).encode()).hexdigest(), 16)
    return (digest % ((1 << NAMESPACE_BITS) - 1) + 1) << NAMESPACE_SHIFT


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    targets: set[str]
    weights: dict[tuple[int, str], tuple[Any, Any]]   # (layer, PEFT module) -> (A [r, in], B [out, r])
    # What its KV is keyed on in the prefix cache, beside the tokens (see `cache_namespace`).
    cache_namespace: int = 0

    @classmethod
    def load(cls, name: str, path: str | Path) -> LoRAAdapter:
        """A PEFT adapter directory: adapter_config.json and adapter_model.safetensors (or .bin)."""
        import torch

        path = Path(path)
        config = json.loads((path / "adapter_config.json").read_text())
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"adapter {name}: peft_type {config.get('peft_type')!r} is not LORA")
        for unsupported in ("use_dora", "modules_to_save"):
            if config.get(unsupported):
                raise ValueError(f"adapter {name}: {unsupported} is not supported")
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        scaling = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
        files = path / "adapter_model.safetensors"
        if files.exists():
            from safetensors.torch import load_file

            tensors = load_file(str(files))
        else:
            tensors = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
        pieces: dict[tuple[int, str], dict[str, Any]] = {}
        for key, tensor in tensors.items():
            match = PEFT_KEY.fullmatch(key)
            if match is None:
                raise ValueError(f"adapter {name}: weight {key} is not a LoRA product srv applies")
            layer, module, side = int(match[1]), match[2], match[3]
            if module not in TARGETS:
                raise ValueError(f"adapter {name}: target module {module} is not one srv's layers have "
                                 f"({', '.join(TARGETS)})")
            pieces.setdefault((layer, module), {})[side] = tensor
        weights = {key: (sides["A"], sides["B"]) for key, sides in pieces.items()}
        return cls(name, rank, scaling, {module for _, module in weights}, weights, cache_namespace(path))


def rank_parts(base: Any, a: Any, b: Any, shard: int) -> tuple[Any, Any]:
    """This tensor-parallel rank's parts of a target's A [rank, in] and B [out, rank] on `base`
    (a layer of srv.sdk.layers): an output-split layer takes its rows of B (of the fused layer's
    shard `shard`) and all of A; an input-split one its columns of A and all of B, its product
    then a partial sum the model adds up with the base layer's."""
    sharding = getattr(base, "sharding", None)
    if sharding is None or sharding.ranks == 1:
        return a, b
    if sharding.dim == 0:
        return a, sharding.cut(b, shard)
    return sharding.cut(a), b


class LoRAManager:
    """The loaded adapters and the wrapped layers of one model. Every layer an adapter can target
    is wrapped from the start, so adapters load and unload at run time without touching the
    model again (a wrapped layer with no adapter in the batch costs one check).

    At most `max_loaded` adapters are loaded (`--max-loaded-loras`; no bound when None), and at
    most `capacity` of them (`--max-loras-per-batch`) hold one of the wrapped layers' slots at a
    time: `activate` gives a batch's adapters their slots, taking the slot of an adapter the
    batch does not use in `--lora-eviction-policy` order (lru: the least recently used; fifo:
    the earliest to get its slot). The scheduler keeps the running requests' adapters within
    `capacity`."""

    def __init__(self, model: Any, adapters: list[LoRAAdapter], backend: Any, dtype: Any, capacity: int,
                 max_loaded: int | None = None, eviction_policy: str = "lru") -> None:
        from torch import nn

        from srv.engine.lora_layer import LoRALayer

        layers = getattr(model, "layers", None)
        # A pipeline stage holds a range of the layers; the others are placeholders.
        stage = [] if layers is None else [(i, layer) for i, layer in enumerate(layers)
                                           if not isinstance(layer, nn.Identity)]
        if not stage or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for _, layer in stage):
            raise ValueError("LoRA adapters apply to srv's native models (--model-impl srv)")
        self.num_layers = len(layers)
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"--lora-eviction-policy {eviction_policy!r}: one of {', '.join(EVICTION_POLICIES)}")
        if max_loaded is not None and max_loaded < capacity:
            raise ValueError(f"--max-loaded-loras ({max_loaded}) must be at least --max-loras-per-batch ({capacity})")
        self.backend, self.dtype, self.capacity = backend, dtype, capacity
        self.max_loaded, self.eviction_policy = max_loaded, eviction_policy
        self.loaded: dict[str, LoRAAdapter] = {}
        # name -> (layer index, fused layer name) -> the adapter's products on that layer
        self.products: dict[str, dict[tuple[int, str], list[Any]]] = {}
        self.adapters: list[LoRAAdapter | None] = [None] * capacity   # by slot; None: a free slot
        self.slots: dict[str, int] = {}                              # adapters holding a slot
        self._clock = itertools.count()
        self._activated: dict[str, int] = {}   # when each adapter got its slot (fifo)
        self._used: dict[str, int] = {}        # when each adapter was last in a batch (lru)
        self.segments: list = []
        self.batch_slots: list[int] = []   # the pass's requests' slots, as set_batch was given them
        # (layer index, fused layer name) -> (its wrapper, the columns each of its shards starts at)
        self.layers: dict[tuple[int, str], tuple[Any, list[int]]] = {}
        for index, layer in stage:
            attention = layer.self_attn
            offsets = {"self_attn.qkv_proj": [0, attention.q_size, attention.q_size + attention.kv_size],
                       "self_attn.o_proj": [0], "mlp.gate_up_proj": [0, layer.mlp.intermediate_size],
                       "mlp.down_proj": [0]}
            for fused, starts in offsets.items():
                parent_name, _, leaf = fused.rpartition(".")
                parent = layer.get_submodule(parent_name)
                wrapper = LoRALayer(getattr(parent, leaf), [[] for _ in range(capacity)], self)
                setattr(parent, leaf, wrapper)
                self.layers[(index, fused)] = (wrapper, starts)
        for adapter in adapters:
            self.add(adapter)
        logger.info("LoRA: %d adapter(s)%s on %s", len(adapters), f" ({', '.join(self.loaded)})" if adapters else "",
                    type(backend).__name__)

    @property
    def names(self) -> list[str]:
        return list(self.loaded)

    def add(self, adapter: LoRAAdapter) -> None:
        """Load an adapter (its products made once; it takes a slot when a batch needs it)."""
        from srv.sdk.lora import LoRAProduct

        if adapter.name in self.loaded:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        if self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
            raise ValueError(f"{len(self.loaded)} LoRA adapters are loaded, the most --max-loaded-loras "
                             f"({self.max_loaded}) allows: unload one first")
        products: dict[tuple[int, str], list[Any]] = {}
        for (index, module), (a, b) in adapter.weights.items():
            fused, shard = TARGETS[module]
            if not 0 <= index < self.num_layers:
                raise ValueError(f"adapter {adapter.name}: the model has no layer {index}")
            if (index, fused) not in self.layers:
                continue   # another pipeline stage's layer
            wrapper, starts = self.layers[(index, fused)]
            a, b = rank_parts(wrapper.base, a, b, shard)   # a rank's columns of A are a strided view
            end = starts[shard + 1] if shard + 1 < len(starts) else getattr(wrapper.base, "out_features", None)
            width = end - starts[shard] if end is not None else b.shape[0]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] \
                    or a.shape[1] != getattr(wrapper.base, "in_features", a.shape[1]) or b.shape[0] != width:
                # The kernels read the products by the layer's shapes: a mismatch is refused here.
                raise ValueError(f"adapter {adapter.name}: layer {index}'s {module} has A {list(a.shape)} and B "
                                 f"{list(b.shape)}, which do not fit the model's {fused}")
            products.setdefault((index, fused), []).append(LoRAProduct(
                starts[shard], a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous(), adapter.scaling))
        self.loaded[adapter.name] = adapter
        self.products[adapter.name] = products

    def remove(self, name: str) -> None:
        self.adapter(name)
        del self.loaded[name], self.products[name]
        if name in self.slots:
            self._vacate(self.slots[name])
        self._used.pop(name, None)

    def adapter(self, name: str) -> LoRAAdapter:
        if name not in self.loaded:
            raise ValueError(f"no LoRA adapter {name!r} is loaded (loaded: {', '.join(self.loaded) or 'none'})")
        return self.loaded[name]

    def _vacate(self, slot: int) -> None:
        adapter = self.adapters[slot]
        self.adapters[slot] = None
        if adapter is not None:
            del self.slots[adapter.name]
            self._activated.pop(adapter.name, None)
        for wrapper, _ in self.layers.values():
            wrapper.set_products(slot, [])

    def activate(self, names: set[str]) -> None:
        """Give every adapter in `names` (a batch's) a slot."""
        if len(names) > self.capacity:
            raise ValueError(f"a batch of {len(names)} LoRA adapters; --max-loras-per-batch is {self.capacity}")
        now = next(self._clock)
        for name in sorted(names - set(self.slots)):
            adapter = self.adapter(name)
            slot = next((i for i, a in enumerate(self.adapters) if a is None), None)
            if slot is None:
                order = self._used if self.eviction_policy == "lru" else self._activated
                victim = min((n for n in self.slots if n not in names), key=lambda n: order.get(n, -1))
                slot = self.slots[victim]
                self._vacate(slot)
            products = self.products[name]
            for key, (wrapper, _) in self.layers.items():
                wrapper.set_products(slot, products.get(key, []))
            self.adapters[slot], self.slots[name], self._activated[name] = adapter, slot, now
        for name in names:
            self._used[name] = now

    def slot(self, name: str | None) -> int:
        """The adapter's slot (-1: the base model); `activate` gave it one."""
        if name is None:
            return -1
        self.adapter(name)
        return self.slots[name]

    def set_batch(self, slots: list[int], extend_lens: list[int]) -> None:
        """Which rows of the next forward pass belong to which adapter (each request's rows)."""
        from srv.sdk.lora import LoRASegment

        self.batch_slots = slots
        segments, start = [], 0
        for slot, length in zip(slots, extend_lens):
            if slot >= 0:
                segments.append(LoRASegment(slot, start, start + length))
            start += length
        self.segments = segments
        self.backend.set_segments(segments, start)
