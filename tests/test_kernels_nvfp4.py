"""NVFP4 W4A16 matmuls (dense and MoE-grouped): the e2m1 decode and rounding, the reference against
float64 numpy, the interpret-mode kernels against the reference. (Quantization and packing against
the compressed-tensors package: tests/test_quantization.py; this file also runs on the GPU machine,
which has no compressed-tensors.)

Fresh inputs every run (the seed is in every message); the interpreter NaN-fills kernel outputs,
and idle experts get a NaN global scale, as in test_kernels_int4.py.

Bounds, with W the dequantized weights and A = |x| @ |W| in float64 (test_kernels_int4's
derivation, with two changes). An NVFP4 weight e2m1 * (scale / global) is not exact in float32
(2 + 24 significant bits): the reference's weights carry one float32 rounding, 2**-24 relative,
which the 1e-5 * A float32 slack covers. The kernel's weights (e2m1 * scale, the global scale applied
to each sum) are exact, and so are its float16 copy of bf16 x and its scaled copy of float32 x
(all but values below 2**-28 of a row's largest); it rounds each sum once more (the global scale,
2**-24). So kernel against reference is
still 1e-5 * A with float32 x, and 3 bf16 roundings (3 * 2**-8) * A plus 1e-5 * A with bf16 x.
"""

import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import KERNEL_BACKEND

from pallas_kernels import Int4Tuning, dequantize_nvfp4, moe_nvfp4_matmul, nvfp4_matmul, quantize_nvfp4
from pallas_kernels.int4_matmul import pack_nibbles
from pallas_kernels.nvfp4_matmul import E2M1_VALUES, _fp4_pairs, e2m1_codes

U_BF16 = float(jnp.finfo(jnp.bfloat16).eps) / 2
F32_TOL = 1e-5
BF16_TOL = 3 * U_BF16 + F32_TOL


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _weights(rng, lead, k, n):
    """Random codes (all 16, -0 included), positive e4m3 scales over several binades (normal and
    subnormal), and a global scale per matrix that is no power of two."""
    codes = rng.integers(0, 16, (*lead, k, n)).astype(np.uint8)
    # log-uniform over e4m3's range, 2**-9 (its least subnormal) to 2**8.8 (448): a uniform draw
    # would give a subnormal (below 2**-6) about once in 20,000 scales
    scales = jnp.asarray(2.0 ** rng.uniform(-9, 8.8, (*lead, k // 16, n)), jnp.float8_e4m3fn)
    global_scale = jnp.asarray(rng.uniform(50.0, 3000.0, (*lead, 1)), jnp.float32)
    return codes, scales, global_scale


def _dequant_f64(codes, scales, global_scale) -> np.ndarray:
    """The format's definition, in float64: e2m1(code) * scale / global_scale."""
    values = E2M1_VALUES.astype(np.float64)[codes]  # the table is checked against ml_dtypes below
    return values * np.repeat(_f64(scales), 16, axis=-2) / _f64(global_scale)[..., None]


def test_every_code_decodes_exactly():
    """The kernel's float16 decode of all 16 codes, in both halves of a word, equals ml_dtypes'
    float4_e2m1fn times the scale, bit for bit, -0 and the subnormal 0.5 included."""
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(expected, E2M1_VALUES)
    # Rows 8i..8i+7 hold code (i + j) % 16 at nibble j: every code in every nibble position.
    codes_KN = np.stack([(np.arange(8) + i) % 16 for i in range(16)]).reshape(-1, 1).astype(np.uint8)
    packed = pack_nibbles(jnp.asarray(codes_KN))
    scale = jnp.full((16, 1), 3.0 * 2**14, jnp.float32)  # the 2**14 that the decode takes out
    pairs = jnp.stack([_fp4_pairs(packed, j, scale, jnp.float32) for j in range(4)])  # [4, 2 * 16, 1]
    for j in range(4):
        for i in range(16):
            for h in range(2):
                code = codes_KN[8 * i + j + 4 * h, 0]
                got = np.float32(pairs[j, 2 * i + h, 0])
                assert got == 3.0 * E2M1_VALUES[code] and np.signbit(got) == np.signbit(E2M1_VALUES[code]), (j, i, h)


def test_e2m1_rounding_is_round_to_nearest_even():
    """e2m1_codes against ml_dtypes' float4_e2m1fn cast (numpy, not XLA) on every tie, both sides of
    every tie by one float32 ulp, saturation, signed zeros and random values."""
    seed = _seed()
    grid = E2M1_VALUES[:8]
    ties = (grid[1:] + grid[:-1]) / 2
    near = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, 10), grid, [6.5, 7.0, 1e30, 0.0]])
    v = np.concatenate([near, -near, np.random.default_rng(seed).uniform(-8, 8, 1000)]).astype(np.float32)
    expected = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    np.testing.assert_array_equal(np.asarray(e2m1_codes(jnp.asarray(v))), expected, err_msg=f"seed={seed}")


