"""KV memory: pages of cache slots handed to requests, and the request-to-token table."""

from __future__ import annotations

import torch


class OutOfKVMemory(Exception):
    pass


class PagedSlotAllocator:
    """Hands out KV cache slots a page at a time; slot 0 (page 0) is reserved for padding."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self._free_pages = list(range(num_pages - 1, 0, -1))

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def allocate_pages(self, count: int) -> list[int]:
        if count > len(self._free_pages):
            raise OutOfKVMemory(f"need {count} KV pages, {len(self._free_pages)} free")
        return [self._free_pages.pop() for _ in range(count)]

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free the pages whose first slot is in `slots` (callers free whole pages)."""
        if slots.numel():
            pages = torch.unique(slots // self.page_size)
            self._free_pages.extend(pages.tolist())


class ReqToTokenPool:
    """Row r holds the cache slots of the tokens of the request that owns row r."""

    def __init__(self, max_requests: int, max_context: int) -> None:
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int64)
        # The same memory as a NumPy array, for the few slots a decode step reads and writes: a
        # NumPy call is a fraction of a torch operator's dispatch, which is slow between forward
        # passes (each pass pushes the interpreter's and torch's data out of the caches).
        self.array = self.table.numpy()
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def write(self, row: int, start: int, slots: list[int]) -> None:
        """Row `row`'s columns from `start` on hold `slots`."""
        self.array[row, start:start + len(slots)] = slots

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self.table[row].zero_()
        self._free_rows.append(row)
