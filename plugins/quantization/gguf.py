"""`--quantization gguf`: serve a GGUF file's quantized weights as they are in the file.

Each linear layer's blocks are read from the file itself (gguf_blocks.py unpacks every GGML
type llama.cpp uses for these models: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K) into one of
the three layouts srv's kernels compute, exactly (the weights they rebuild are gguf's own
dequantized values):

- Q4_1: w = d * q + m, q in 0..15 per 32 inputs, float32 d and m (6 bits a weight);
- Q8_0: w = d * q, q in -127..127 per 32 inputs (9 bits a weight);
- Q8_16: w = d * q + m, q int8 per 16 inputs (12 bits a weight): the 5-, 6-, 3- and 2-bit types.

A file whose linear layers (the projections, and the head) hold another block type (the IQ
types, ternary TQ) is refused by `--quantization gguf`, naming the tensors and their types,
and is served dequantized (with a warning saying so) when the method is inferred; float
tensors (F32, F16, BF16) stay dense. Batches under DENSE_FROM_*_ROWS rows (decode) go to the C
kernels of gguf_kernels.c, which read the quantized bytes once for all rows and multiply them
into float32 activations: those products are bound by the bytes read. Larger batches are
bound by arithmetic, where the served dtype's dense kernels are faster, so the layer keeps the
loader's dense copy for them.

Without a file (the SDK's conformance kit hands float weights), the Q4_1 and Q8_0 blocks are
recovered from the float weights instead, block by block.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from srv.sdk.native import NativeKernel, load_c_library
from srv.sdk.paths import cache_root, write_atomically
from srv.sdk.quantization import QuantizationMethod

logger = logging.getLogger("srv.quantization")

GROUP = 32
# Rows from which the dense copy computes the product, by the served dtype. float32, measured
# on AVX2 by `python -m benchmarks.decode_kernels` (one decode step's products on SmolLM2's shapes,
# oneDNN's prepacked float32 for the dense copy): the kernels take 41 ms against 64 at 16 rows,
# 129-142 against 148-164 at 64 and 199 against 214 at 112; the dense copy wins from 128 (270
# against 295). The dense copy reads 4 bytes a weight, the kernels 6 bits.
# bf16 and float16 go to the dense copy from 8 rows: on AMX, bf16 dense products run several
# times faster than float32 ones, and the kernels called from Python lose to them from about
# there (BENCHMARKS.md); the kernels' float32 products would also change the served dtype's
# arithmetic for whole prefills. Small decode steps of such a model run the kernels from the
# native float32 layers instead (srv's Llama).
DENSE_FROM_FLOAT32_ROWS = 128
DENSE_FROM_OTHER_DTYPES_ROWS = 8
# Where bf16 products run on AMX's tiles (has_amx), a layer offers its bf16 kernel
# (srv_gguf_linear_bf16, from the file's blocks) to native decode steps below this many rows,
# which would otherwise run the Python layers on the dense bf16 copy: the kernel reads 4.5 or 8.5
# bits a weight where the dense copy reads 16, and makes no oneDNN call a layer. Measured by
# `python -m benchmarks.decode_kernels` (GGUF products in bf16 arithmetic) on an AMX Xeon: the
# kernel wins up to 96 rows, and loses from 112 (an odd count of 16-row groups) and 160.
AMX_DENSE_FROM_ROWS = 97
# Without AMX, bf16 products (vdpbf16ps) run as native decode layers' products below this many
# rows; the dense copy computes larger steps faster.
BF16_KERNEL_ROWS = 32
ROWS_PER_SLICE = 1024
# Recovered blocks must rebuild the file's values to float32 rounding.
TOLERANCE = 1e-6
KERNEL_FLAGS = ("-mavx2", "-mfma")
CACHE_VERSION = 2  # bump when what is cached changes: the layouts above, or how blocks are read
HEADER_CACHE_VERSION = 1   # bump when TensorInfo or how the header is read changes


@functools.cache
def kernels() -> ctypes.CDLL:
    library = load_c_library(Path(__file__).with_name("gguf_kernels.c"), KERNEL_FLAGS)
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.srv_gguf_linear.argtypes = [pointer, pointer, size, pointer]
    library.srv_gguf_set_isa.argtypes = [ctypes.c_int]
    library.srv_gguf_linear_bf16.argtypes = [pointer, pointer, size, pointer]
    return library


@functools.cache
def has_bf16_products() -> bool:
    """Whether the CPU computes bf16 products (AVX512_BF16): srv_gguf_linear_bf16 runs."""
    return bool(kernels().srv_gguf_has_bf16())


@functools.cache
def has_amx() -> bool:
    """Whether bf16 products run on AMX's tiles (the CPU has AMX-BF16 and the OS lends them)."""
    return bool(kernels().srv_gguf_has_amx())


