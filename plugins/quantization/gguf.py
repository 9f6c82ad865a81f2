"""`--quantization gguf`: serve a GGUF file's 4-bit and 8-bit weights as they are in the file.

The GGUF loader hands the model float weights dequantized from the file. Each linear layer's
weights are checked block by block (32 values, as in the file) against the two formats torch's
CPU weight-only int4 kernel can compute, and rebuilt as its 4-bit planes:

- Q4_1: w = d * q + m, q in 0..15. The kernel computes (q - 8) * scale + zero, so scale = d
  and zero = m + 8d.
- Q8_0: w = d * q, q in -127..127. Split q + 128 = 16 * hi + lo into two 4-bit planes:
  w = 16d * (hi - 8) + d * (lo - 8) + 8d, two int4 products whose sum is the layer's.

The kernel takes bf16 scales and activations, so its products equal the file's to bf16
precision. A layer whose weights fit neither format stays dense. Small batches (decode) read
the 4-bit planes: one token's product is bound by the bytes read, 4.5 bits a weight instead of
32 or 16. Larger batches are bound by arithmetic, where the served dtype's dense kernels are
faster, so the layer keeps the loader's dense copy for them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from srv.sdk.quantization import QuantizationMethod

GROUP = 32
# Rows times planes from which the dense copy is used. Measured on AVX2 (SmolLM2's shapes): the
# int4 kernel reads 4x fewer bytes but computes more slowly, and a float32 product whose weight
# comes from DRAM overtakes one int4 plane at about 16 rows (decode steps, in the model).
DENSE_FROM_ROWS = 16
ROWS_PER_SLICE = 1024
# Recovered blocks must rebuild the file's values to float32 rounding.
TOLERANCE = 1e-6


class Int4Plane(nn.Module):
    """One weight in torch's int4-packed layout with its per-block scale and zero."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        super().__init__()
        # Plain attributes, not buffers: casting the model to the served dtype must leave them.
        self.packed = packed
        # [K / GROUP, N, 2], the kernel's layout, in bf16: its fast activation dtype on CPU.
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)


class GGUFLinear(nn.Module):
    def __init__(self, planes: list[Int4Plane], dense: nn.Linear) -> None:
        super().__init__()
        self.planes = nn.ModuleList(planes)
        self.dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows * len(self.planes) >= DENSE_FROM_ROWS:
            return self.dense(x)
        flat = x.reshape(rows, x.shape[-1]).to(torch.bfloat16)
        out = self.planes[0](flat)
        for plane in self.planes[1:]:
            out = out + plane(flat)
        if self.dense.bias is not None:
            out = out + self.dense.bias
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


# (q in 0..15, scale, zero) of each int4 product whose sum is a layer's weight.
Planes = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def q4_1_planes(weight: torch.Tensor) -> Planes | None:
    """Q4_1: weight == d * q + m block by block, one plane; None if the weight is not Q4_1."""
    blocks = weight.float().view(weight.shape[0], -1, GROUP)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = blocks.sub(low).div_(torch.where(d > 0, d, 1.0)).round_().clamp_(0, 15)
    if not _rebuilds(blocks, q.mul(d).add_(low), torch.maximum(low.abs(), high.abs())):
        return None
    d, low = d.squeeze(-1), low.squeeze(-1)
    return [(q.view_as(weight), d, low + 8 * d)]


def q8_0_planes(weight: torch.Tensor) -> Planes | None:
    """Q8_0: weight == d * q block by block, two planes; None if the weight is not Q8_0."""
    blocks = weight.float().view(weight.shape[0], -1, GROUP)
    largest = blocks.abs().amax(-1, keepdim=True)
    d = largest / 127
    q = blocks.div(torch.where(d > 0, d, 1.0)).round_().clamp_(-127, 127)
    if not _rebuilds(blocks, q.mul(d), largest):
        return None
    shifted = q.view_as(weight).to(torch.int32).add_(128)
    d = d.squeeze(-1)
    return [(shifted >> 4, 16 * d, 8 * d), (shifted & 15, d, torch.zeros_like(d))]


def _rebuilds(blocks: torch.Tensor, rebuilt: torch.Tensor, largest: torch.Tensor) -> bool:
    """Whether every block rebuilds to float32 rounding of its largest magnitude."""
    error = rebuilt.sub_(blocks).abs_().amax(-1, keepdim=True)
    return bool((error <= TOLERANCE * largest).all())


def int4_planes(weight: torch.Tensor) -> list[Int4Plane] | None:
    """The weight's planes in the first format every block fits, or None.

    Works through slices of rows (torch's int4 packing is row by row): small temporaries the
    allocator reuses, where one pass over a whole vocabulary head spends most of its time
    faulting in fresh pages.
    """
    if weight.shape[1] % GROUP:
        return None
    for planes_of in (q4_1_planes, q8_0_planes):
        slices = []
        for rows in weight.split(ROWS_PER_SLICE):
            planes = planes_of(rows)
            if planes is None:
                break
            slices.append([(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), scale, zero)
                           for q, scale, zero in planes])
        else:
            return [Int4Plane(*(torch.cat(parts) for parts in zip(*plane))) for plane in zip(*slices)]
    return None


class GGUFQuantization(QuantizationMethod):
    def check(self, model_path: str) -> None:
        if Path(model_path).suffix != ".gguf":
            raise ValueError(f"--quantization gguf serves a .gguf file's own weights; {model_path} is not one")

    def quantize(self, name: str, linear: nn.Linear) -> nn.Module | None:
        planes = int4_planes(linear.weight.detach())
        return None if planes is None else GGUFLinear(planes, linear)