def test_reference_dequantize_and_round_to_nearest():
    """dequantize_nvfp4 against the float64 definition, and quantize_nvfp4 rounds every weight to
    the nearest of the 16 values its group's scale allows (ties aside). The decode rounds three
    times in float32: 1 / global_scale, scale * that, and e2m1 * that (1.5 and 3 have two
    significant bits), so it is within (1 + 2**-24)**3 - 1 relative (the bound was 2**-23 until
    seed 1514776222 met 1.24e-7)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    codes, scales, global_scale = _weights(rng, (2,), 64, 16)
    got = _f64(dequantize_nvfp4(pack_nibbles(jnp.asarray(codes)), scales, global_scale))
    want = _dequant_f64(codes, scales, global_scale)
    np.testing.assert_allclose(got, want, rtol=(1 + 2.0**-24) ** 3 - 1, atol=0, err_msg=f"seed={seed}")
    w = rng.standard_normal((64, 32)).astype(np.float32) * rng.uniform(0.01, 10.0)
    packed, scales, global_scale = quantize_nvfp4(jnp.asarray(w))
    deq = _f64(dequantize_nvfp4(packed, scales, global_scale))
    step = np.repeat(_f64(scales), 16, axis=0) / _f64(global_scale)[0]
    candidates = E2M1_VALUES.astype(np.float64)[:, None, None] * step  # [16, K, N]
    nearest = np.min(np.abs(candidates - w), axis=0)
    # The stored weight is e2m1 * fl(scale * fl(1 / global)), rounded to float32: 3 roundings of
    # 2**-24 each, under 2**-22 of |deq|, which the float64 candidates do not have.
    assert np.all(np.abs(deq - w) <= nearest + 2.0**-22 * np.abs(deq)), f"seed={seed}"
    # The largest group scale is e4m3's largest (448): the global scale spends its whole range.
    assert float(jnp.max(scales.astype(jnp.float32))) == 448.0


def test_zero_and_tiny_weights_quantize_to_zero_not_nan():
    for w in (np.zeros((32, 8), np.float32), np.full((32, 8), 1e-30, np.float32)):
        packed, scales, global_scale = quantize_nvfp4(jnp.asarray(w))
        deq = np.asarray(dequantize_nvfp4(packed, scales, global_scale))
        assert np.all(np.isfinite(deq)) and np.all(np.isfinite(np.asarray(global_scale)))
        np.testing.assert_allclose(deq, w, atol=1e-30)


def _check(got, ref, magnitude, rel_bound, seed, what):
    got = _f64(got)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (unwritten tile?), seed={seed}"
    worst = float(np.max(np.abs(got - ref) - rel_bound * magnitude))
    assert worst <= 0, f"{what}: error exceeds {rel_bound:.3g} * (|x| @ |W|) by {worst:.3g}, seed={seed}"


DENSE_SHAPES = [(1, 256, 64), (7, 512, 96), (64, 256, 32), (3, 96, 32), (5, 192, 48)]


@pytest.mark.parametrize("shape, tuning", [(s, Int4Tuning()) for s in DENSE_SHAPES]
                         + [(DENSE_SHAPES[2], Int4Tuning(swap_ab=False)), (DENSE_SHAPES[1], Int4Tuning(gather_x=True)),
                            (DENSE_SHAPES[0], Int4Tuning(block_n=16, block_k=64, target_programs=4096))])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_nvfp4_matmul_kernel_matches_reference(shape, tuning, x_dtype):
    seed = _seed()
    rng = np.random.default_rng(seed)
    m, k, n = shape
    codes, scales, global_scale = _weights(rng, (), k, n)
    packed = pack_nibbles(jnp.asarray(codes))
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    w = _dequant_f64(codes, scales, global_scale)
    magnitude = np.abs(_f64(x)) @ np.abs(w)
    ref = nvfp4_matmul(x, packed, scales, global_scale, backend="xla")
    if x_dtype == jnp.float32:
        _check(ref, _f64(x) @ w, magnitude, F32_TOL, seed, "reference vs float64")
    got = nvfp4_matmul(x, packed, scales, global_scale, backend=KERNEL_BACKEND, tuning=tuning)
    assert got.shape == (m, n) and got.dtype == x_dtype
    _check(got, _f64(ref), magnitude, F32_TOL if x_dtype == jnp.float32 else BF16_TOL, seed, "kernel vs reference")
    rel = np.max(np.abs(_f64(got) - _f64(ref))) / np.max(np.abs(_f64(ref)))
    assert rel < 1e-2, f"relative error {rel:.3g}, seed={seed}"


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_rows_of_any_magnitude_keep_their_precision(x_dtype):
    """x reaches the kernel's dots scaled row by row (a power of two each; bf16 x in float16):
    rows far outside float16's range (1e-30, 1e6, 1e30) and a zero row give what the reference
    gives, within the bound. Without the scaling, in float16, 1e6 would overflow and 1e-30 flush to
    zero. A row with an infinity gives the reference's infinities (its largest finite value sets
    the scale)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    codes, scales, global_scale = _weights(rng, (), 256, 32)
    packed = pack_nibbles(jnp.asarray(codes))
    magnitudes = np.array([1e-30, 1e-3, 1.0, 1e6, 1e30, 0.0])[:, None]
    x = jnp.asarray(rng.standard_normal((6, 256)) * magnitudes, x_dtype)
    w = _dequant_f64(codes, scales, global_scale)
    ref = nvfp4_matmul(x, packed, scales, global_scale, backend="xla")
    got = nvfp4_matmul(x, packed, scales, global_scale, backend=KERNEL_BACKEND)
    bound = BF16_TOL if x_dtype == jnp.bfloat16 else F32_TOL
    _check(got, _f64(ref), np.abs(_f64(x)) @ np.abs(w), bound, seed, "rows of spread magnitudes")
    assert np.all(np.abs(_f64(got)[:5]) > 0) and np.all(_f64(got)[5] == 0), f"seed={seed}"
    x_inf = x.at[2, 7].set(jnp.inf)
    ref, got = (_f64(nvfp4_matmul(x_inf, packed, scales, global_scale, backend=b))[2] for b in ("xla", KERNEL_BACKEND))
    np.testing.assert_array_equal(got, ref, err_msg=f"seed={seed}")


