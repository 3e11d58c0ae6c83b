"""FP8 weights with block scales (W8A16, dense and MoE-grouped): interpret-mode
kernels and their jnp references against float64 numpy. (The scales of a
tensor-parallel share that cuts 128-blocks: tests/test_sharding.py.)

Fresh inputs every run; the seed (from os.urandom) is in every assertion
message. The weights are random e4m3 bit patterns (every finite value,
subnormals and +-448 included, NaN excepted), the scales random float32 that
bf16 cannot represent (or bf16 ones, as some checkpoints store). The Pallas
interpreter NaN-fills kernel outputs before the kernel runs, so an unwritten
tile fails; idle experts' values and scales are NaN, so streaming them fails.
Rows of x differ in magnitude by up to 2^+-30, beyond float16's range, which
the float16 dots must scale into it.

Bounds, with W the dequantized weights and A = |x| @ |W| in float64: the
kernel converts each e4m3 value to x's dtype exactly (4 significant bits),
multiplies in the MMA exactly (bf16 x bf16 fits float32), sums in float32
and applies each block's float32 scale to the block's float32 sum. So against
float64 only float32 rounding remains, |kernel - exact| <= 1e-5 * A (as in
test_kernels_int4.py), and for bf16 x the final rounding to bf16, u * |y| <= u * A.
The XLA reference dequantizes in float32 (value * scale, one rounding) and
dots at HIGHEST precision: the same bounds. float16 dots (the default with
bf16 x) take each row of x scaled by a power of two s, with s * max|x_m| in
[2^14, 2^15): exact, but for entries below f16's normal range, which round
to its subnormal spacing 2^-24, an error of at most 2^-25 / s <= 2^-39 *
max|x_m| each, so at most 2^-39 * max|x_m| * sum_k |W_kn| in y_mn (rows
whose largest entry is below 2^-112 give 0; none are drawn here).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import KERNEL_BACKEND, dots_below_the_mma_minimum, ttir_dots
from test_kernels_int4 import F32_TOL, U_BF16, _f64, _seed

from models.weights import Fp8BlockWeight
from pallas_kernels import Fp8BlockTuning, dequantize_fp8_block, fp8_block_matmul, moe_fp8_block_matmul
from pallas_kernels.backend import triton_kernels_for_cuda

E4M3_NAN = 0x7F  # e4m3fn's only NaN pattern, with its sign bit: 0x7f and 0xff


def _fp8_values(rng, shape) -> np.ndarray:
    """Uniform random e4m3 bit patterns; NaN's two are moved to +-448 (0x7e, 0xfe)."""
    bits = rng.integers(0, 256, shape, dtype=np.uint8)
    bits = np.where(bits & 0x7F == E4M3_NAN, bits - 1, bits).astype(np.uint8)
    return bits.view(ml_dtypes.float8_e4m3fn)


def _scales(rng, shape, dtype) -> jax.Array:
    """Positive, spread over 2^-12 .. 2^-4 (real scale_inv ~ absmax / 448)."""
    return jnp.asarray(2.0 ** rng.uniform(-12, -4, shape), jnp.float32).astype(dtype)


def _dequant_f64(values, scales, block) -> np.ndarray:
    *_, k, n = values.shape
    s = np.repeat(np.repeat(_f64(scales), block[0], axis=-2), block[1], axis=-1)[..., :k, :n]
    return values.astype(np.float64) * s


def _x(rng, shape, dtype) -> jax.Array:
    """Normal rows scaled by 2^-30 .. 2^30 each (beyond f16's 2^-24 .. 65504)."""
    return jnp.asarray(rng.standard_normal(shape) * 2.0 ** rng.uniform(-30, 30, (shape[0], 1)), dtype)


def _bound(x, w_KN, magnitude, x_dtype) -> np.ndarray:
    """The module docstring's bound on |result - float64|, elementwise."""
    if x_dtype == jnp.float32:
        return F32_TOL * magnitude
    row_max = np.max(np.abs(_f64(x)), axis=1, keepdims=True)
    return (U_BF16 + F32_TOL) * magnitude + 2.0**-39 * row_max * np.sum(np.abs(w_KN), axis=0)