def bf16_kernel_rows() -> int:
    """The rows below which a layer's bf16 products run on its kernel (native_linear)."""
    return AMX_DENSE_FROM_ROWS if has_amx() else BF16_KERNEL_ROWS


def set_isa(name: str | None) -> None:
    """Force the products' instruction set: "avx2", "avx512" (the few-row products in AVX-512,
    bf16 products in AVX-512 without AMX) or "amx" (the same with bf16 products on AMX), where
    the CPU has it; None: the CPU's best. For tests and benchmarks."""
    kernels().srv_gguf_set_isa({None: -1, "avx2": 0, "avx512": 1, "amx": 2}[name])


class LinearContext(ctypes.Structure):
    """What srv_gguf_linear reads: a layer's format (0 Q4_1, 1 Q8_0), shape and weights."""
    _fields_ = [("format", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p)]


class BlockWeight:
    """A layer's weights in one of the kernels' formats: the tensors named in FIELDS, which are
    also the constructor's arguments, described to srv_gguf_linear by a LinearContext."""

    FORMAT: str
    FORMAT_ID: int   # the format in gguf_kernels.c's LinearContext
    FIELDS: tuple[str, ...]
    BLOCK = GROUP    # inputs a scale

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = scale.shape[0], scale.shape[1] * self.BLOCK
        self.context = LinearContext(self.FORMAT_ID, self.in_features, self.out_features, data.data_ptr(),
                                     scale.data_ptr(), None if min is None else min.data_ptr())
        self.kernel = NativeKernel.of(kernels().srv_gguf_linear, self.context)
        self.bf16_kernel = (NativeKernel.of(kernels().srv_gguf_linear_bf16, self.context)
                            if has_bf16_products() and self.in_features % 32 == 0 else None)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {field: getattr(self, field) for field in self.FIELDS}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 and contiguous -> [M, N] float32."""
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        kernels().srv_gguf_linear(self.kernel.context, x.data_ptr(), x.shape[0], y.data_ptr())
        return y


class Q4_1Weight(BlockWeight):
    """nibbles [N, ceil(K / 64), 32] uint8 (pairs of blocks, laid out as gguf_kernels.c reads
    them), scale and min [N, K / 32] float32."""

    FORMAT, FIELDS = "q4_1", ("nibbles", "scale", "min")
    FORMAT_ID = 0

    def __init__(self, nibbles: torch.Tensor, scale: torch.Tensor, min: torch.Tensor) -> None:
        self.nibbles, self.scale, self.min = nibbles, scale, min
        super().__init__(nibbles, scale, min)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor) -> Q4_1Weight:
        """From q [N, K] (values 0..15) and the blocks' scale and min [N, K / 32]."""
        n, k = q.shape
        pairs = -(-k // (2 * GROUP))
        # Lane l (4 bytes) of a pair holds its weights 8s + l as nibble s: byte b of the lane
        # is nibble 2b (low) and 2b + 1 (high). An odd last block is paired with zeros.
        padded = q.new_zeros(n, pairs * 2 * GROUP, dtype=torch.uint8)
        padded[:, :k] = q
        lanes = padded.view(n, pairs, 8, 8).transpose(-1, -2)
        nibbles = (lanes[..., 0::2] | (lanes[..., 1::2] << 4)).contiguous()
        return cls(nibbles, scale.float().contiguous(), min.float().contiguous())


class Q8_0Weight(BlockWeight):
    """values [N, K / 32, 32] int8 (byte s of lane l is the block's weight 8s + l), scale
    [N, K / 32] float32."""

    FORMAT, FIELDS = "q8_0", ("values", "scale")
    FORMAT_ID = 1

    def __init__(self, values: torch.Tensor, scale: torch.Tensor) -> None:
        self.values, self.scale = values, scale
        super().__init__(values, scale)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scale: torch.Tensor) -> Q8_0Weight:
        """From q [N, K] (values -127..127) and the blocks' scale [N, K / 32]."""
        n, k = q.shape
        values = q.to(torch.int8).view(n, k // GROUP, 4, 8).transpose(-1, -2).contiguous()
        return cls(values, scale.float().contiguous())


class Q8_16Weight(BlockWeight):
    """values [N, K] int8 in order, scale and min [N, K / 16] float32: w = scale * q + min in
    blocks of 16, what GGUF's 5-, 6-, 3- and 2-bit types unpack to."""

    FORMAT, FIELDS = "q8_16", ("values", "scale", "min")
    FORMAT_ID, BLOCK = 2, 16

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, min: torch.Tensor) -> None:
        self.values, self.scale, self.min = values, scale, min
        super().__init__(values, scale, min)


