"""The prefix cache's host tier (SGLang's HiCache, vLLM's CPU offload): full pages that the device
cache evicts are copied to host memory first, and a later request whose prefix the device no
longer holds, but the host does, gets those pages copied back into fresh device pages instead of
prefilling their tokens again.

Write-back: a page is copied once, when the device cache evicts it (not when it is cached), so a
workload that fits the device pool pays nothing. Keys are the device cache's (a SHA-256 chain over
the cache salt and the tokens up to the page's end, PageManager.page_keys): one key, one page of
KV, in the pools' own format (FP8 pages are half the host bytes of BF16 ones, as on the device).
Full, it drops its least recently used pages. A restored page is a fresh allocation, stamped
with a new tag and cached on the device like any other: the integrity check covers it as it
covers every page; the host copy itself is immutable, so no later write can change what a key
restores. A page may carry its tokens' replay rows (Engine(return_routed_experts=True) or
return_indexer_topk: mixserve.request.replay_dtype): they stay with its KV, so a restored page
brings the routing and indexer choices of the forward that computed that KV.

The host copies go through two callbacks of the model runner, so this file holds no JAX:
read(page_ids) -> per page, per layer, {pool name: that page's slice} on the host; and
write(page_ids, pages) puts such slices into those device pages.
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np

Page = list[dict[str, np.ndarray]]  # one page of KV: per layer, each pool's slice
Rows = np.ndarray | None  # a page's replay rows ([page size] of request.replay_dtype), or None


class HostKVCache:
    def __init__(self, capacity_bytes: int, read: Callable[[list[int]], list[Page]],
                 write: Callable[[list[int], list[Page]], None]):
        if capacity_bytes <= 0:
            raise ValueError(f"the host KV cache needs a positive capacity, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self._read, self._write = read, write
        # least recently used first; each page with its replay rows
        self._pages: collections.OrderedDict[bytes, tuple[Page, Rows]] = collections.OrderedDict()
        self.bytes = 0  # held: the sum of the pages' array bytes, rows included
        self.stored_pages = 0  # copied in from the device (evicted there)
        self.loaded_pages = 0  # copied back to the device (a hit)
        self.dropped_pages = 0  # dropped for room, least recently used first

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def prefix(self, keys: list[bytes]) -> int:
        """How many of keys, from the first, the host holds."""
        return next((i for i, key in enumerate(keys) if key not in self._pages), len(keys))

    def touch(self, keys: list[bytes]) -> None:
        """Mark the held ones among keys used now, the first last (dropped last)."""
        for key in reversed(keys):
            if key in self._pages:
                self._pages.move_to_end(key)

    def store(self, keys: list[bytes], page_ids: list[int], rows: list[Rows] | None = None) -> None:
        """Copy device pages page_ids, cached under keys (least recently used first, as the device
        evicts them), to the host, each with its replay rows if given: those it does not hold
        already (the same key is the same prefix; the held page keeps its own rows, those of its
        KV), and all of them as used now, in that order; then drop the least recently used past
        the capacity."""
        rows = rows or [None] * len(keys)
        new = [(key, page, r) for key, page, r in zip(keys, page_ids, rows) if key not in self._pages]
        read = dict(zip([key for key, _, _ in new], zip(self._read([page for _, page, _ in new]),
                                                         [r for _, _, r in new]))) if new else {}
        for key in keys:  # in the device's eviction order: a prefix's last page first, its first page newest
            if key in read:
                self._pages[key] = read[key]
                self.bytes += _nbytes(read[key])
            else:
                self._pages.move_to_end(key)
        self.stored_pages += len(new)
        while self.bytes > self.capacity_bytes:
            _, page = self._pages.popitem(last=False)
            self.bytes -= _nbytes(page)
            self.dropped_pages += 1

    def load(self, keys: list[bytes], page_ids: list[int]) -> list[Rows]:
        """Copy the host's pages of keys (all held: `prefix`) into device pages page_ids, and mark
        them used now; returns their replay rows."""
        self._write(page_ids, [self._pages[key][0] for key in keys])
        self.touch(keys)
        self.loaded_pages += len(keys)
        return [self._pages[key][1] for key in keys]

    def clear(self) -> int:
        """Drop every page; returns how many."""
        n = len(self._pages)
        self._pages.clear()
        self.bytes = 0
        return n


def _nbytes(held: tuple[Page, Rows]) -> int:
    page, rows = held
    return sum(a.nbytes for layer in page for a in layer.values()) + (0 if rows is None else rows.nbytes)