def _check_bound(got, expected, bound, seed, what):
    got = _f64(got)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (unwritten tile?), seed={seed}"
    worst = float(np.max(np.abs(got - expected) - bound))
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g}, seed={seed}"


def test_dequantize_matches_float64():
    seed = _seed()
    rng = np.random.default_rng(seed)
    values, scales = _fp8_values(rng, (2, 200, 300)), _scales(rng, (2, 2, 3), jnp.float32)
    got = dequantize_fp8_block(jnp.asarray(values), scales)
    np.testing.assert_allclose(_f64(got), _dequant_f64(values, scales, (128, 128)), rtol=2**-24, atol=0,
                               err_msg=f"seed={seed}")


def test_model_quantizer_writes_this_format_within_the_e4m3_bound():
    """models.weights.Fp8BlockWeight.quantize, read back through this module's format: each block's
    largest magnitude becomes +-448 (scale = absmax / 448), and every weight is within e4m3's
    rounding of w / scale: relative 2^-4 for normals, absolute 2^-10 (half the subnormal spacing
    2^-9) below 2^-6, in units of the scale. float32's division and product add 2^-24 each, covered
    by 2^-20. Rows differ by up to 2^+-8, so small rows of a block land in the subnormals."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((200, 300)) * 2.0 ** rng.uniform(-8, 8, (200, 1))).astype(np.float32)
    q = Fp8BlockWeight.quantize(jnp.asarray(w))
    back = _dequant_f64(np.asarray(q.values_KN), q.scale_inv_kn, (128, 128))
    scale = _dequant_f64(np.ones(w.shape), q.scale_inv_kn, (128, 128))
    bound = (2.0**-4 + 2.0**-20) * np.abs(w) + 2.0**-10 * scale
    assert np.all(np.abs(back - w) <= bound), f"worst excess {np.max(np.abs(back - w) - bound):.3g}, seed={seed}"
    values = np.abs(np.asarray(q.values_KN, np.float32))
    block_max = [values[r:r + 128, c:c + 128].max() for r in (0, 128) for c in (0, 128, 256)]
    assert block_max == [448.0] * 6, f"seed={seed}"


# (M, K, N, scale_block): M spans decode (1) to prefill (256); K and N that end inside a block.
DENSE_SHAPES = [(1, 512, 256, (128, 128)), (7, 384, 200, (128, 128)), (64, 256, 128, (128, 128)),
                (256, 128, 48, (128, 128)),
                # a tensor-parallel share that cut 128-blocks: GLM-4.5's 192 rows as 3 blocks of 64
                (5, 192, 96, (64, 32)),
                # the tiny models' K: 32-wide blocks whose dots take float32 below 16 (K = 8)
                (3, 32, 64, (128, 128)), (2, 8, 16, (8, 16))]
# Small blocks and a high program target: more split-K partials and column blocks.
SMALL_TILES = Fp8BlockTuning(block_n=16, block_k=16, target_programs=4096)
BF16_DOTS = Fp8BlockTuning(dot_dtype="bfloat16")
# The transposed product (w^T x^T): the row factors of f16 x multiply columns of the accumulator.
SWAP_AB = Fp8BlockTuning(swap_ab=True)


@pytest.mark.parametrize("shape, tuning, scale_dtype",
                         [(shape, Fp8BlockTuning(), jnp.float32) for shape in DENSE_SHAPES]
                         + [(DENSE_SHAPES[0], SMALL_TILES, jnp.float32), (DENSE_SHAPES[1], SMALL_TILES, jnp.float32),
                            (DENSE_SHAPES[0], BF16_DOTS, jnp.float32), (DENSE_SHAPES[4], BF16_DOTS, jnp.float32),
                            (DENSE_SHAPES[2], Fp8BlockTuning(), jnp.bfloat16),
                            (DENSE_SHAPES[1], SWAP_AB, jnp.float32), (DENSE_SHAPES[4], SWAP_AB, jnp.float32),
                            # one program per column block: no split-K, the kernel writes x's dtype
                            (DENSE_SHAPES[2], Fp8BlockTuning(block_n=16, target_programs=1), jnp.float32)])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_block_matmul_kernel_matches_float64(shape, tuning, scale_dtype, x_dtype):
    seed = _seed()
    rng = np.random.default_rng(seed)
    m, k, n, block = shape
    values = _fp8_values(rng, (k, n))
    scales = _scales(rng, (-(-k // block[0]), -(-n // block[1])), scale_dtype)
    x = _x(rng, (m, k), x_dtype)
    w = _dequant_f64(values, scales, block)
    expected, magnitude = _f64(x) @ w, np.abs(_f64(x)) @ np.abs(w)
    for backend in ("xla", KERNEL_BACKEND):
        got = fp8_block_matmul(x, jnp.asarray(values), scales, scale_block=block, backend=backend, tuning=tuning)
        assert got.shape == (m, n) and got.dtype == x_dtype
        _check_bound(got, expected, _bound(x, w, magnitude, x_dtype), seed, f"{backend} vs float64")


def _moe_case(rng, group_sizes, k, n, x_dtype):
    e = len(group_sizes)
    values = _fp8_values(rng, (e, k, n))
    scales = _scales(rng, (e, -(-k // 128), -(-n // 128)), jnp.float32)
    x = _x(rng, (int(sum(group_sizes)), k), x_dtype)
    # The kernel gets NaN values and scales for idle experts: they must never be read. (Not
    # the reference: XLA's CPU ragged_dot multiplies every expert densely and masks afterwards.)
    idle = (np.asarray(group_sizes) == 0)[:, None, None]
    poisoned_values = np.where(idle, np.float32(np.nan), values.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    poisoned_scales = jnp.where(jnp.asarray(idle), jnp.nan, scales)
    return x, values, scales, jnp.asarray(poisoned_values), poisoned_scales


def _moe_float64(x, values, scales, group_sizes, x_dtype):
    """The expected rows, and the bound on each row's error, expert by expert."""
    out, bound = np.zeros((x.shape[0], values.shape[-1])), np.zeros((x.shape[0], values.shape[-1]))
    row = 0
    for e, size in enumerate(group_sizes):
        w, rows = _dequant_f64(values[e], scales[e], (128, 128)), slice(row, row + size)
        out[rows] = _f64(x[rows]) @ w
        bound[rows] = _bound(x[rows], w, np.abs(_f64(x[rows])) @ np.abs(w), x_dtype)
        row += size
    return out, bound