MOE_CASES = [((0, 1, 0, 0, 2, 0, 0, 1), 256, 32), ((37, 0, 5, 70, 1), 128, 48), ((3, 0, 2), 32, 16)]


@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_moe_nvfp4_kernel_matches_float64(case, x_dtype):
    seed = _seed()
    rng = np.random.default_rng(seed)
    group_sizes, k, n = case
    codes, scales, global_scale = _weights(rng, (len(group_sizes),), k, n)
    x = jnp.asarray(rng.standard_normal((sum(group_sizes), k)), x_dtype)
    expected, magnitude = np.zeros((x.shape[0], n)), np.zeros((x.shape[0], n))
    row = 0
    for e, size in enumerate(group_sizes):
        w = _dequant_f64(codes[e], scales[e], global_scale[e])
        expected[row:row + size] = _f64(x[row:row + size]) @ w
        magnitude[row:row + size] = np.abs(_f64(x[row:row + size])) @ np.abs(w)
        row += size
    packed, sizes = pack_nibbles(jnp.asarray(codes)), jnp.asarray(group_sizes, jnp.int32)
    if x_dtype == jnp.float32:
        ref = moe_nvfp4_matmul(x, packed, scales, global_scale, sizes, backend="xla")
        _check(ref, expected, magnitude, F32_TOL, seed, "reference vs float64")
    # Idle experts' global scales are NaN: streaming their weights would poison the output.
    idle = jnp.asarray(np.asarray(group_sizes) == 0)[:, None]
    poisoned = jnp.where(idle, jnp.nan, global_scale)
    got = moe_nvfp4_matmul(x, packed, scales, poisoned, sizes, backend=KERNEL_BACKEND)
    assert got.shape == (x.shape[0], n) and got.dtype == x_dtype
    bound = F32_TOL if x_dtype == jnp.float32 else 2 * U_BF16 + F32_TOL  # against float64: 2 roundings
    _check(got, expected, magnitude, bound, seed, "kernel vs float64")


def test_nvfp4_matmul_rejects_bad_inputs():
    x = jnp.ones((2, 64), jnp.bfloat16)
    packed = pack_nibbles(jnp.zeros((64, 16), jnp.uint8))
    scales = jnp.ones((4, 16), jnp.float8_e4m3fn)
    g = jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nvfp4_matmul(x, packed, scales.astype(jnp.bfloat16), g, backend="xla")
    with pytest.raises(ValueError, match="global_scale must be float32 \\(1,\\)"):
        nvfp4_matmul(x, packed, scales, jnp.ones((), jnp.float32), backend="xla")
    with pytest.raises(ValueError, match="group_size=32 must be 16"):
        nvfp4_matmul(x, packed, scales, g, group_size=32, backend="xla")
    with pytest.raises(ValueError, match="K/8=4"):
        nvfp4_matmul(x[:, :32], packed, scales, g, backend="xla")
    with pytest.raises(ValueError, match="groups of 16 inputs do not divide"):
        quantize_nvfp4(jnp.ones((24, 8)))
    with pytest.raises(ValueError, match="group_sizes_E"):
        moe_nvfp4_matmul(x, packed[None], scales[None], g[None], jnp.array([1, 1], jnp.int32), backend="xla")