FORMATS = {fmt.FORMAT: fmt for fmt in (Q4_1Weight, Q8_0Weight, Q8_16Weight)}


def concatenate(parts: list[BlockWeight]) -> BlockWeight:
    """The weights of `parts` stacked along the output rows (all of one format)."""
    fmt = type(parts[0])
    return fmt(**{field: torch.cat([getattr(p, field) for p in parts]) for field in fmt.FIELDS})


class GGUFLinear(nn.Module):
    def __init__(self, weight: BlockWeight, dense: nn.Linear) -> None:
        super().__init__()
        # A plain attribute, not a buffer: casting the model to the served dtype must leave it.
        self.weight = weight
        self.dense = dense
        self.plain = dense.bias is None
        self.in_features, self.out_features = dense.in_features, dense.out_features

    def native_linear(self, rows: int, dtype: torch.dtype = torch.float32) -> NativeKernel | None:
        """The kernels' product for `rows` float32 rows, or None where the dense copy computes it
        (from DENSE_FROM_FLOAT32_ROWS rows) or a bias is added. In bf16 (`dtype`), the rows and
        the file's weights rounded to bf16 as the dense bf16 copy's product rounds them, where
        the CPU has bf16 products."""
        if not self._kernel_alone(rows):
            return None
        if dtype == torch.float32:
            return self.weight.kernel
        return self.weight.bf16_kernel if dtype == torch.bfloat16 and rows < bf16_kernel_rows() else None

    def _kernel_alone(self, rows: int) -> bool:
        """Whether `rows` float32 rows are the kernel's product and nothing else."""
        return self.plain and rows < DENSE_FROM_FLOAT32_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The common case first, in as few operators as possible: a decode step that is not run
        # natively calls this 100-odd times, where each operator call costs about a microsecond.
        if x.dtype == torch.float32 and x.dim() == 2 and self._kernel_alone(x.shape[0]) and x.is_contiguous():
            return self.weight.matmul(x)
        rows = x.numel() // x.shape[-1]
        if rows >= (DENSE_FROM_FLOAT32_ROWS if x.dtype == torch.float32 else DENSE_FROM_OTHER_DTYPES_ROWS):
            return self.dense(x)
        out = self.weight.matmul(x.reshape(rows, x.shape[-1]).float().contiguous())
        if self.dense.bias is not None:
            out += self.dense.bias
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def q4_1_weight(weight: torch.Tensor) -> Q4_1Weight | None:
    """Q4_1: weight == d * q + m block by block; None if the weight is not Q4_1."""
    blocks = weight.float().view(weight.shape[0], -1, GROUP)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = blocks.sub(low).div_(torch.where(d > 0, d, 1.0)).round_().clamp_(0, 15)
    if not _rebuilds(blocks, q.mul(d).add_(low), torch.maximum(low.abs(), high.abs())):
        return None
    return Q4_1Weight.from_blocks(q.view_as(weight), d.squeeze(-1), low.squeeze(-1))


