"""A GGUF tensor's blocks, read from the file's bytes, in the layouts of gguf_kernels.c.

Each GGML block type stores, per block of inputs, small integers with a float16 scale (and for
some a min), the K-quants in super-blocks of 256 with 6-, 8- or 4-bit sub-block scales. Every
type unpacks exactly (`w = scale * q + min` in float32, one rounding, as gguf's own dequantizer
computes it) into one of three layouts:

- Q4_1 (4-bit q, scale and min per 32): Q4_0 (min = -8 scale), Q4_1, Q4_K (scale = d * sc,
  min = -dmin * m);
- Q8_0 (int8 q, scale per 32): Q8_0, Q5_0 (q - 16);
- Q8_16 (int8 q, scale and min per 16): Q5_1, Q5_K, Q6_K (q - 32), Q3_K, Q2_K.

The layouts as gguf-py's dequantizers read them (llama.cpp's ggml-quants.c); what each
function returns is (q [blocks, values], scale [blocks, sub-blocks], min or None).
"""

from __future__ import annotations

import numpy as np
import torch

from srv.plugins.quantization.gguf import BLOCKS, BlockWeight, Q4_1Weight, Q8_0Weight, Q8_16Weight


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes in chunks of `chunk`: the low nibbles of a chunk, then its high ones."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of the little-endian words `qh` [blocks, count / 8 bytes] as values j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :count]


def q4_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18], 16), d, -8 * d


def q4_1(b):
    return _nibbles(b[:, 4:20], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def q8_0(b):
    return b[:, 2:34].view(np.int8).astype(np.int16), _f16(b[:, 0:2]), None


def q5_0(b):
    q = _nibbles(b[:, 6:22], 16) | (_high_bits(b[:, 2:6], 32) << 4)
    return q.astype(np.int16) - 16, _f16(b[:, 0:2]), None


def q5_1(b):
    q = _nibbles(b[:, 8:24], 16) | (_high_bits(b[:, 4:8], 32) << 4)
    return q, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _k_scales(scales: np.ndarray):
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(scales.copy())
    return sc.astype(np.float32), m.astype(np.float32)


def q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:144], 32), d * sc, -(dmin * m)


def q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    n = b.shape[0]
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _nibbles(b[:, 48:176], 32) | (high.reshape(n, -1) << 4)
    return q, d * sc, -(dmin * m)


def q6_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, 0:128], 64)
    high = (b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(n, -1) << 4)).astype(np.int16) - 32
    return q, _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32), None


def q3_k(b):
    n = b.shape[0]
    scales = b[:, 96:108]
    low = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = (((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int16) - 32).astype(np.float32)
    ql = (b[:, 32:96].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (b[:, 0:32].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = ql.reshape(n, -1).astype(np.int16) - ((qh.reshape(n, -1) ^ 1) << 2).astype(np.int16)
    return q, _f16(b[:, 108:110]) * sc, None


def q2_k(b):
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = (b[:, 16:80].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return q.reshape(n, -1), d * (scales & 0x0F).astype(np.float32), -(dmin * (scales >> 4).astype(np.float32))


UNPACK = {"Q4_0": q4_0, "Q4_1": q4_1, "Q8_0": q8_0, "Q5_0": q5_0, "Q5_1": q5_1, "Q2_K": q2_k, "Q3_K": q3_k,
          "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
LAYOUT = {"Q4_0": Q4_1Weight, "Q4_1": Q4_1Weight, "Q4_K": Q4_1Weight, "Q8_0": Q8_0Weight, "Q5_0": Q8_0Weight,
          "Q5_1": Q8_16Weight, "Q5_K": Q8_16Weight, "Q6_K": Q8_16Weight, "Q3_K": Q8_16Weight, "Q2_K": Q8_16Weight}


def unpacked(kind: str, raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [rows, K] int16, scale [rows, K / sub-block], min or None) of `rows` rows of `kind`
    blocks, `raw` their bytes."""
    size, values = BLOCKS[kind]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    q, scale, low = UNPACK[kind](blocks)
    q = torch.from_numpy(np.ascontiguousarray(q).astype(np.int16)).reshape(rows, -1)
    scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).reshape(rows, -1)
    low = None if low is None else torch.from_numpy(np.ascontiguousarray(low, dtype=np.float32)).reshape(rows, -1)
    return q, scale, low


def dequantized(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    """w = scale * q + min in float32 with one rounding (float64 is exact for these values)."""
    per = q.shape[1] // scale.shape[1]
    w = q.double() * scale.double().repeat_interleave(per, 1)
    if low is not None:
        w += low.double().repeat_interleave(per, 1)
    return w.float()


def layer_weight(parts: list[tuple[str, np.ndarray, int]]) -> BlockWeight:
    """A layer's weights in the layout gguf_kernels.c computes, from the blocks of its shards
    stacked along the outputs: (kind, bytes, rows) each. Shards of different layouts (a
    Q4_K_M file's Q4_K query and Q6_K value projections) meet in Q8_16, which holds them all."""
    layouts = {LAYOUT[kind] for kind, _, _ in parts}
    layout = layouts.pop() if len(layouts) == 1 else Q8_16Weight
    shards = [unpacked(kind, raw, rows) for kind, raw, rows in parts]
    if layout is Q8_16Weight:
        shards = [_in_16s(*shard) for shard in shards]
    q = torch.cat([shard[0] for shard in shards])
    scale = torch.cat([shard[1] for shard in shards])
    if layout is Q8_0Weight:
        return Q8_0Weight.from_blocks(q, scale)
    low = torch.cat([shard[2] for shard in shards])
    if layout is Q8_16Weight:
        return Q8_16Weight(q.to(torch.int8).contiguous(), scale.contiguous(), low.contiguous())
    return Q4_1Weight.from_blocks(q, scale, low)


def _in_16s(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None):
    """One shard's scale and min per 16 values (a 32-value sub-block's on both its halves)."""
    if q.shape[1] // scale.shape[1] == 32:
        scale, low = scale.repeat_interleave(2, 1), None if low is None else low.repeat_interleave(2, 1)
    return q, scale, torch.zeros_like(scale) if low is None else low
