"""Compile every Pallas kernel for the H100/H200 (sm_90a) without a GPU.

    pip install -e '.[sm90]'          # Triton 3.6.0, the GPU machine's version
    python experiments/sm90_compile.py [--sweep | --test-shapes] [--out PATH]

Interpret mode runs the kernel bodies with jnp, and `lower_for_cuda` stops at
Triton IR. This goes the rest of the way that needs no GPU: it takes each
kernel's Triton IR from the CUDA lowering (at the shapes of
experiments/gpu_kernels.py), runs the TTIR passes XLA runs first (they were
skipped until 2026-11-29, which overstated registers and spills; see
_ttir_passes), compiles it with a real Triton for sm_90a
(TTIR -> TTGIR -> LLVM -> PTX -> cubin), and runs ptxas -v on the PTX. Per
kernel it reports registers per thread, register spills, shared memory and
the resident blocks per SM these allow. What it catches before any GPU time:
Triton compile errors, shared memory over the 227 KiB a block may use (the
launch would fail), and spills (local-memory traffic in the inner loop).

--sweep compiles the same IR under other (num_warps, num_stages), which are
Triton options and change no Pallas code, to pick launch parameters.
--test-shapes compiles the shapes the kernel tests use instead (what
experiments/gpu_check.sh runs compiled on a GPU), float32 operands included.
--sass disassembles each kernel (cuobjdump, beside ptxas in Triton's wheel) and
reports its inner loop: instructions per thread per iteration, by kind
(conversions, MMA, spills). For a kernel bound by instruction issue rather
than bandwidth, that count is what a variant must cut; it is how the FP8
attention's scalar f16 -> bf16 conversions were found.

Caveat: JAX on the GPU compiles with the Triton inside its jaxlib, not this
pip Triton; numbers can differ between versions (see the results file).
"""

import argparse
import dataclasses
import datetime
import functools
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.gpu_kernels import DCP, GPU, Config, tuning_label  # noqa: E402  (shapes of the benchmark)
from experiments.sass_loop import SASS_KINDS, LoopMix, ptxas_usage  # noqa: E402
from pallas_kernels import (  # noqa: E402
    AttentionTuning, Fp8BlockTuning, Int4Tuning, fp8_block_matmul, int4_matmul, moe_fp8_block_matmul, moe_int4_matmul,
    moe_nvfp4_matmul, nvfp4_matmul, paged_attention_gqa, paged_attention_mla, sparse_paged_attention_mla)
from pallas_kernels.backend import TritonKernelIR, triton_kernels_for_cuda  # noqa: E402
from pallas_kernels.paged_attention_mla import TiledLatentPages  # noqa: E402
from pallas_kernels.tiled_fp8 import tile_width  # noqa: E402

try:
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend, get_ptxas
except ImportError as error:  # main() says so; the cases and limits need no Triton (gpu_ptx.py)
    triton, TRITON_MISSING = None, error

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ARCH = 90
# sm_90 limits (CUDA programming guide, compute capability 9.0).
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024
SMEM_RESERVED_PER_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class Case:
    kernel: str
    shape: str
    fn: functools.partial
    specs: tuple[jax.ShapeDtypeStruct, ...]