def q8_0_weight(weight: torch.Tensor) -> Q8_0Weight | None:
    """Q8_0: weight == d * q block by block; None if the weight is not Q8_0."""
    blocks = weight.float().view(weight.shape[0], -1, GROUP)
    largest = blocks.abs().amax(-1, keepdim=True)
    d = largest / 127
    q = blocks.div(torch.where(d > 0, d, 1.0)).round_().clamp_(-127, 127)
    if not _rebuilds(blocks, q.mul(d), largest):
        return None
    return Q8_0Weight.from_blocks(q.view_as(weight), d.squeeze(-1))


def _rebuilds(blocks: torch.Tensor, rebuilt: torch.Tensor, largest: torch.Tensor) -> bool:
    """Whether every block rebuilds to float32 rounding of its largest magnitude."""
    error = rebuilt.sub_(blocks).abs_().amax(-1, keepdim=True)
    return bool((error <= TOLERANCE * largest).all())


def quantized_weight(weight: torch.Tensor) -> BlockWeight | None:
    """The weight in the first format every block fits, or None.

    Works through slices of rows: small temporaries the allocator reuses, where one pass over a
    whole vocabulary head spends most of its time faulting in fresh pages.
    """
    if weight.shape[1] % GROUP:
        return None
    for fmt, recover in ((Q4_1Weight, q4_1_weight), (Q8_0Weight, q8_0_weight)):
        parts = []
        for rows in weight.split(ROWS_PER_SLICE):
            part = recover(rows)
            if part is None:
                break
            parts.append(part)
        else:
            return concatenate(parts)
    return None


# Block types srv's kernels compute, and float types, which stay dense.
# Bytes and values a block, by the types gguf_blocks.py unpacks.
BLOCKS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
          "Q2_K": (84, 256), "Q3_K": (110, 256), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}
KERNEL_TYPES = tuple(BLOCKS)
FLOAT_TYPES = ("F32", "F16", "BF16")
LINEAR_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def types_without_kernel(path: Path) -> dict[str, str]:
    """The file's linear-layer tensors whose block type srv has no kernel for: name -> type.
    The head is `output.weight`, or the token embeddings where the file ties them."""
    tensors = tensor_types(path)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"

    def linear(name: str) -> bool:
        parts = name.split(".")
        return name == head or (len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEAR_TENSORS
                                and parts[3] == "weight")

    return {name: kind for name, kind in tensors.items()
            if linear(name) and kind not in KERNEL_TYPES + FLOAT_TYPES}


# GGUF metadata value types: their sizes, or None for strings (8) and arrays (9).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: None, 9: None, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file, from its header: block type, dimensions (innermost first, as
    the file lists them) and where its bytes start in the file."""
    kind: str
    dims: tuple[int, ...]
    start: int


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's block type, read from the file's header alone."""
    return {name: info.kind for name, info in tensor_infos(path).items()}


