"""Each injected fault is caught by `verify` for exactly the affected slots, with an abort reason
that names the page and tags; the table itself keeps working and never notices."""

import jax
import numpy as np
import pytest

from mixserve import faults
from mixserve import page_table as pt
from mixserve.faults import FaultKind
from mixserve.page_table import Violation

P, B, N = 16, 5, 4
ALL_ACTIVE_B = np.ones(B, bool)
allocate = jax.jit(pt.allocate)
share = jax.jit(pt.share)
release = jax.jit(pt.release)
verify = jax.jit(pt.verify)


def host(table):
    return jax.device_get(table)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)), strict=True):
        np.testing.assert_array_equal(x, y)


def serving_table():
    """Slots 0-2 hold own pages; slot 3 shares slot 2's first page and has one own; slot 4 is empty.

    pages: slot 0 -> [0, 1, 2], slot 1 -> [3, 4], slot 2 -> [5, 6], slot 3 -> [5, 7].
    """
    table = pt.init_page_table(P, B, N)
    for slot, n in [(0, 3), (1, 2), (2, 2)]:
        table, _ = allocate(table, np.int32(slot), np.int32(n))
    table, _ = share(table, np.int32(3), table.pages_BN[2], np.int32(1))
    table, _ = allocate(table, np.int32(3), np.int32(1))
    pt.assert_consistent(table)
    return table


# name -> (kind, targets, violation, expected first bad mapping per flagged slot given the clean
# host table c: {slot: (logical index, page, expected tag, found tag or None if no tag)}).
CASES = {
    "stale_tag": (
        FaultKind.STALE_TAG, dict(slot=0, index=1), Violation.TAG_MISMATCH,
        lambda c: {0: (1, c.pages_BN[0, 1], c.expected_tag_BN[0, 1], c.next_tag)},
    ),
    "stale_tag_on_shared_page": (
        FaultKind.STALE_TAG, dict(slot=2, index=0), Violation.TAG_MISMATCH,
        lambda c: {s: (0, c.pages_BN[2, 0], c.expected_tag_BN[2, 0], c.next_tag) for s in (2, 3)},
    ),
    "double_allocation": (
        FaultKind.DOUBLE_ALLOCATION, dict(slot=0, other=1, index=2), Violation.TAG_MISMATCH,
        lambda c: {0: (2, c.pages_BN[0, 2], c.expected_tag_BN[0, 2], c.next_tag)},
    ),
    "use_after_free": (
        FaultKind.USE_AFTER_FREE, dict(slot=1, index=0), Violation.FREED,
        lambda c: {1: (0, c.pages_BN[1, 0], c.expected_tag_BN[1, 0], c.expected_tag_BN[1, 0])},
    ),
    "swapped_mapping": (
        FaultKind.SWAPPED_MAPPING, dict(slot=0, other=1), Violation.TAG_MISMATCH,
        lambda c: {
            0: (0, c.pages_BN[1, 0], c.expected_tag_BN[0, 0], c.expected_tag_BN[1, 0]),
            1: (0, c.pages_BN[0, 0], c.expected_tag_BN[1, 0], c.expected_tag_BN[0, 0]),
        },
    ),
    "out_of_range": (
        FaultKind.OUT_OF_RANGE, dict(slot=0, index=2), Violation.OUT_OF_RANGE,
        lambda c: {0: (2, P, c.expected_tag_BN[0, 2], None)},
    ),
    "none": (FaultKind.NONE, dict(slot=0), Violation.OK, lambda c: {}),
}
case_params = pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())


@case_params
def test_fault_is_flagged_for_exactly_the_affected_slots(case):
    kind, targets, violation, expect = case
    clean = serving_table()
    bad = expect(host(clean))
    report = verify(faults.inject(clean, kind, **targets), ALL_ACTIVE_B)
    assert np.flatnonzero(~host(report.ok_B)).tolist() == sorted(bad)
    for slot, (index, page, expected_tag, found_tag) in bad.items():
        assert int(report.kind_B[slot]) == violation
        found = "no tag" if found_tag is None else f"tag {found_tag}"
        reason = pt.describe(report, slot)
        assert reason.startswith(
            f"page {page} (logical {index}): expected tag {expected_tag}, found {found} ("
        ), reason


@case_params
def test_fault_is_silent_without_verify(case):
    """The table never notices: all ops keep working, and unchecked (inactive) slots pass."""
    kind, targets, *_ = case
    table = faults.inject(serving_table(), kind, **targets)
    assert bool(verify(table, np.zeros(B, bool)).ok_B.all())
    table, ok = share(table, np.int32(4), table.pages_BN[2], np.int32(1))
    assert ok
    for slot in range(B):
        table = release(table, np.int32(slot))
    table, ok = allocate(table, np.int32(4), np.int32(N))
    assert ok


@case_params
def test_fault_injection_jits_with_traced_targets(case):
    kind, targets, *_ = case
    jitted = jax.jit(lambda table, targets: faults.inject(table, kind, **targets))
    traced_targets = {name: np.int32(v) for name, v in targets.items()}
    table = serving_table()
    assert_same(jitted(table, traced_targets), faults.inject(table, kind, **targets))


def test_fault_kind_parses_from_string():
    assert_same(faults.inject(serving_table(), "none"), serving_table())
    assert FaultKind("use_after_free") is FaultKind.USE_AFTER_FREE


def test_double_allocation_keeps_new_owner_consistent_when_victim_is_aborted():
    table = faults.double_allocation(serving_table(), slot=0, other=1, index=2)
    stolen = int(table.pages_BN[0, 2])
    assert int(table.pages_BN[1, 2]) == stolen and int(table.num_pages_B[1]) == 3
    # Aborting the victim must not free the page its stale mapping points at.
    table = release(table, np.int32(0))
    assert int(table.ref_count_P[stolen]) == 1
    assert bool(verify(table, ALL_ACTIVE_B).ok_B.all())
    pt.assert_consistent(table)


def test_use_after_free_becomes_tag_mismatch_once_the_page_is_reallocated():
    table = faults.use_after_free(serving_table(), slot=1, index=0)
    freed = int(table.pages_BN[1, 0])
    table, ok = allocate(table, np.int32(4), np.int32(1))
    assert ok and int(table.pages_BN[4, 0]) == freed  # the freed page was on top of the stack
    report = verify(table, ALL_ACTIVE_B)
    assert np.flatnonzero(~host(report.ok_B)).tolist() == [1]
    assert int(report.kind_B[1]) == Violation.TAG_MISMATCH
    # Aborting slot 1 leaves the page to its new owner.
    table = release(table, np.int32(1))
    pt.assert_consistent(table)


def test_release_of_corrupt_mappings_leaks_pages_instead_of_freeing_them():
    """Documented trade-off: a mapping that fails verify gives back no reference, so after a
    swap both slots' pages stay allocated (lost capacity) rather than risk freeing a live page."""
    table = faults.swapped_mapping(serving_table(), slot=0, other=1)
    in_use = int(pt.pages_in_use(table))
    for slot in (0, 1):
        table = release(table, np.int32(slot))
    assert int(pt.pages_in_use(table)) == in_use
    assert bool(verify(table, ALL_ACTIVE_B).ok_B.all())