def cases(cfg: Config) -> list[Case]:
    """The benchmark's kernels at its smallest and largest work per program, and
    the attention variants: FP8 with float16 dots, and prefetching
    (AttentionTuning.fp8_dots, .prefetch)."""
    spec = jax.ShapeDtypeStruct
    out = []
    variants = [(name, dtype, AttentionTuning(fp8_dots=dots, prefetch=prefetch))
                for prefetch in (False, True)
                for name, dtype, dots in (("bf16", jnp.bfloat16, "bfloat16"), ("fp8", jnp.float8_e4m3fn, "bfloat16"),
                                          ("fp8 f16-dots", jnp.float8_e4m3fn, "float16"))]
    variants = [(name + " prefetch" * tuning.prefetch, dtype, tuning) for name, dtype, tuning in variants]
    # The values product accumulated transposed, so that it runs as wgmma (AttentionTuning.swap_pv).
    variants += [(f"{name} swap-pv", dtype, dataclasses.replace(tuning, swap_pv=True))
                 for name, dtype, tuning in variants if name in ("bf16", "fp8 f16-dots", "fp8 f16-dots prefetch")]
    for name, dtype, tuning in variants:
        for batch, context in ((1, max(cfg.contexts)), (max(cfg.batches), min(cfg.contexts))):
            out.append(_gqa_case(cfg, f"GQA {name}", dtype, tuning, batch, context))
            out.append(_mla_case(cfg, f"MLA {name}", dtype, tuning, batch, context))
            n = context // cfg.mla_page
            width = cfg.mla_rank + cfg.mla_rope
            sparse = functools.partial(sparse_paged_attention_mla, kv_lora_rank=cfg.mla_rank, scale=1.0,
                                       softmax_scale=0.1, backend="pallas", tuning=tuning)
            out.append(Case(f"MLA sparse {name}", f"B={batch} ctx={context} top-k={cfg.dsa_top_k}", sparse,
                            (spec((batch, cfg.mla_heads, width), jnp.bfloat16), spec((batch * n, cfg.mla_page, width), dtype),
                             spec((batch, n), jnp.int32), spec((batch, cfg.dsa_top_k), jnp.int32), spec((batch,), jnp.int32))))
    # The split partials merged by one Pallas kernel (AttentionTuning.combine): B=1 has hundreds of splits.
    combine = AttentionTuning(combine="pallas")
    for batch, context in ((1, max(cfg.contexts)), (max(cfg.batches), min(cfg.contexts))):
        out.append(_gqa_case(cfg, "GQA fp8 f16-dots pallas-combine", jnp.float8_e4m3fn, combine, batch, context))
        out.append(_mla_case(cfg, "MLA fp8 f16-dots pallas-combine", jnp.float8_e4m3fn, combine, batch, context))
    # The masks applied to every block, unbranched, as runs 1-4 timed (AttentionTuning.branch_masks=False).
    for name, tuning in (("fp8 f16-dots every-block-masks", AttentionTuning(branch_masks=False)),
                         ("fp8 f16-dots swap-pv every-block-masks", AttentionTuning(branch_masks=False, swap_pv=True))):
        for batch, context in ((1, max(cfg.contexts)), (max(cfg.batches), min(cfg.contexts))):
            out.append(_gqa_case(cfg, f"GQA {name}", jnp.float8_e4m3fn, tuning, batch, context))
            out.append(_mla_case(cfg, f"MLA {name}", jnp.float8_e4m3fn, tuning, batch, context))
    # MLA at 16 warps: one program per SM either way, with 4 warps per scheduler instead of 2.
    for name, tuning in (("fp8 f16-dots 16-warps", AttentionTuning(num_warps=16)),
                         ("fp8 f16-dots swap-pv 16-warps", AttentionTuning(num_warps=16, swap_pv=True))):
        for batch, context in ((1, max(cfg.contexts)), (max(cfg.batches), min(cfg.contexts))):
            out.append(_mla_case(cfg, f"MLA {name}", jnp.float8_e4m3fn, tuning, batch, context))
    # MLA's 64-token pages cut into 32-token blocks (AttentionTuning.block_tokens, fd.cut_pages).
    for name, dots in (("fp8 block-32", "bfloat16"), ("fp8 f16-dots block-32", "float16")):
        for batch, context in ((1, max(cfg.contexts)), (max(cfg.batches), min(cfg.contexts))):
            out.append(_mla_case(cfg, f"MLA {name}", jnp.float8_e4m3fn,
                                 AttentionTuning(block_tokens=32, fp8_dots=dots), batch, context))
    # FlashMLA's tile-scaled layout (kv_cache_dtype fp8_ds_mla): three pools, tiles dequantized in registers.
    for name, tuning in (("fp8 tiled", AttentionTuning()), ("fp8 tiled block-32", AttentionTuning(block_tokens=32)),
                         ("fp8 tiled prefetch", AttentionTuning(prefetch=True)),
                         ("fp8 tiled swap-pv", AttentionTuning(swap_pv=True))):
        for batch, context in ((1, max(cfg.contexts)), (max(cfg.batches), min(cfg.contexts))):
            out.append(_mla_case(cfg, f"MLA {name}", "tiled", tuning, batch, context))
    # Decode context parallelism at 8 ways: one device runs all 64 heads over 1/8 of the context in
    # pages of 64 / 8 = 8 slots (experiments/gpu_kernels.py's "DCP8 share" rows).
    share = dataclasses.replace(cfg, mla_heads=cfg.mla_heads * DCP, mla_page=cfg.mla_page // DCP)
    # By default in programs of 16 heads (AttentionTuning.head_rows); one program of all 64 spills.
    for batch in (1, max(cfg.batches)):
        out.append(_mla_case(share, f"MLA fp8, DCP{DCP} share", jnp.float8_e4m3fn, AttentionTuning(), batch,
                             max(cfg.contexts) // DCP))
    for name, tuning in (("", AttentionTuning(head_rows=64)), (" swap-pv", AttentionTuning(head_rows=64, swap_pv=True))):
        out.append(_mla_case(share, f"MLA fp8, DCP{DCP} share, head_rows=64{name}", jnp.float8_e4m3fn, tuning,
                             max(cfg.batches), max(cfg.contexts) // DCP))
    # Speculative verification: a request's last token and 1-7 drafts folded into program rows
    # (GQA Q * 12 -> 32 or 64 rows, or at Q=8 two programs of 64 (AttentionTuning.gqa_rows) or one
    # of 128; MLA Q * 8 -> 16, or 32 as two programs of 16 or one of 32).
    for queries in (2, 4, 8):
        out.append(_gqa_case(cfg, "GQA fp8 f16-dots verify", jnp.float8_e4m3fn, AttentionTuning(), max(cfg.batches),
                             max(cfg.contexts), queries))
    out.append(_gqa_case(cfg, "GQA fp8 f16-dots verify gqa_rows=128", jnp.float8_e4m3fn, AttentionTuning(gqa_rows=128),
                         max(cfg.batches), max(cfg.contexts), 8))
    for queries in (2, 4):
        for name, tuning in (("", AttentionTuning()), (" head_rows=32", AttentionTuning(head_rows=32))):
            out.append(_mla_case(cfg, f"MLA fp8 f16-dots verify{name}", jnp.float8_e4m3fn, tuning, max(cfg.batches),
                                 max(cfg.contexts), queries))
    k, n = cfg.matmul_k, cfg.matmul_n
    for group in (32, 128):
        weights = (spec((k // 8, n), jnp.int32), spec((k // group, n), jnp.bfloat16))
        for m in sorted({*cfg.matmul_ms, 32}):  # 32: the one tile height (16/32/64) the benchmark skips
            out.append(Case("INT4 matmul", f"M={m} g={group}", functools.partial(int4_matmul, group_size=group, backend="pallas"),
                            (spec((m, k), jnp.bfloat16), *weights)))
    for name, tuning in (("gather-x", Int4Tuning(gather_x=True)), ("block_k=128", Int4Tuning(block_k=128)),
                         ("x-orientation", Int4Tuning(swap_ab=False))):
        for m in (min(cfg.matmul_ms), max(cfg.matmul_ms)):
            out.append(Case(f"INT4 matmul {name}", f"M={m} g=32",
                            functools.partial(int4_matmul, group_size=32, backend="pallas", tuning=tuning),
                            (spec((m, k), jnp.bfloat16), spec((k // 8, n), jnp.int32), spec((k // 32, n), jnp.bfloat16))))
    e, g = cfg.experts, cfg.group_size
    for name, tuning in (("", Int4Tuning()), (" x-orientation", Int4Tuning(swap_ab=False))):
        moe = functools.partial(moe_int4_matmul, group_size=g, backend="pallas", tuning=tuning)
        for tokens in cfg.moe_tokens:
            out.append(Case("MoE INT4" + name, f"T={tokens} E={e} g={g}", moe,
                            (spec((tokens, k), jnp.bfloat16), spec((e, k // 8, n), jnp.int32),
                             spec((e, k // g, n), jnp.bfloat16), spec((e,), jnp.int32))))
    # NVFP4: the INT4 kernel with an e2m1 decode, e4m3 scales per 16 and a global scale per matrix.
    nvfp4 = (spec((k // 8, n), jnp.int32), spec((k // 16, n), jnp.float8_e4m3fn), spec((1,), jnp.float32))
    for m in sorted({*cfg.matmul_ms, 32}):
        out.append(Case("NVFP4 matmul", f"M={m}", functools.partial(nvfp4_matmul, backend="pallas"),
                        (spec((m, k), jnp.bfloat16), *nvfp4)))
    for tokens in cfg.moe_tokens:
        out.append(Case("MoE NVFP4", f"T={tokens} E={e}", functools.partial(moe_nvfp4_matmul, backend="pallas"),
                        (spec((tokens, k), jnp.bfloat16), spec((e, k // 8, n), jnp.int32),
                         spec((e, k // 16, n), jnp.float8_e4m3fn), spec((e, 1), jnp.float32), spec((e,), jnp.int32))))
    for tuning in (Fp8BlockTuning(dot_dtype="bfloat16"), Fp8BlockTuning(), Fp8BlockTuning(swap_ab=True)):
        out += _fp8_block_cases(cfg.matmul_ms, k, n, e, cfg.moe_tokens, jnp.bfloat16, tuning)
    return out


def _fp8_block_cases(ms, k: int, n: int, experts: int, moe_tokens, x_dtype, tuning: Fp8BlockTuning,
                     scale_block=(128, 128)) -> list[Case]:
    """FP8-block matmuls (the seed's baseline weight format), dense at each M and over experts."""
    spec = jax.ShapeDtypeStruct
    scales = (-(-k // scale_block[0]), -(-n // scale_block[1]))
    dense = functools.partial(fp8_block_matmul, scale_block=scale_block, backend="pallas", tuning=tuning)
    moe = functools.partial(moe_fp8_block_matmul, scale_block=scale_block, backend="pallas", tuning=tuning)
    label = f"K={k} N={n} blocks={scale_block} x {jnp.dtype(x_dtype).name}"
    name = ("" if tuning.dot_dtype == "bfloat16" else " f16-dots") + " swap-ab" * tuning.swap_ab
    out = [Case("FP8-block matmul" + name, f"M={m} {label}", dense,
                (spec((m, k), x_dtype), spec((k, n), jnp.float8_e4m3fn), spec(scales, jnp.float32))) for m in ms]
    out += [Case("MoE FP8-block" + name, f"T={t} E={experts} {label}", moe,
                 (spec((t, k), x_dtype), spec((experts, k, n), jnp.float8_e4m3fn), spec((experts, *scales), jnp.float32),
                  spec((experts,), jnp.int32))) for t in moe_tokens]
    return out


def _query_specs(batch: int, queries: int, heads: int, width: int):
    """(q, lengths) specs and a shape label suffix: one query token per request, or `queries`
    (speculative verification, q [B, Q, H, C])."""
    spec = jax.ShapeDtypeStruct
    if queries == 1:
        return spec((batch, heads, width), jnp.bfloat16), spec((batch,), jnp.int32), ""
    return (spec((batch, queries, heads, width), jnp.bfloat16), spec((batch, queries), jnp.int32),
            f" Q={queries}")


def _gqa_case(cfg: Config, kernel: str, dtype, tuning: AttentionTuning, batch: int, context: int,
              queries: int = 1) -> Case:
    spec = jax.ShapeDtypeStruct
    n = context // cfg.gqa_page
    pages = spec((1, batch * n, cfg.gqa_page, cfg.gqa_head_dim), dtype)
    gqa = functools.partial(paged_attention_gqa, k_scale=1.0, v_scale=1.0, softmax_scale=0.1, backend="pallas",
                            tuning=tuning)
    q, lengths, label = _query_specs(batch, queries, cfg.gqa_q_heads, cfg.gqa_head_dim)
    return Case(kernel, f"B={batch} ctx={context}{label}", gqa, (q, pages, pages, spec((batch, n), jnp.int32), lengths))


def _mla_case(cfg: Config, kernel: str, dtype, tuning: AttentionTuning, batch: int, context: int,
              queries: int = 1) -> Case:
    """dtype: of the latent pages, or "tiled" for FlashMLA's layout (TiledLatentPages)."""
    n = context // cfg.mla_page
    width = cfg.mla_rank + cfg.mla_rope
    spec = jax.ShapeDtypeStruct
    pool = lambda w, dt: spec((batch * n, cfg.mla_page, w), dt)
    if dtype == "tiled":
        pages = TiledLatentPages(pool(cfg.mla_rank, jnp.float8_e4m3fn), pool(cfg.mla_rank // tile_width(cfg.mla_rank), jnp.float32),
                                 pool(cfg.mla_rope, jnp.bfloat16))
    else:
        pages = pool(width, dtype)
    mla = functools.partial(paged_attention_mla, kv_lora_rank=cfg.mla_rank, scale=None if dtype == "tiled" else 1.0,
                            softmax_scale=0.1, backend="pallas", tuning=tuning)
    q, lengths, label = _query_specs(batch, queries, cfg.mla_heads, width)
    return Case(kernel, f"B={batch} ctx={context}{label}", mla, (q, pages, spec((batch, n), jnp.int32), lengths))


def test_cases() -> list[Case]:
    """The shapes the kernel tests run (tests/test_kernels_*.py), which gpu_check.sh runs compiled:
    small, odd head and page sizes, and float32 operands, which serving shapes never use;
    attention with and without prefetch, INT4 with and without gather_x."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_kernels_attention as ta
    import test_kernels_int4 as ti
    import test_kernels_tiled_fp8 as tt

    spec = jax.ShapeDtypeStruct
    out = []
    for x_dtype, tuning in itertools.product((jnp.bfloat16, jnp.float32), (Int4Tuning(), ti.GATHER_X)):
        label = " gather-x" * tuning.gather_x
        for m, k, n, g in ti.DENSE_SHAPES + ti.SMALL_K_SHAPES:
            out.append(Case("INT4 matmul" + label, f"M={m} K={k} N={n} g={g} x {x_dtype.__name__}",
                            functools.partial(int4_matmul, group_size=g, backend="pallas", tuning=tuning),
                            (spec((m, k), x_dtype), spec((k // 8, n), jnp.int32), spec((k // g, n), jnp.bfloat16))))
        for sizes, k, n, g in ti.MOE_CASES:
            e = len(sizes)
            out.append(Case("MoE INT4" + label, f"groups={sizes} K={k} N={n} g={g} x {x_dtype.__name__}",
                            functools.partial(moe_int4_matmul, group_size=g, backend="pallas", tuning=tuning),
                            (spec((sum(sizes), k), x_dtype), spec((e, k // 8, n), jnp.int32),
                             spec((e, k // g, n), jnp.bfloat16), spec((e,), jnp.int32))))
    import test_kernels_fp8_block as tf
    for x_dtype, dots in ((jnp.bfloat16, "bfloat16"), (jnp.bfloat16, "float16"), (jnp.float32, "bfloat16")):
        tuning = Fp8BlockTuning(dot_dtype=dots)
        for m, k, n, block in tf.DENSE_SHAPES:
            out += _fp8_block_cases((m,), k, n, 1, (), x_dtype, tuning, block)
        for sizes, k, n in tf.MOE_CASES:
            out += _fp8_block_cases((), k, n, len(sizes), (sum(sizes),), x_dtype, tuning)
    for (kv_dtype, q_dtype), prefetch in itertools.product(((jnp.float8_e4m3fn, jnp.bfloat16), (jnp.float32, jnp.float32)),
                                                         (False, True)):
        label = " prefetch" * prefetch
        for kvh, g, d, s, n, lengths in ta.GQA_SHAPES:
            b, pages = len(lengths), spec((kvh, 64, s, d), kv_dtype)
            out.append(Case("GQA" + label, f"K={kvh} G={g} D={d} S={s} {kv_dtype.__name__}",
                            functools.partial(paged_attention_gqa, k_scale=1.0, v_scale=1.0, softmax_scale=0.1,
                                              backend="pallas", tuning=AttentionTuning(num_splits=3, prefetch=prefetch)),
                            (spec((b, kvh * g, d), q_dtype), pages, pages, spec((b, n), jnp.int32), spec((b,), jnp.int32))))
        for h, c, rank, s, n, lengths in ta.MLA_SHAPES:
            b = len(lengths)
            out.append(Case("MLA" + label, f"H={h} C={c} L={rank} S={s} {kv_dtype.__name__}",
                            functools.partial(paged_attention_mla, kv_lora_rank=rank, scale=1.0, softmax_scale=0.1,
                                              backend="pallas", tuning=AttentionTuning(num_splits=2, prefetch=prefetch)),
                            (spec((b, h, c), q_dtype), spec((64, s, c), kv_dtype), spec((b, n), jnp.int32),
                             spec((b,), jnp.int32))))
    for (h, rank, rope, s, n, lengths), q_dtype, tuning in tt.TILED_KERNEL_CASES:
        pool = lambda w, dt: spec((64, s, w), dt)
        pages = TiledLatentPages(pool(rank, jnp.float8_e4m3fn), pool(rank // tile_width(rank), jnp.float32),
                                 pool(rope, jnp.bfloat16))
        out.append(Case("MLA fp8 tiled", f"H={h} L={rank}+{rope} S={s} q {q_dtype.__name__} {tuning_label(tuning)}",
                        functools.partial(paged_attention_mla, kv_lora_rank=rank, softmax_scale=0.1,
                                          backend="pallas", tuning=tuning),
                        (spec((len(lengths), h, rank + rope), q_dtype), pages, spec((len(lengths), n), jnp.int32),
                         spec((len(lengths),), jnp.int32))))
    return out


@dataclasses.dataclass(frozen=True)
class Compiled:
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int  # spill stores + spill loads per thread, from ptxas -v
    smem: int  # bytes of shared memory per block (Triton's allocation)
    seconds: float
    error: str = ""

    def blocks_per_sm(self) -> tuple[int, str]:
        """Resident blocks per SM and the resource that limits them."""
        if self.error:
            return 0, "-"
        regs_per_warp = -(-self.registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
        limits = {
            "regs": REGS_PER_SM // regs_per_warp // self.num_warps,
            "smem": SMEM_PER_SM // (self.smem + SMEM_RESERVED_PER_BLOCK),
            "warps": MAX_WARPS_PER_SM // self.num_warps,
            "blocks": MAX_BLOCKS_PER_SM,
        }
        limiter = min(limits, key=limits.get)
        return limits[limiter], limiter


def _ttir_passes(ttir: str, tmp: str) -> str:
    """The kernel's Triton IR after the TTIR passes that XLA runs before the GPU
    passes (MakeTTIR in XLA's compilation_pipeline_cuda.cc, Triton's make_ttir:
    inliner, canonicalizer, combine, broadcast reordering, CSE, loop unroll).
    triton.compile skips the passes of the stage its source is in, so given
    Pallas' TTIR it would compile IR that the GPU never sees: combine, for
    one, folds `acc + dot(a, b, 0)` into `dot(a, b, acc)`, without which the
    SASS has a float add per accumulator element per dot."""
    path = Path(tmp) / "pallas.ttir"
    path.write_text(ttir)
    context = ir.context()
    ir.load_dialects(context)
    backend = CUDABackend(GPUTarget("cuda", ARCH, 32))
    backend.load_dialects(context)
    module = ir.parse_mlir_module(str(path), context)
    module.context = context  # as triton.compile's IRSource does
    return str(backend.make_ttir(module, {}, None, ARCH))


def _triton_compile(kernel: TritonKernelIR, num_warps: int, num_stages: int, tmp: str):
    path = Path(tmp) / f"{kernel.name}.ttir"  # the suffix tells Triton which stage the text is
    path.write_text(_ttir_passes(kernel.ttir, tmp))
    return triton.compile(str(path), target=GPUTarget("cuda", ARCH, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_sm90(kernel: TritonKernelIR, num_warps: int, num_stages: int) -> Compiled:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            compiled = _triton_compile(kernel, num_warps, num_stages, tmp)
        except Exception as error:  # A compile error is a result here, not a crash.
            message = " ".join(str(error).split())[:200]
            return Compiled(num_warps, num_stages, 0, 0, 0, time.perf_counter() - start, message)
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(ARCH).path, f"--gpu-name=sm_{ARCH}a", "-v", str(ptx), "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    registers, spill_bytes = ptxas_usage(report)
    return Compiled(num_warps, num_stages, registers, spill_bytes, compiled.metadata.shared,
                    time.perf_counter() - start)


def loop_mix(kernel: TritonKernelIR) -> LoopMix:
    """The inner-loop instruction mix of the kernel compiled at its own warps and stages."""
    with tempfile.TemporaryDirectory() as tmp:
        compiled = _triton_compile(kernel, kernel.num_warps, kernel.num_stages, tmp)
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        cuobjdump = Path(get_ptxas(ARCH).path).with_name("cuobjdump")
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return LoopMix.of(sass)


def sass_row(case: Case, mix: LoopMix) -> str:
    if not mix.instructions:  # e.g. one block per program: the compiler dropped the loop
        return f"| {case.kernel} | {case.shape} | no loop | |" + " |" * len(SASS_KINDS) + " |"
    kinds = " | ".join(str(mix.kinds[k]) for k in SASS_KINDS)
    conversions = ", ".join(f"{n} {op}" for op, n in sorted(mix.conversions.items(), key=lambda item: -item[1]))
    return f"| {case.kernel} | {case.shape} | {mix.instructions} | {mix.fast_path} | {kinds} | {conversions} |"


def row(case: Case, kernel: TritonKernelIR, c: Compiled) -> str:
    programs = kernel.grid[0] * kernel.grid[1] * kernel.grid[2]
    if c.error:
        return f"| {case.kernel} | {case.shape} | {c.num_warps} | {c.num_stages} | {programs} | FAILED: {c.error} ||||||"
    blocks, limiter = c.blocks_per_sm()
    flags = []
    if c.smem > SMEM_PER_BLOCK:
        flags.append("SMEM OVER LIMIT")
    if c.spill_bytes:
        flags.append("spills")
    return (f"| {case.kernel} | {case.shape} | {c.num_warps} | {c.num_stages} | {programs} | {c.registers} | "
            f"{c.spill_bytes} | {c.smem / 1024:.1f} | {blocks} ({limiter}) | {c.seconds:.1f} | {', '.join(flags)} |")


def unique_kernels(case_list: list[Case]):
    """(case, kernel) for each distinct Triton kernel and launch (warps, stages), skipping a
    shape that only changes the grid. A case's kernels after its first (e.g. the split
    merge, combine_splits) are labelled with their own names."""
    seen: set[tuple[str, int, int]] = set()
    for case in case_list:
        for index, kernel in enumerate(triton_kernels_for_cuda(case.fn, *case.specs)):
            key = (kernel.ttir, kernel.num_warps, kernel.num_stages)
            if key not in seen:
                seen.add(key)
                yield (dataclasses.replace(case, kernel=f"{case.kernel}: {kernel.name}") if index else case), kernel


def sass_table(case_list: list[Case]) -> list[str]:
    lines = ["| kernel | shape | loop instrs | fast path | " + " | ".join(SASS_KINDS) + " | conversions |",
             "|---|---|---:|---:|" + "---:|" * len(SASS_KINDS) + "---|"]
    for case, kernel in unique_kernels(case_list):
        lines.append(sass_row(case, loop_mix(kernel)))
        print(lines[-1], flush=True)
    return lines


def compile_table(case_list: list[Case], sweep: bool) -> list[str]:
    lines = ["| kernel | shape | warps | stages | programs | regs | spill B | smem KiB | blocks/SM | compile s | flags |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for case, kernel in unique_kernels(case_list):
        options = [(kernel.num_warps, kernel.num_stages)]
        if sweep:
            options += [(w, s) for w in (4, 8) for s in (1, 2, 3, 4) if (w, s) != options[0]]
        for num_warps, num_stages in options:
            lines.append(row(case, kernel, compile_sm90(kernel, num_warps, num_stages)))
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also compile under num_warps 4/8 x num_stages 1..4")
    parser.add_argument("--test-shapes", action="store_true", help="compile the kernel tests' shapes instead")
    parser.add_argument("--sass", action="store_true", help="report each kernel's inner-loop instruction mix instead")
    parser.add_argument("--only", help="compile only the kernels whose name contains this (needs --out)")
    parser.add_argument("--out", type=Path)
    cli = parser.parse_args()
    if cli.only and not cli.out:
        parser.error("with --only, name an --out file: the default files hold every kernel")
    if triton is None:
        raise SystemExit(f"needs Triton: pip install -e '.[sm90]' ({TRITON_MISSING})")
    ptxas_version = subprocess.run([get_ptxas(ARCH).path, "--version"], capture_output=True, text=True).stdout
    ptxas_version = ptxas_version.strip().splitlines()[-1]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    flags = "".join(f" {flag}" for flag, on in (("--sweep", cli.sweep), ("--test-shapes", cli.test_shapes),
                                                 ("--sass", cli.sass), (f"--only '{cli.only}'", cli.only)) if on)
    lines = [
        f"# Pallas kernels compiled for sm_90a without a GPU, {stamp}", "",
        f"Triton {triton.__version__} (pip), ptxas `{ptxas_version}`, IR from jax {jax.__version__} after XLA's TTIR passes. Shapes: "
        + ("the kernel tests' (tests/test_kernels_*.py)" if cli.test_shapes else "experiments/gpu_kernels.py (GPU config)")
        + f". Produced by `python experiments/sm90_compile.py{flags}`.", "",
    ]
    case_list = [c for c in (test_cases() if cli.test_shapes else cases(GPU)) if (cli.only or "") in c.kernel]
    if cli.sass:
        lines += ["Inner loop of each kernel's SASS (the longest span closed by a backward branch), at the kernel's "
                  "own warps and stages: instructions per thread per iteration; the fast path, what an iteration "
                  "issues when the forward branch inside the loop that skips the most code is taken (in the paged "
                  "attention kernels, a block of valid tokens skipping the masks only a request's last block needs); and, over the whole loop, "
                  "how many are tensor-core MMAs (warp-level mma.sync, or Hopper's warpgroup wgmma, which reads its B operand from shared memory), "
                  "type conversions (scalar F2F/I2F and packed F2FP), byte permutes and register spills "
                  "(LDL/STL). A static count: it says what each iteration issues, not how long it takes.", ""]
        lines += sass_table(case_list)
    else:
        lines += ["Blocks/SM: resident blocks per SM allowed by registers (65536 per SM, allocated per warp in "
                  "units of 256), shared memory (228 KiB per SM, 1 KiB reserved per block), warps (64) and blocks "
                  "(32); the limiting resource in brackets. Spills: bytes of spill stores + loads per thread "
                  "(ptxas -v).", ""]
        lines += compile_table(case_list, cli.sweep)
    lines.append("")
    out = cli.out or RESULTS_DIR / ("sm90_sass.md" if cli.sass else "sm90_compile_tests.md" if cli.test_shapes else
                                    "sm90_compile_sweep.md" if cli.sweep else "sm90_compile.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
