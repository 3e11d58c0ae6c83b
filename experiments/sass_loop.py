"""The inner loop of a kernel's SASS listing (cuobjdump -sass), its instruction
mix, and the resource usage ptxas -v reports.

Used by experiments/sm90_compile.py and experiments/gpu_ptx.py; pure text
processing, so it is tested without a GPU or Triton (tests/test_experiments.py).
"""

import dataclasses
import re

_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.A-Za-z0-9_]*)\s*([^;]*);")
# Instruction kinds reported per loop iteration (SASS opcode prefixes).
SASS_KINDS = {
    "mma.sync": ("HMMA",),  # warp-level tensor-core MMA (weights or pages in registers)
    "wgmma": ("HGMMA",),  # Hopper warpgroup MMA (its B operand from shared memory)
    "convert": ("F2F", "I2F", "F2I", "I2I"),  # the F2F prefix covers packed F2FP too
    "permute": ("PRMT",),
    "shared store": ("STS",),  # STS and STSM: an MMA operand staged through shared memory
    "sync": ("BAR", "MEMBAR", "FENCE"),  # barriers and fences between those stores and the MMA
    "spill": ("LDL", "STL"),
}


def _loop_listing(sass: str) -> list[tuple[int, str, int | None]]:
    """(address, opcode with modifiers, branch target or None) of the longest
    address span closed by a backward branch."""
    listing = []
    for m in map(_SASS_LINE.match, sass.splitlines()):
        if m:
            target = re.search(r"0x([0-9a-f]+)", m.group(4)) if m.group(2) == "BRA" else None
            listing.append((int(m.group(1), 16), m.group(2) + m.group(3), target and int(target.group(1), 16)))
    best: list[tuple[int, str, int | None]] = []
    for address, _, target in listing:
        if target is not None and target < address:
            best = max(best, [x for x in listing if target <= x[0] <= address], key=len)
    return best


def inner_loop(sass: str) -> list[str]:
    """Opcodes (with modifiers) of the longest address span closed by a backward branch."""
    return [opcode for _, opcode, _ in _loop_listing(sass)]


def loop_fast_path(sass: str) -> list[str]:
    """inner_loop without the longest span that a forward branch inside the
    loop jumps over: what an iteration issues when that branch is taken (in
    the paged attention kernels, a block of valid tokens skipping the masks
    that only a request's last block needs). Only that one span: smaller
    branches on the same predicate may go the other way."""
    body = _loop_listing(sass)
    spans = [(target - address, address, target) for address, _, target in body
             if target is not None and address < target <= body[-1][0]]
    _, start, end = max(spans, default=(0, 0, 0))
    return [opcode for address, opcode, _ in body if not start < address < end]


@dataclasses.dataclass(frozen=True)
class LoopMix:
    instructions: int  # per thread per iteration
    fast_path: int  # of those, issued when the longest forward branch in the loop is taken (loop_fast_path)
    kinds: dict[str, int]  # SASS_KINDS -> count, over the whole loop
    conversions: dict[str, int]  # each conversion opcode, with its modifiers -> count

    @classmethod
    def of(cls, sass: str) -> "LoopMix":
        body = inner_loop(sass)
        kinds = {kind: sum(op.startswith(prefixes) for op in body) for kind, prefixes in SASS_KINDS.items()}
        conversions: dict[str, int] = {}
        for op in body:
            if op.startswith(SASS_KINDS["convert"]):
                conversions[op] = conversions.get(op, 0) + 1
        return cls(len(body), len(loop_fast_path(sass)), kinds, conversions)


def ptxas_usage(report: str) -> tuple[int, int]:
    """(registers per thread, spill bytes stored + loaded per thread) from ptxas -v."""
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return registers, int(spills.group(1)) + int(spills.group(2))


def ptx_target(ptx: str) -> str:
    """The architecture a PTX file was generated for (its .target line), e.g. sm_90a."""
    return re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.MULTILINE).group(1)


def ptx_warps(ptx: str) -> int:
    """Warps per block a Triton PTX kernel was built for (its .maxntid x, / 32)."""
    return int(re.search(r"\.maxntid\s+(\d+)", ptx).group(1)) // 32
