"""INT4 W4A16 matmuls (dense and MoE-grouped): packing, compressed-tensors
conversion, interpret-mode kernels vs jnp references vs float64 numpy.

Fresh inputs every run; the seed (from os.urandom) is in every assertion
message. The Pallas interpreter NaN-fills kernel outputs before the kernel
runs (see test_kernels_attention.test_interpreter_poisons_outputs), so an
output tile the kernel never writes fails the finiteness check; for the MoE
kernel, idle experts' scales are NaN as well, so streaming or mixing in an
empty expert's weights fails too.

Bounds. With W = dequantized weights and A = |x| @ |W| (elementwise
magnitudes, computed in float64):
* f32 x: the kernel's dots are IEEE f32 and the weights value*scale are exact
  in f32 (a 4-bit integer times a bf16/f32 scale), so only accumulation
  rounding remains: |kernel - ref| <= 1e-5 * A (K <= 512 terms, ~2^-24 each,
  with a wide margin). The same bound holds for the reference vs float64.
* bf16 x: the kernel rounds each scaled weight to bf16 before the
  tensor-core dot (relative u = 2^-8), accumulates in f32, and both results
  are rounded to bf16 (relative u each). So |kernel - ref| <= u*A + u*(|k| + |r|)
  <= 3u * A, elementwise, plus 1e-5 * A for second-order and accumulation
  terms (against float64 directly, as in the MoE test, only the weight and
  the output rounding remain: <= 2u * A). The brief's criterion,
  relative error below 1e-2 (max |kernel - ref| / max |ref|), is checked too.
"""

import dataclasses
import functools
import itertools
import os
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KERNEL_BACKEND, dots_below_the_mma_minimum, ttir_dots

from pallas_kernels import (
    Int4Tuning, dequantize_int4, from_compressed_tensors, int4_matmul, moe_int4_matmul, pack_int4,
    to_compressed_tensors, unpack_int4)
from pallas_kernels.backend import triton_kernels_for_cuda
from pallas_kernels.weight_stream import expert_tile_schedule, tile_rows

# Unit roundoff, half the spacing at 1: bf16 keeps 8 significant bits, so 2^-8. It read 2^-9
# until 2026-11-29, which halved every bf16 bound; one seed rounded an output of -4.1106 to
# -4.125 (0.89 u) and failed the sparse MLA test.
U_BF16 = float(jnp.finfo(jnp.bfloat16).eps) / 2
F32_TOL = 1e-5
# 3 bf16 roundings (derived in the module docstring) plus the f32 slack for
# second-order terms and accumulation order.
BF16_TOL = 3 * U_BF16 + F32_TOL


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _values(rng, shape) -> np.ndarray:
    return rng.integers(-8, 8, shape).astype(np.int8)


def _scales(rng, shape, dtype) -> jax.Array:
    # Positive and negative scales, away from zero, bf16-representable.
    mag = rng.uniform(0.25, 2.0, shape) * 0.05
    return jnp.asarray(mag * rng.choice([-1.0, 1.0], shape), dtype)


