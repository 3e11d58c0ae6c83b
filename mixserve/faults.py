"""Fault injection for the KV page table: the bookkeeping bugs the integrity check must catch.

Each fault is a pure function `PageTable -> PageTable` (jittable) that corrupts the table the way
a real scheduler or allocator bug would. No table operation raises on the corrupted table: only
`page_table.verify` notices, and it flags exactly the slots whose mappings went bad.
Targets are slot indices (`slot`, `other`) and a logical page index (`index`) within `slot`; they
must name live mappings.
"""

from __future__ import annotations

import enum

import jax

from mixserve.page_table import PageTable, allocate


class FaultKind(enum.StrEnum):
    NONE = "none"
    STALE_TAG = "stale_tag"
    DOUBLE_ALLOCATION = "double_allocation"
    USE_AFTER_FREE = "use_after_free"
    SWAPPED_MAPPING = "swapped_mapping"
    OUT_OF_RANGE = "out_of_range"


def stale_tag(table: PageTable, slot, index=0) -> PageTable:
    """Re-stamp `slot`'s index-th page with a fresh tag behind its back, as if a bookkeeping bug
    had reallocated it. Every slot mapping that page now sees a tag mismatch."""
    page = table.pages_BN[slot, index]
    return table.replace(
        tag_P=table.tag_P.at[page].set(table.next_tag), next_tag=table.next_tag + 1
    )


def _push_free(table: PageTable, page) -> PageTable:
    """Put `page` on top of the free stack without checking that it is unreferenced (the bug)."""
    return table.replace(
        free_stack_P=table.free_stack_P.at[table.num_free].set(page),
        num_free=table.num_free + 1,
    )


def double_allocation(table: PageTable, slot, other, index=0) -> PageTable:
    """Hand `slot`'s index-th page to `other` as if it were free: the allocator stamps a fresh tag
    and `other` records it, so `slot`'s mapping is stale while `other`'s is consistent.
    `other` must have room for one more page."""
    table, _ = allocate(_push_free(table, table.pages_BN[slot, index]), other, 1)
    return table


def use_after_free(table: PageTable, slot, index=0) -> PageTable:
    """Release `slot`'s index-th page to the free stack (ref count 0) while `slot` still maps it.
    Verify reports it as freed; once reallocated, as a tag mismatch."""
    page = table.pages_BN[slot, index]
    return _push_free(table.replace(ref_count_P=table.ref_count_P.at[page].set(0)), page)


def swapped_mapping(table: PageTable, slot, other) -> PageTable:
    """Swap the page lists of `slot` and `other`; their recorded tags stay, so both mismatch."""
    pages_BN = table.pages_BN
    return table.replace(
        pages_BN=pages_BN.at[slot].set(pages_BN[other]).at[other].set(pages_BN[slot])
    )


def out_of_range(table: PageTable, slot, index=0) -> PageTable:
    """Point `slot`'s index-th mapping at page id P, one past the pool."""
    return table.replace(
        pages_BN=table.pages_BN.at[slot, index].set(table.num_pool_pages)
    )


_FAULTS = {
    FaultKind.STALE_TAG: stale_tag,
    FaultKind.DOUBLE_ALLOCATION: double_allocation,
    FaultKind.USE_AFTER_FREE: use_after_free,
    FaultKind.SWAPPED_MAPPING: swapped_mapping,
    FaultKind.OUT_OF_RANGE: out_of_range,
}


def inject(table: PageTable, kind: FaultKind | str, **targets: jax.typing.ArrayLike) -> PageTable:
    """Apply fault `kind` (a FaultKind or its string value) with the fault's own targets, e.g.
    `inject(table, "swapped_mapping", slot=0, other=1)`. NONE returns the table unchanged and
    ignores the targets, so callers can pass them unconditionally."""
    kind = FaultKind(kind)
    if kind is FaultKind.NONE:
        return table
    return _FAULTS[kind](table, **targets)
