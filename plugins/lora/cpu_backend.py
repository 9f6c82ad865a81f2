"""srv's CPU LoRA backend: every adapter's products of a batch in one C call a layer
(lora_kernels.c), and a C kernel for each wrapped layer so that a model's C decode steps keep it:
the base layer's own kernel, then the adapters' products.

Each adapter's A and B are kept in the layouts the kernel reads (A transposed, its ranks padded to
a vector; B transposed and cut into blocks of columns), in bfloat16 where the model serves
bfloat16 (half the bytes each step reads) and float32 otherwise; a
layer's table of what each slot adds is kept beside the layer's own list and refreshed when the
core changes a slot (`products_changed`). The batch's rows by adapter (`set_segments`) are one
table every layer's kernel reads.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import weakref
from pathlib import Path

import torch

from srv.sdk.lora import LoRABackend, LoRAProduct, LoRASegment
from srv.sdk.native import NativeKernel, load_c_library, pick_isa

MAX_PRODUCTS = 3   # a fused layer's targets (q, k and v)
PAD = 16           # lora_kernels.c pads A^T's ranks to a multiple of it
COLUMNS = 64       # lora_kernels.c's block of B^T's columns
ISAS = {"portable": 0, "avx2": 1, "avx512": 2}
ISA_FLAGS = {"avx512": ("avx512f", "avx512bw"), "avx2": ("avx2", "fma"), "portable": ()}   # the CPU flags each needs
# Below this many multiply-adds a layer (a decode step's few rows), one thread does it all: the
# passes are bound by reading the adapters' weights, which a second thread barely speeds up, while
# each barrier of the passes waits for any thread the machine has descheduled.
PARALLEL_WORK = 1 << 21


@functools.cache
def kernels() -> ctypes.CDLL:
    # No instruction-set flags: each body is compiled for its own (target attributes) and the
    # batch names the one the CPU has.
    library = load_c_library(Path(__file__).with_name("lora_kernels.c"), ("-ffp-contract=fast",))
    library.srv_lora_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return library


@functools.cache
def best_isa() -> str:
    """The fastest kernel this CPU runs; $SRV_LORA_ISA picks another (a slower one, to test it)."""
    return pick_isa(ISA_FLAGS, "SRV_LORA_ISA")


def kernel_layout(product: LoRAProduct) -> tuple[torch.Tensor, torch.Tensor]:
    """A product's A and B as the kernel reads them: A^T [in][ranks padded to PAD] and B^T in
    blocks of COLUMNS columns [blocks][rank][COLUMNS], bfloat16 or float32, the padding zeros."""
    rank, in_features = product.a.shape
    columns = product.b.shape[0]
    dtype = weight_dtype(product)
    at = torch.zeros(in_features, -(-rank // PAD) * PAD, dtype=dtype)
    at[:, :rank] = product.a.t()
    blocks = -(-columns // COLUMNS)
    bt = torch.zeros(blocks * COLUMNS, rank, dtype=dtype)
    bt[:columns] = product.b
    return at, bt.view(blocks, COLUMNS, rank).transpose(1, 2).contiguous()


def weight_dtype(product: LoRAProduct) -> torch.dtype:
    return torch.bfloat16 if product.a.dtype == torch.bfloat16 else torch.float32


class CProduct(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_int64), ("columns", ctypes.c_int64), ("rank", ctypes.c_int64),
                ("scaling", ctypes.c_float), ("bf16", ctypes.c_int64), ("at", ctypes.c_void_p),
                ("bt", ctypes.c_void_p)]


class CSlot(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int64), ("products", CProduct * MAX_PRODUCTS)]


class CBatch(ctypes.Structure):
    _fields_ = [("groups", ctypes.c_int64), ("slot", ctypes.c_void_p), ("starts", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("chunk", ctypes.c_int64), ("isa", ctypes.c_int64),
                ("parallel_work", ctypes.c_int64)]


class CLayer(ctypes.Structure):
    _fields_ = [("base", NativeKernel), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("slots", ctypes.c_void_p), ("batch", ctypes.c_void_p)]


class LayerTable:
    """What each slot adds to one wrapped layer, as the kernel reads it, and the C layers (one
    per base kernel, plus one without) that point at it."""

    def __init__(self, products: list[list[LoRAProduct]], in_features: int, out_features: int) -> None:
        self.products, self.in_features, self.out_features = products, in_features, out_features
        self.slots = (CSlot * len(products))()
        self.held: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in products]
        self.layers: dict[tuple[int, int], CLayer] = {}

    def layer(self, base: NativeKernel | None, batch: CBatch) -> CLayer:
        key = (base.function, base.context) if base is not None else (0, 0)
        if key not in self.layers:
            self.layers[key] = CLayer(base if base is not None else NativeKernel(), self.in_features,
                                      self.out_features, ctypes.addressof(self.slots), ctypes.addressof(batch))
        return self.layers[key]


class CPULoRABackend(LoRABackend):
    def __init__(self, server_args=None) -> None:
        super().__init__(server_args)
        kernels()
        chunk = getattr(server_args, "max_lora_chunk_size", None) or 16
        self.batch = CBatch(0, None, None, None, chunk, ISAS[best_isa()], PARALLEL_WORK)
        self._batch_arrays: tuple[torch.Tensor, ...] = ()
        self._segments: list[LoRASegment] | None = None
        self._tables: dict[int, LayerTable] = {}
        # Each product's float32 A and B^T, made once however often its adapter changes slot.
        self._prepared: weakref.WeakKeyDictionary[LoRAProduct, tuple[torch.Tensor, torch.Tensor]] = \
            weakref.WeakKeyDictionary()

    @property
    def isa(self) -> str:
        return next(name for name, value in ISAS.items() if value == self.batch.isa)

    @isa.setter
    def isa(self, name: str) -> None:
        self.batch.isa = ISAS[name]

    # ---- the batch ----------------------------------------------------------------------

    def set_segments(self, segments: list[LoRASegment], rows: int) -> None:
        groups: dict[int, list[int]] = {}
        for segment in segments:
            if segment.slot >= 0:
                groups.setdefault(segment.slot, []).extend(range(segment.start, segment.end))
        slots = torch.tensor(list(groups), dtype=torch.int64)
        starts = torch.tensor([0, *itertools.accumulate(len(r) for r in groups.values())], dtype=torch.int64)
        indices = torch.tensor([i for r in groups.values() for i in r], dtype=torch.int64)
        self._batch_arrays = (slots, starts, indices)   # the C batch points into them
        self.batch.groups = len(groups)
        self.batch.slot, self.batch.starts, self.batch.rows = (t.data_ptr() for t in self._batch_arrays)
        self._segments = segments

    # ---- the layers ---------------------------------------------------------------------

    def _prepare(self, product: LoRAProduct) -> tuple[torch.Tensor, torch.Tensor]:
        prepared = self._prepared.get(product)
        if prepared is None:
            prepared = self._prepared[product] = kernel_layout(product)
        return prepared

    def _table(self, products: list[list[LoRAProduct]], in_features: int, out_features: int) -> LayerTable:
        table = self._tables.get(id(products))
        if table is None or table.products is not products:
            table = self._tables[id(products)] = LayerTable(products, in_features, out_features)
            for slot in range(len(products)):
                self._fill(table, slot)
        return table

    def _fill(self, table: LayerTable, slot: int) -> None:
        products = table.products[slot]
        if len(products) > MAX_PRODUCTS:
            raise ValueError(f"a layer with {len(products)} LoRA targets; the kernel takes at most {MAX_PRODUCTS}")
        held = [self._prepare(p) for p in products]
        entry = table.slots[slot]
        for i, (p, (at, bt)) in enumerate(zip(products, held)):
            entry.products[i] = CProduct(p.offset, p.b.shape[0], p.a.shape[0], p.scaling, at.dtype == torch.bfloat16,
                                         at.data_ptr(), bt.data_ptr())
        entry.count = len(products)
        table.held[slot] = held   # the table points into them

    def products_changed(self, products: list[list[LoRAProduct]], slot: int) -> None:
        table = self._tables.get(id(products))
        if table is not None and table.products is products:
            self._fill(table, slot)

    def add(self, out: torch.Tensor, x: torch.Tensor, products: list[list[LoRAProduct]],
            segments: list[LoRASegment]) -> None:
        if segments is not self._segments:
            self.set_segments(segments, x.shape[0])
        table = self._table(products, x.shape[1], out.shape[1])
        # The kernel reads and writes float32 or bfloat16 rows; other dtypes go through float32.
        dtype = out.dtype if out.dtype in (torch.float32, torch.bfloat16) else torch.float32
        xs = x.to(dtype).contiguous()
        ys = out if out.dtype == dtype and out.is_contiguous() else out.to(dtype).contiguous()
        kernels().srv_lora_add(ctypes.addressof(table.layer(None, self.batch)), xs.data_ptr(), ys.data_ptr(),
                               dtype == torch.bfloat16)
        if ys is not out:
            out.copy_(ys)

    def native_linear(self, base: NativeKernel, products: list[list[LoRAProduct]], in_features: int,
                      out_features: int) -> NativeKernel:
        table = self._table(products, in_features, out_features)
        return NativeKernel.of(kernels().srv_lora_linear, table.layer(base, self.batch))