def _spec_pack(values_KN: np.ndarray) -> np.ndarray:
    """The layout, literally: weight[k] = 8i + j sits at bits 4j.. of packed[i], stored as value + 8."""
    k, n = values_KN.shape
    packed = np.zeros((k // 8, n), np.uint32)
    for kk in range(k):
        packed[kk // 8] |= (values_KN[kk].astype(np.int64) + 8).astype(np.uint32) << np.uint32(4 * (kk % 8))
    return packed.view(np.int32)


def _compressed_tensors_pack(w_NK: np.ndarray) -> np.ndarray:
    """compressed-tensors pack_to_int32 (packed_dim=1), restated: each row of
    W [N, K] is cut into runs of 8 along K; run i becomes one int32 with
    element j of the run, shifted to unsigned (+8), in bits 4j..4j+3."""
    n, k = w_NK.shape
    runs = (w_NK.astype(np.int64) + 8).reshape(n, k // 8, 8)
    return (runs << (4 * np.arange(8))).sum(axis=-1).astype(np.uint32).view(np.int32)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _dequant_f64(values_KN: np.ndarray, scales_GN, group_size: int) -> np.ndarray:
    return values_KN.astype(np.float64) * np.repeat(_f64(scales_GN), group_size, axis=-2)


@pytest.mark.parametrize("shape", [(8, 1), (64, 96), (3, 256, 40)])
def test_pack_unpack_round_trip_and_layout(shape):
    seed = _seed()
    values = _values(np.random.default_rng(seed), shape)
    packed = pack_int4(jnp.asarray(values))
    assert packed.dtype == jnp.int32 and packed.shape == (*shape[:-2], shape[-2] // 8, shape[-1])
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), values, err_msg=f"seed={seed}")
    flat_values = values.reshape(-1, *shape[-2:])
    flat_packed = np.asarray(packed).reshape(-1, *packed.shape[-2:])
    for v, p in zip(flat_values, flat_packed):
        np.testing.assert_array_equal(p, _spec_pack(v), err_msg=f"layout differs from spec, seed={seed}")


def test_compressed_tensors_round_trip():
    """compressed-tensors stores weight_packed [N, K/8] packed along K with the same nibble order."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    k, n, g = 256, 48, 32
    values_KN = _values(rng, (k, n))
    weight_packed_NQ = jnp.asarray(_compressed_tensors_pack(values_KN.T))
    weight_scale_NG = _scales(rng, (n, k // g), jnp.bfloat16)
    packed_QN, scales_GN = from_compressed_tensors(weight_packed_NQ, weight_scale_NG)
    np.testing.assert_array_equal(np.asarray(packed_QN), np.asarray(pack_int4(jnp.asarray(values_KN))),
                                  err_msg=f"seed={seed}")
    back_packed, back_scale = to_compressed_tensors(packed_QN, scales_GN)
    np.testing.assert_array_equal(np.asarray(back_packed), np.asarray(weight_packed_NQ), err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(back_scale).view(np.uint16), np.asarray(weight_scale_NG).view(np.uint16))
    # Expert-batched arrays convert the same way.
    stacked = from_compressed_tensors(weight_packed_NQ[None].repeat(2, 0), weight_scale_NG[None].repeat(2, 0))
    assert stacked[0].shape == (2, k // 8, n) and stacked[1].shape == (2, k // g, n)


def test_dequantize_matches_float64():
    seed = _seed()
    rng = np.random.default_rng(seed)
    values = _values(rng, (2, 128, 24))
    scales = _scales(rng, (2, 4, 24), jnp.bfloat16)
    got = dequantize_int4(pack_int4(jnp.asarray(values)), scales, 32, jnp.float32)
    np.testing.assert_array_equal(_f64(got), _dequant_f64(values, scales, 32), err_msg=f"seed={seed}")


def _check(got, ref, magnitude, rel_bound, seed, what):
    got = _f64(got)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (unwritten tile?), seed={seed}"
    err = np.abs(got - ref)
    worst = float(np.max(err - rel_bound * magnitude))
    assert worst <= 0, f"{what}: error exceeds {rel_bound:.3g} * (|x| @ |W|) by {worst:.3g}, seed={seed}"


# (M, K, N, group_size); M spans decode (1) to prefill (256).
DENSE_SHAPES = [(1, 256, 64, 32), (7, 512, 96, 128), (64, 256, 32, 32), (256, 128, 16, 128)]
# K with no power-of-two divisor >= 64 (the tiny models' K), and GLM-4.5's
# down_proj share at TP8, 1536 / 8 = 192, whose block of 64 is the least that
# keeps the MMA.
SMALL_K_SHAPES = [(3, 96, 32, 32), (2, 48, 16, 48), (5, 192, 48, 32)]


# Small blocks and a high program target: more split-K partials and column blocks.
# (block_k 64 is the least: each pair-order dot then contracts Triton's minimum of 16.)
SMALL_TILES = Int4Tuning(block_n=16, block_k=64, num_stages=2, target_programs=4096)
# x read by the kernel's masked gather (no padding rows to fall back on); with
# one program per column block there is no split-K, and the kernel writes x's dtype.
GATHER_X = Int4Tuning(gather_x=True)
GATHER_X_UNSPLIT = Int4Tuning(gather_x=True, block_n=16, target_programs=1)
# The product in x's orientation (x w), not the default's transposed one (w^T x^T).
PLAIN = Int4Tuning(swap_ab=False)


# Scales are bf16 (what checkpoints store; the kernel's bf16 dequant math) or
# f32 (its f32 path).
@pytest.mark.parametrize("shape, tuning, scale_dtype",
                         [(shape, Int4Tuning(), jnp.bfloat16) for shape in DENSE_SHAPES]
                         + [(DENSE_SHAPES[0], SMALL_TILES, jnp.bfloat16), (DENSE_SHAPES[2], SMALL_TILES, jnp.bfloat16),
                            (DENSE_SHAPES[1], Int4Tuning(), jnp.float32), (DENSE_SHAPES[1], GATHER_X, jnp.bfloat16),
                            (DENSE_SHAPES[0], GATHER_X_UNSPLIT, jnp.bfloat16),
                            (DENSE_SHAPES[2], dataclasses.replace(SMALL_TILES, gather_x=True), jnp.bfloat16),
                            (DENSE_SHAPES[2], PLAIN, jnp.bfloat16), (DENSE_SHAPES[0], PLAIN, jnp.bfloat16),
                            (SMALL_K_SHAPES[0], PLAIN, jnp.bfloat16), (SMALL_K_SHAPES[2], PLAIN, jnp.bfloat16),
                            (DENSE_SHAPES[1], dataclasses.replace(PLAIN, gather_x=True), jnp.bfloat16),
                            # 6 packed rows per group: the per-row scale gather, not the broadcast.
                            ((5, 384, 32, 48), Int4Tuning(), jnp.bfloat16),
                            # K with no power-of-two block >= 64: a smaller block, whose dots
                            # contract < 16 and run in float32.
                            (SMALL_K_SHAPES[0], Int4Tuning(), jnp.bfloat16), (SMALL_K_SHAPES[1], GATHER_X, jnp.bfloat16),
                            # K = 192 in blocks of 64: bf16 dots contracting 16.
                            (SMALL_K_SHAPES[2], Int4Tuning(), jnp.bfloat16)])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_int4_matmul_kernel_matches_reference(shape, tuning, scale_dtype, x_dtype):
    seed = _seed()
    rng = np.random.default_rng(seed)
    m, k, n, g = shape
    values = _values(rng, (k, n))
    scales = _scales(rng, (k // g, n), jnp.bfloat16).astype(scale_dtype)
    if scale_dtype == jnp.float32:  # not bf16-representable: rounding them to bf16 is an error
        scales = scales * jnp.float32(1 + 2 ** -12)
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    packed = pack_int4(jnp.asarray(values))
    w = _dequant_f64(values, scales, g)
    magnitude = np.abs(_f64(x)) @ np.abs(w)

    ref = int4_matmul(x, packed, scales, group_size=g, backend="xla")
    if x_dtype == jnp.float32:
        _check(ref, _f64(x) @ w, magnitude, F32_TOL, seed, "reference vs float64")
    got = int4_matmul(x, packed, scales, group_size=g, backend=KERNEL_BACKEND, tuning=tuning)
    assert got.shape == (m, n) and got.dtype == x_dtype
    _check(got, _f64(ref), magnitude, F32_TOL if x_dtype == jnp.float32 else BF16_TOL, seed, "kernel vs reference")
    rel = np.max(np.abs(_f64(got) - _f64(ref))) / np.max(np.abs(_f64(ref)))
    assert rel < 1e-2, f"relative error {rel:.3g}, seed={seed}"


@pytest.mark.triton_ir
def test_int4_kernels_keep_small_dots_off_the_mma():
    """In the Triton IR the GPU compiles: at serving shapes every dot is bf16
    and >= 16 wide, including GLM-4.5's down projection share at TP8 (1536 /
    8 = 192, in blocks of 64); where K has no power-of-two block >= 64 (the
    tiny models' 32) the dots contract < 16 and take float32 operands instead,
    which the H200 computed correctly where bf16 returned twice the product.
    Both orientations of the product (Int4Tuning.swap_ab)."""
    spec = jax.ShapeDtypeStruct
    for (m, k, n, g), experts, tuning in itertools.product(
            ((1, 7168, 2048, 32), (64, 7168, 2048, 128), (1, 192, 5120, 32), (5, 32, 64, 16)), (0, 4),
            (Int4Tuning(), PLAIN)):
        if experts:
            op = functools.partial(moe_int4_matmul, group_size=g, backend="pallas", tuning=tuning)
            args = (spec((m, k), jnp.bfloat16), spec((experts, k // 8, n), jnp.int32),
                    spec((experts, k // g, n), jnp.bfloat16), spec((experts,), jnp.int32))
        else:
            op = functools.partial(int4_matmul, group_size=g, backend="pallas", tuning=tuning)
            args = (spec((m, k), jnp.bfloat16), spec((k // 8, n), jnp.int32), spec((k // g, n), jnp.bfloat16))
        [kernel] = [kern for kern in triton_kernels_for_cuda(op, *args) if kern.name == "int4_matmul"]
        dots = ttir_dots(kernel.ttir)
        assert dots and not dots_below_the_mma_minimum(kernel.ttir), (m, k, experts, dots[:2])
        assert {t for _, _, t in dots} == ({"f32"} if k % 64 else {"bf16"}), (m, k, experts, dots[:2])


def test_int4_matmul_rejects_bad_inputs():
    x = jnp.ones((2, 64), jnp.bfloat16)
    packed = pack_int4(jnp.zeros((64, 16), jnp.int8))
    scales = jnp.ones((2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not divide K"):
        int4_matmul(x, packed, jnp.ones((1, 16)), group_size=48, backend="xla")
    with pytest.raises(ValueError, match="multiple of 8"):
        int4_matmul(x, packed, jnp.ones((5, 16)), group_size=12, backend="xla")
    with pytest.raises(ValueError, match="K/8=4"):
        int4_matmul(x[:, :32], packed, scales, group_size=32, backend="xla")
    with pytest.raises(ValueError, match="scales"):
        int4_matmul(x, packed, scales[:, :8], group_size=32, backend="xla")
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(jnp.zeros((12, 4), jnp.int8))
    with pytest.raises(ValueError, match="unknown backend"):
        int4_matmul(x, packed, scales, group_size=32, backend="triton")
    with pytest.raises(ValueError, match="group_sizes_E"):
        moe_int4_matmul(x, packed[None], scales[None], jnp.array([1, 1], jnp.int32), group_size=32, backend="xla")
    # Launch choices below Triton's MMA minimum (16 per dimension) are refused
    # up front: on the GPU a dot contracting 8 ran and returned twice the product.
    with pytest.raises(ValueError, match="block_k=32 must be a power of two >= 64"):
        Int4Tuning(block_k=32)
    with pytest.raises(ValueError, match="block_n=8 must be a power of two >= 16"):
        Int4Tuning(block_n=8)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
        Int4Tuning(block_n=48)


def _moe_case(rng, group_sizes, k, n, g, x_dtype):
    e = len(group_sizes)
    t = int(sum(group_sizes))
    values = _values(rng, (e, k, n))
    scales = _scales(rng, (e, k // g, n), jnp.bfloat16)
    # The kernel gets NaN scales for idle experts: their weights must never be
    # used. (Not the reference: XLA's CPU ragged_dot multiplies every expert
    # densely and masks afterwards, so NaNs there would leak.)
    idle = np.asarray(group_sizes) == 0
    poisoned = jnp.where(jnp.asarray(idle)[:, None, None], jnp.nan, scales).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((t, k)), x_dtype)
    return x, values, scales, poisoned


def _moe_float64(x, values, scales, group_sizes, g):
    x = _f64(x)
    out = np.zeros((x.shape[0], values.shape[-1]))
    mag = np.zeros_like(out)
    row = 0
    for e, size in enumerate(group_sizes):
        if size:
            w = _dequant_f64(values[e], scales[e], g)
            out[row:row + size] = x[row:row + size] @ w
            mag[row:row + size] = np.abs(x[row:row + size]) @ np.abs(w)
        row += size
    return out, mag


MOE_CASES = [
    # decode: few tokens, many experts, most empty (first and last too)
    ((0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0), 256, 32, 32),
    # prefill: ragged groups, one bigger than a tile, an empty one in the middle
    ((37, 0, 5, 70, 1), 128, 48, 128),
    # the tiny models' down projection: K = 32, a 32-wide block whose dots run in float32
    ((3, 0, 2), 32, 16, 16),
    # a single token
    ((0, 0, 1), 128, 16, 32),
]


@pytest.mark.parametrize("case, tuning", [(case, Int4Tuning()) for case in MOE_CASES]
                         + [(MOE_CASES[1], SMALL_TILES), (MOE_CASES[0], GATHER_X), (MOE_CASES[1], PLAIN),
                            (MOE_CASES[1], dataclasses.replace(SMALL_TILES, gather_x=True))])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_moe_int4_kernel_matches_reference(case, tuning, x_dtype):
    seed = _seed()
    rng = np.random.default_rng(seed)
    group_sizes, k, n, g = case
    x, values, scales, poisoned = _moe_case(rng, group_sizes, k, n, g, x_dtype)
    expected, magnitude = _moe_float64(x, values, scales, group_sizes, g)
    packed, sizes = pack_int4(jnp.asarray(values)), jnp.asarray(group_sizes, jnp.int32)
    if x_dtype == jnp.float32:
        ref = moe_int4_matmul(x, packed, scales, sizes, group_size=g, backend="xla")
        _check(ref, expected, magnitude, F32_TOL, seed, "reference vs float64")
    got = moe_int4_matmul(x, packed, poisoned, sizes, group_size=g, backend=KERNEL_BACKEND, tuning=tuning)
    assert got.shape == (x.shape[0], n) and got.dtype == x_dtype
    _check(got, expected, magnitude, F32_TOL if x_dtype == jnp.float32 else BF16_TOL, seed, "kernel vs float64")


def test_negative_group_sizes_count_as_zero():
    """Routing counts are never negative, but traced sizes cannot raise: both backends read a
    negative size as 0 (before, XLA's ragged_dot and the kernel read [2, -3, 4] differently)."""
    seed = _seed()
    sizes, k, n, g = (2, 0, 4), 128, 16, 32
    x, values, scales, poisoned = _moe_case(np.random.default_rng(seed), sizes, k, n, g, jnp.float32)
    expected, magnitude = _moe_float64(x, values, scales, sizes, g)
    packed, negative = pack_int4(jnp.asarray(values)), jnp.asarray([2, -3, 4], jnp.int32)
    for backend, s in (("xla", scales), (KERNEL_BACKEND, poisoned)):
        got = moe_int4_matmul(x, packed, s, negative, group_size=g, backend=backend)
        _check(got, expected, magnitude, F32_TOL, seed, f"{backend} with a negative group size")


def test_moe_schedule_skips_empty_experts():
    """Only experts with tokens get tiles, so idle experts' weights are never streamed."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 3, 64) * (rng.random(64) < 0.2)  # ~80% of experts idle
    t = int(sizes.sum())
    block_m = tile_rows(-(-t // 64))
    num_tiles = -(-t // block_m) + min(64, t)
    schedule, owner = expert_tile_schedule(jnp.asarray(sizes, jnp.int32), t, block_m, num_tiles)
    used = np.asarray(schedule.rows_W) > 0
    assert sorted(np.asarray(schedule.expert_W)[used]) == sorted(np.flatnonzero(sizes)), f"seed={seed}"
    assert int(np.asarray(schedule.rows_W).sum()) == t, f"seed={seed}"
    assert np.all(np.asarray(owner.assigned_T)), f"seed={seed}"


@pytest.mark.triton_ir
@pytest.mark.parametrize("m", [1, 64, 256])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_at_gpu_shapes(m, x_dtype):
    """Pallas -> Triton IR lowering for CUDA (runs on CPU): the Kimi K2 expert
    matmul 7168 x 2048, group 32, dense and over 48 experts. The IR is read
    back and verified by jaxlib's Triton dialect, as the GPU compile does: a
    loop bound from jnp.where once lowered to an scf.for with mixed bound
    types, which interpret mode and the lowering itself let through."""
    spec = jax.ShapeDtypeStruct
    k, n, g, e = 7168, 2048, 32, 48
    dense = functools.partial(int4_matmul, group_size=g, backend="pallas")
    [kernel] = triton_kernels_for_cuda(dense, spec((m, k), x_dtype), spec((k // 8, n), jnp.int32),
                                       spec((k // g, n), jnp.bfloat16))
    assert kernel.name == "int4_matmul" and "tt.dot" in kernel.ttir
    moe = functools.partial(moe_int4_matmul, group_size=g, backend="pallas")
    [kernel] = triton_kernels_for_cuda(moe, spec((m, k), x_dtype), spec((e, k // 8, n), jnp.int32),
                                       spec((e, k // g, n), jnp.bfloat16), spec((e,), jnp.int32))
    assert kernel.name == "int4_matmul" and "tt.dot" in kernel.ttir


def _primitives_outside_kernels(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name != "pallas_call":
            for param in eqn.params.values():
                if isinstance(param, jax.extend.core.ClosedJaxpr):
                    names |= _primitives_outside_kernels(param.jaxpr)
    return names


@pytest.mark.triton_ir
def test_gather_x_calls_lower_to_triton_as_one_kernel():
    """Int4Tuning(gather_x=True) at the Kimi K2 expert shape, M = 1: x reaches
    the kernel as it is (no transpose, no pad), and with one split the kernel's
    output is the result (no sum, no cast): one kernel per call. Its x loads
    lower to masked gathers, the weight loads stay unmasked."""
    spec = jax.ShapeDtypeStruct
    k, n, g = 7168, 2048, 32
    args = (spec((1, k), jnp.bfloat16), spec((k // 8, n), jnp.int32), spec((k // g, n), jnp.bfloat16))
    extra_ops = {"transpose", "pad", "reduce_sum", "convert_element_type"}

    def primitives(tuning):
        fn = functools.partial(int4_matmul, group_size=g, backend="pallas", tuning=tuning)
        return _primitives_outside_kernels(jax.make_jaxpr(fn)(*args).jaxpr)

    assert extra_ops <= primitives(Int4Tuning())  # what gather_x removes
    assert "reduce_sum" in primitives(GATHER_X) and not {"transpose", "pad"} & primitives(GATHER_X)
    unsplit = Int4Tuning(gather_x=True, block_n=16, target_programs=n // 16)
    assert "pallas_call" in primitives(unsplit) and not extra_ops & primitives(unsplit)

    [kernel] = triton_kernels_for_cuda(functools.partial(int4_matmul, group_size=g, backend="pallas", tuning=GATHER_X),
                                       *args)
    # tt.load %ptr[, %mask, %other] : tensor<...x!tt.ptr<T>>, as (operands after the pointer, T):
    # 4 masked x loads in pair order (bf16), and unmasked weights (i32) and scales (bf16). (An f32 load
    # of the output block comes from Pallas lowering `out[...] = v` as a swap; its value is unused.)
    loads = [(re.search(r"tt\.load ([^:]*):", line).group(1).count(","), re.search(r"ptr<(\w+)>", line).group(1))
             for line in kernel.ttir.splitlines() if "tt.load" in line and "tensor<" in line]
    assert sorted(load for load in loads if load[1] != "f32") == [(0, "bf16"), (0, "i32")] + [(2, "bf16")] * 4, loads