MOE_CASES = [
    # decode: few tokens, many experts, most empty (first and last too)
    ((0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0), 256, 160),
    # prefill: ragged groups, one bigger than a tile, an empty one in the middle
    ((37, 0, 5, 70, 1), 384, 128),
    # the tiny models' down projection: K = 32
    ((3, 0, 2), 32, 64),
    # a single token
    ((0, 0, 1), 128, 32),
]


@pytest.mark.parametrize("case, tuning", [(case, Fp8BlockTuning()) for case in MOE_CASES]
                         + [(MOE_CASES[1], SMALL_TILES), (MOE_CASES[0], BF16_DOTS), (MOE_CASES[1], SWAP_AB)])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_moe_fp8_block_kernel_matches_float64(case, tuning, x_dtype):
    seed = _seed()
    rng = np.random.default_rng(seed)
    group_sizes, k, n = case
    x, values, scales, poisoned_values, poisoned_scales = _moe_case(rng, group_sizes, k, n, x_dtype)
    expected, bound = _moe_float64(x, values, scales, group_sizes, x_dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    ref = moe_fp8_block_matmul(x, jnp.asarray(values), scales, sizes, backend="xla")
    _check_bound(ref, expected, bound, seed, "reference vs float64")
    got = moe_fp8_block_matmul(x, poisoned_values, poisoned_scales, sizes, backend=KERNEL_BACKEND, tuning=tuning)
    assert got.shape == (x.shape[0], n) and got.dtype == x_dtype
    _check_bound(got, expected, bound, seed, "kernel vs float64")


@pytest.mark.triton_ir
def test_fp8_block_kernels_lower_to_triton_at_gpu_shapes():
    """Pallas -> Triton IR for CUDA (on CPU), read back and verified by jaxlib's Triton dialect:
    Kimi K2's expert matmul 7168 x 2048, dense and over 48 experts, and GLM-4.5's down-projection
    share at TP8 (192 rows, blocks of 64). The weights are loaded as FP8, and each dot is >= 16
    wide, in float16 by default and in bfloat16 when asked."""
    spec = jax.ShapeDtypeStruct
    shapes = ((1, 7168, 2048, 0, (128, 128)), (64, 7168, 2048, 48, (128, 128)), (256, 7168, 2048, 0, (128, 128)),
              (1, 192, 5120, 160, (64, 128)))
    for (m, k, n, experts, block), (tuning, dot_type) in itertools.product(
            shapes, ((Fp8BlockTuning(), "f16"), (BF16_DOTS, "bf16"))):
        scales = spec(((experts,) if experts else ()) + (-(-k // block[0]), -(-n // block[1])), jnp.float32)
        if experts:
            op = functools.partial(moe_fp8_block_matmul, scale_block=block, backend="pallas", tuning=tuning)
            args = (spec((m, k), jnp.bfloat16), spec((experts, k, n), jnp.float8_e4m3fn), scales,
                    spec((experts,), jnp.int32))
        else:
            op = functools.partial(fp8_block_matmul, scale_block=block, backend="pallas", tuning=tuning)
            args = (spec((m, k), jnp.bfloat16), spec((k, n), jnp.float8_e4m3fn), scales)
        [kernel] = triton_kernels_for_cuda(op, *args)
        assert kernel.name == "fp8_block_matmul", kernel.name
        dots = ttir_dots(kernel.ttir)
        assert dots and {t for _, _, t in dots} == {dot_type} and not dots_below_the_mma_minimum(kernel.ttir), dots
        weight_loads = [line for line in kernel.ttir.splitlines() if "tt.load" in line and "f8E4M3FN" in line]
        assert weight_loads, (m, k, experts)


def test_fp8_block_matmul_rejects_bad_inputs():
    x = jnp.ones((2, 256), jnp.bfloat16)
    values = jnp.ones((256, 64), jnp.float8_e4m3fn)
    scales = jnp.ones((2, 1), jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block_matmul(x, values.astype(jnp.bfloat16), scales, backend="xla")
    with pytest.raises(ValueError, match="K=128"):
        fp8_block_matmul(x[:, :128], values, scales, backend="xla")
    with pytest.raises(ValueError, match=r"ceil\(K/128\), ceil\(N/128\)\] = \(2, 1\)"):
        fp8_block_matmul(x, values, scales[:1], backend="xla")
    with pytest.raises(ValueError, match="float32 or bf16"):
        fp8_block_matmul(x, values, scales.astype(jnp.float16), backend="xla")
    with pytest.raises(ValueError, match="powers of two <= 128"):
        fp8_block_matmul(x, values, scales, scale_block=(96, 128), backend="xla")
    with pytest.raises(ValueError, match=r"ceil\(K/64\), ceil\(N/32\)\] = \(4, 2\)"):
        fp8_block_matmul(x, values, scales, scale_block=(64, 32), backend="xla")
    with pytest.raises(ValueError, match="must be \\[K, N\\]"):
        fp8_block_matmul(x, values[None], scales[None], backend="xla")
    with pytest.raises(ValueError, match="group_sizes_E"):
        moe_fp8_block_matmul(x, values[None], scales[None], jnp.array([1, 1], jnp.int32), backend="xla")
    with pytest.raises(ValueError, match="block_k=8 must be a power of two >= 16"):
        Fp8BlockTuning(block_k=8)
    with pytest.raises(ValueError, match="dot_dtype must be"):
        Fp8BlockTuning(dot_dtype="float8_e4m3fn")