def tensor_infos(path: Path) -> dict[str, TensorInfo]:
    """Each tensor's type, dimensions and offset, read from the file's header alone: gguf's
    GGUFReader parses the whole tokenizer into Python objects first, seconds of every launch.
    A launch asks several times (detection, the method's check, the weights' cache): the file is
    read once while it stays the same file."""
    stat = path.stat()
    return _cached_tensor_infos(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _cached_tensor_infos(path: Path, size: int, mtime_ns: int) -> dict[str, TensorInfo]:
    """Parsing the header walks the tokenizer's strings one by one (tens of ms of each launch):
    what it finds is also kept in srv's cache, under the file's path, size and modification time."""
    import mmap
    import struct

    key = json.dumps([HEADER_CACHE_VERSION, str(path), size, mtime_ns])
    memo = cache_root() / "gguf-headers" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return {name: TensorInfo(kind, tuple(dims), start)
                for name, (kind, dims, start) in json.loads(memo.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):   # none yet, or not what this code writes
        pass
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            infos = _header_tensor_infos(data)
    except (struct.error, UnicodeDecodeError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable GGUF header ({exc})") from None
    text = json.dumps({name: [info.kind, list(info.dims), info.start] for name, info in infos.items()})
    try:
        write_atomically(memo, lambda tmp: tmp.write_text(text), mode=0o644)
    except OSError:   # a read-only cache: the next launch parses the header again
        pass
    return infos


def _header_tensor_infos(data: bytes) -> dict[str, TensorInfo]:
    import struct

    from gguf import GGMLQuantizationType

    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    offset = 24
    length_at = struct.Struct("<Q").unpack_from

    def skip_value(kind: int) -> None:
        nonlocal offset
        if kind == 8:
            offset += 8 + length_at(data, offset)[0]
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", data, offset)
            offset += 12
            if _VALUE_SIZES[item] is not None:
                offset += count * _VALUE_SIZES[item]
            elif item == 8:   # an array of strings (the tokenizer's vocabulary and merges): each its length and bytes
                for _ in range(count):
                    offset += 8 + length_at(data, offset)[0]
            else:
                for _ in range(count):
                    skip_value(item)
        else:
            offset += _VALUE_SIZES[kind]

    alignment = 32   # general.alignment's default
    for _ in range(n_kv):
        length = length_at(data, offset)[0]
        key = data[offset + 8:offset + 8 + length]
        offset += 8 + length
        kind = struct.unpack_from("<I", data, offset)[0]
        offset += 4
        if key == b"general.alignment" and kind == 4:
            alignment = struct.unpack_from("<I", data, offset)[0]
        skip_value(kind)
    listed = []
    for _ in range(n_tensors):
        length = length_at(data, offset)[0]
        name = data[offset + 8:offset + 8 + length].decode()
        offset += 8 + length
        dims = struct.unpack_from("<I", data, offset)[0]
        shape = struct.unpack_from(f"<{dims}Q", data, offset + 4)
        offset += 4 + 8 * dims
        kind, start = struct.unpack_from("<IQ", data, offset)
        listed.append((name, GGMLQuantizationType(kind).name, tuple(shape), start))
        offset += 4 + 8
    data_start = -(-offset // alignment) * alignment
    return {name: TensorInfo(kind, shape, data_start + start) for name, kind, shape, start in listed}


def describe(missing: dict[str, str]) -> str:
    kinds = sorted(set(missing.values()))
    first = next(iter(missing))
    return (f"{', '.join(kinds)} blocks ({len(missing)} tensors, {first} is "
            f"{missing[first]}); srv's kernels compute {', '.join(KERNEL_TYPES)}")


class GGUFQuantization(QuantizationMethod):
    """Unpacking the file's blocks costs CPU at every launch, so the unpacked weights are cached
    (`gguf-weights` in srv's cache root), keyed by the GGUF file (path, size, modification
    time), the model's linear layers and CACHE_VERSION. Without a file (`check` not called)
    nothing is cached."""

    model_file: Path | None = None

    @property
    def reads_float_weights(self) -> bool:
        # With a file (`check`), every layer's blocks come from it (or from the cache made of
        # it); without one they are quantized from the float weights.
        return self.model_file is None

    def detects(self, model_path: str) -> bool:
        if Path(model_path).suffix != ".gguf":
            return False
        missing = types_without_kernel(Path(model_path))
        if missing:
            logger.warning("%s has %s: serving it dequantized (--quantization gguf refuses it)", Path(model_path).name,
                           describe(missing))
        return not missing

    def check(self, model_path: str) -> None:
        if Path(model_path).suffix != ".gguf":
            raise ValueError(f"--quantization gguf serves a .gguf file's own weights; {model_path} is not one")
        missing = types_without_kernel(Path(model_path))
        if missing:
            raise ValueError(f"--quantization gguf: {Path(model_path).name} has {describe(missing)}; "
                             "--quantization none serves it dequantized")
        kernels()   # a compiler error now, at launch, rather than at the first request
        self.model_file = Path(model_path).resolve()

    def apply(self, model: nn.Module) -> int:
        linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
        self.recovered = self._cached_weights(linears, getattr(model, "packed_modules_mapping", {}))
        return super().apply(model)

    def _file_weights(self, linears: dict[str, nn.Linear],
                      mapping: dict[str, list[str]]) -> dict[str, BlockWeight | None]:
        """Each linear layer's blocks read from the file (its shards' tensors, in Hugging Face's
        row order), or None where one is float or has no kernel."""
        import numpy as np

        from srv.sdk.gguf_names import hf_names, hf_row_order
        from srv.plugins.quantization.gguf_blocks import layer_weight

        infos = tensor_infos(self.model_file)
        names = hf_names(infos)
        config = self.model_config.to_dict() if hasattr(self.model_config, "to_dict") else dict(self.model_config or {})
        arch = config.get("model_type", "")
        data = np.memmap(self.model_file, dtype=np.uint8, mode="r")
        weights: dict[str, BlockWeight | None] = {}
        for name, linear in linears.items():
            parent, _, leaf = name.rpartition(".")
            parts = []
            for shard in mapping.get(leaf, [leaf]):
                gguf_name = checkpoint_tensor(names, f"{parent}.{shard}" if parent else shard)
                if gguf_name is None and shard == "lm_head":   # tied: the token embeddings
                    gguf_name = names.get("model.embed_tokens.weight")
                if gguf_name is None:
                    logger.warning("%s: no tensor of %s holds the layer %s: it is served dense", type(self).__name__,
                                   self.model_file.name, name)
                info = None if gguf_name is None else infos[gguf_name]
                if info is None or info.kind not in BLOCKS:
                    parts = []
                    break
                columns, rows = info.dims
                size, values = BLOCKS[info.kind]
                raw = data[info.start:info.start + rows * columns // values * size].reshape(rows, -1)
                parts.append((info.kind, hf_row_order(gguf_name, raw, arch, config), rows))
            weight = layer_weight(parts) if parts else None
            if weight is not None and (weight.out_features, weight.in_features) != tuple(linear.weight.shape):
                raise ValueError(f"{self.model_file.name}: the blocks of {name} make [{weight.out_features}, "
                                 f"{weight.in_features}], the model's layer is {list(linear.weight.shape)}")
            weights[name] = weight
        return weights

    def quantize(self, name: str, linear: nn.Linear) -> nn.Module | None:
        weight = self.recovered[name] if name in self.recovered else quantized_weight(linear.weight.detach())
        return None if weight is None else GGUFLinear(weight, linear)

    def _cached_weights(self, linears: dict[str, nn.Linear],
                        mapping: dict[str, list[str]]) -> dict[str, BlockWeight | None]:
        if self.model_file is None:   # weights without a file (srv.sdk.testing's kit): recovered
            return {name: quantized_weight(linear.weight.detach()) for name, linear in linears.items()}
        path = self._cache_path(linears)
        try:
            return read_weights(path)
        except (OSError, SafetensorError, KeyError, ValueError):
            pass
        weights = self._file_weights(linears, mapping)
        try:
            write_weights(path, weights)
        except OSError as exc:  # a read-only cache costs the next launch a second, nothing more
            logger.warning("could not cache the GGUF weights in %s: %s", path, exc)
        return weights

    def _cache_path(self, linears: dict[str, nn.Linear]) -> Path:
        stat = self.model_file.stat()
        layers = [[name, list(linear.weight.shape)] for name, linear in linears.items()]
        key = json.dumps([CACHE_VERSION, str(self.model_file), stat.st_size, stat.st_mtime_ns, layers])
        return cache_root() / "gguf-weights" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def checkpoint_tensor(names: dict[str, str], module: str) -> str | None:
    """The file's tensor for the weight of the model's `module`, by its Hugging Face name: the
    model's own name, or without the prefix of a wrapper (srv's transformers implementation holds
    the model as `hf`), with or without "model."."""
    parts = module.split(".")
    for start in range(len(parts)):
        name = ".".join(parts[start:])
        found = names.get(f"{name}.weight") or names.get(f"model.{name}.weight")
        if found is not None:
            return found
    return None


def write_weights(path: Path, weights: dict[str, BlockWeight | None]) -> None:
    """One safetensors file: `<layer>.<tensor>` entries, each layer's format in the metadata."""
    tensors = {f"{name}.{field}": tensor for name, weight in weights.items() if weight is not None
               for field, tensor in weight.tensors().items()}
    formats = {name: None if weight is None else weight.FORMAT for name, weight in weights.items()}
    # Readable by all: the cache may be shared, and safetensors writes files private.
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"formats": json.dumps(formats)}),
                     mode=0o644)


def read_weights(path: Path) -> dict[str, BlockWeight | None]:
    with safe_open(str(path), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    weights: dict[str, BlockWeight | None] = {}
    for name, fmt in formats.items():
        weights[name] = None if fmt is None else FORMATS[fmt](
            **{field: tensors[f"{name}.{field}"] for field in FORMATS[fmt].FIELDS})
    return weights
