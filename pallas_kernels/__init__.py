"""Pallas GPU kernels of mixserve, each beside its plain jnp reference.

Every public op takes `backend=`: "xla" (jnp reference), "pallas" (Triton-
backed Pallas kernel on an NVIDIA GPU) or "interpret" (the same kernel in the
Pallas interpreter, for CPU tests); None/"auto" picks "pallas" on GPU, else
"xla".

Tensor names end in their axes, one capital letter per axis:

  Paged attention (paged_attention_gqa.py, paged_attention_mla.py, tiled_fp8.py)
    B  requests in the decode batch (one query token each, or Q)
    Q  query tokens of one request (speculative verification: its last token and drafts)
    H  query heads
    K  KV heads (GQA); H = K * G
    G  query heads sharing one KV head
    R  query rows of a kernel block: G (GQA) or H (MLA) padded to a power of two >= 16
    D  head dim
    P  physical pages in the KV pool
    S  page size (tokens per page)
    N  page-table slots per request (logical pages)
    T  tokens of one block inside a kernel
    X  split-K (flash-decoding) partials
    C  MLA latent width = L + rope dims
    L  MLA kv_lora_rank (value width)
    J  scale tiles per token of tile-scaled FP8 pages (tiled_fp8.py): L / 128
    V  value width of a softmax partial (D or L)

  Weight-streaming matmuls (weight_stream.py; INT4: int4_matmul.py, moe_int4_matmul.py;
  NVFP4: nvfp4_matmul.py; FP8 with block scales: fp8_block_matmul.py)
    M  activation rows (tokens)
    T  expert-sorted token rows (MoE)
    W  work-list tiles (row tiles of one expert each)
    K  input features (the contraction)
    Q  packed int32 rows = K / 8
    N  output features
    G  quantization groups = K / group_size
    E  experts
    k, n  (lower case) blocks of 128 along K and N: one FP8 block scale each
"""

from pallas_kernels.backend import BACKENDS, Backend, resolve_backend
from pallas_kernels.flash_decoding import AttentionTuning
from pallas_kernels.fp8_block_matmul import (
    FP8_BLOCK, Fp8BlockTuning, dequantize_fp8_block, fp8_block_matmul, moe_fp8_block_matmul)
from pallas_kernels.int4_matmul import (
    Int4Tuning, dequantize_int4, from_compressed_tensors, int4_matmul, pack_int4, to_compressed_tensors,
    unpack_int4)
from pallas_kernels.moe_int4_matmul import moe_int4_matmul
from pallas_kernels.nvfp4_matmul import GROUP as NVFP4_GROUP
from pallas_kernels.nvfp4_matmul import (dequantize_nvfp4, moe_nvfp4_matmul, nvfp4_matmul, quantize_nvfp4,
                                         quantize_nvfp4_activations)
from pallas_kernels.paged_attention_gqa import paged_attention_gqa
from pallas_kernels.paged_attention_mla import TiledLatentPages, paged_attention_mla, sparse_paged_attention_mla
from pallas_kernels.tiled_fp8 import dequantize_tiles, quantize_tiles

__all__ = [
    "AttentionTuning",
    "BACKENDS",
    "Backend",
    "FP8_BLOCK",
    "Fp8BlockTuning",
    "Int4Tuning",
    "NVFP4_GROUP",
    "TiledLatentPages",
    "dequantize_fp8_block",
    "dequantize_int4",
    "dequantize_nvfp4",
    "dequantize_tiles",
    "fp8_block_matmul",
    "from_compressed_tensors",
    "int4_matmul",
    "moe_fp8_block_matmul",
    "moe_int4_matmul",
    "moe_nvfp4_matmul",
    "nvfp4_matmul",
    "pack_int4",
    "paged_attention_gqa",
    "paged_attention_mla",
    "quantize_nvfp4",
    "quantize_nvfp4_activations",
    "quantize_tiles",
    "resolve_backend",
    "sparse_paged_attention_mla",
    "to_compressed_tensors",
    "unpack_int4",
]
