"""The host tier of the hierarchical cache: keys and values of whole pages in host memory, in
the layout `--hicache-mem-layout` names, copied from and to the KV pool the model reads (every
layer and key/value head of the model: under tensor or pipeline parallelism the model runner
gathers the ranks' shares into rank 0's rows, ModelRunner.read_kv).

Every layout is one buffer seen through `canonical`, a view ordered (page, token in page,
layer, key or value, head, dim), so copies are written once for all layouts. Values are kept
as the pool stores them (a float8 pool's scaled bytes), so a copy back is exact.
"""

from __future__ import annotations

import torch

# layout -> (buffer dims in terms of P pages, S tokens a page, L layers, 2, H heads, D dims;
#            the permutation that orders the buffer canonically)
LAYOUTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "layer_first": ("L2PSHD", (2, 3, 0, 1, 4, 5)),
    "page_first": ("PSL2HD", (0, 1, 2, 3, 4, 5)),
    "page_first_direct": ("PL2SHD", (0, 3, 1, 2, 4, 5)),
    "page_first_kv_split": ("2PSLHD", (1, 2, 3, 0, 4, 5)),
}


class HostKVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, layout: str = "layer_first") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"--hicache-mem-layout {layout!r}: srv keeps {', '.join(LAYOUTS)}")
        dims, order = LAYOUTS[layout]
        sizes = {"P": num_pages, "S": page_size, "L": num_layers, "2": 2, "H": num_kv_heads, "D": head_dim}
        self.buffer = torch.empty([sizes[d] for d in dims], dtype=dtype)
        self.canonical = self.buffer.permute(*order)
        self.num_pages, self.page_size, self.num_layers, self.dtype = num_pages, page_size, num_layers, dtype
        self.page_shape = (page_size, num_layers, 2, num_kv_heads, head_dim)
        self.page_nbytes = page_size * num_layers * 2 * num_kv_heads * head_dim * self.buffer.element_size()
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def store(self, pages: list[int], rows: torch.Tensor) -> None:
        """Keep `rows` (whole pages of tokens in order, [tokens, layers, 2, kv heads, head_dim]
        as the pool stores them: KVCache.stored_rows) in `pages`."""
        self.canonical[torch.tensor(pages)] = rows.view(len(pages), *self.page_shape)

    def rows(self, pages: list[int]) -> torch.Tensor:
        """What `store` kept in `pages`, as the rows it was given."""
        return self.canonical[torch.tensor(pages)].reshape(len(pages) * self.page_size, *self.page_shape[1:])

    def page_bytes(self, page: int) -> bytes:
        """One page's keys and values, canonically ordered, as bytes (what storage keeps)."""
        data = self.canonical[page].contiguous()
        return data.view(torch.uint8).numpy().tobytes()

    def set_page_bytes(self, page: int, data: bytes) -> None:
        if len(data) != self.page_nbytes:
            raise ValueError(f"a page holds {self.page_nbytes} bytes, not {len(data)}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.canonical[page] = raw.view(self.dtype).view(self.page_shape)
