"""W4A16 matmul over NVFP4 weights: bf16 activations times 4-bit floats (e2m1) with an FP8 (e4m3)
scale per 16 inputs and one float32 scale per tensor. Dense and grouped (MoE).

NVFP4 is the 4-bit float format that Blackwell's tensor cores multiply natively; the seed names
NVFP4 weights on Blackwell as Workers AI's next step. Hopper has no FP4 math, so there it is a
weight-only format like INT4 (vLLM runs it there with Marlin), at the same 4.5 bits per weight as
INT4 g32 (an 8-bit scale per 16 values instead of a 16-bit one per 32). This kernel is the INT4
one (int4_matmul.py: work list, split-K, pair order) with another nibble decode.

Format:
  code: 4 bits, sign in bit 3, magnitude in bits 0-2: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (E2M1_VALUES).
  packed_QN int32 [K/8, N]: eight codes per int32 along K, the low nibble holding the lowest k
    (int4_matmul.pack_nibbles; INT4's layout, with the codes as they are instead of value + 8).
  scales_GN float8_e4m3fn [K/16, N].
  global_scale float32 [1] ([E, 1] for experts): compressed-tensors' per-tensor global scale,
    which divides:
      weight[k, n] = e2m1(code[k, n]) * float(scales[k // 16, n]) * (1 / global_scale)
  compressed-tensors "nvfp4-pack-quantized" stores weight_packed uint8 [N, K/2] (two codes a
  byte, low nibble first), weight_scale float8_e4m3fn [N, K/16] and weight_global_scale float32
  [1]: its rows of bytes, read as little-endian int32, are the rows of packed_QN transposed
  (from_compressed_tensors / to_compressed_tensors).

Quantizing (quantize_nvfp4, round to nearest as llm-compressor does):
  global_scale = 448 * 6 * (1 / amax(w)), so that the largest group scale is e4m3's largest, 448;
  scale = e4m3(amax(group) / 6 * global_scale), saturating;
  code = e2m1(w / (scale / global_scale)): nearest, ties to even, saturating at 6.
  Tested bit for bit against the compressed-tensors package on float32 weights
  (tests/test_quantization.py); it differs in the bytes, not the weights, for a group whose
  scale rounds to 0 (it stores scale 0.125 and keeps -0 codes) and above amax 2**126 (torch's
  reciprocal is subnormal there).

The kernel's decode (_fp4_pairs) puts a code's three magnitude bits into float16's exponent and
mantissa (bits 9-11) and its sign into float16's sign: float16's exponent bias is 14 more than
e2m1's, and its subnormals continue e2m1's, so the float16 is exactly e2m1(code) * 2**-14, for
every code, zero and 0.5 included. Two codes of a word decode in one int32 (nibbles j and j + 4,
as INT4's pairs).

The global scale is one number per matrix, so it multiplies each program's sum, not each weight
(NibbleCode.finish); a weight is then e2m1 * e4m3 scale, 2 + 4 significant bits, which float16
holds exactly. With bf16 x the kernel's dots are float16 tensor-core dots:
  * weights: the decoded float16 times (scale * 2**6), one float16 multiply per two weights,
    e2m1 * scale * 2**-8 exactly (its 6 significant bits never fall below float16's subnormal
    step: the least product, 0.5 * 2**-9 * 2**-8, is 2**-18);
  * x: each row times a power of two that puts its largest finite magnitude in [2**14, 2**15),
    then float16 (exact for every value above 2**-28 of the row's largest: float16 has bf16's 8
    significant bits and more); the result's row is multiplied back (exact, a power of two);
  * finish: the sum times 2**8 / global_scale.
With float32 x, the weights are float32 (e2m1 * scale, exact) and so are the dots; x's rows are
scaled the same way, so that weights up to 2688 (before the global scale) cannot overflow a sum
the reference (weights already divided by it) computes finitely.
Against the reference (weights e2m1 * (scale / global) rounded to float32, a float32 dot), the
kernel's weights carry no rounding at all; its sum is rounded once more, by the finish.
The sm_90a SASS of the inner loop (experiments/results/sm90_sass.md): 665 instructions per 256
inputs at M=1 (float32 weights and dots, before: 817; INT4: 489), 1315 at M=64 (1619; 984).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.backend import resolve_backend
from pallas_kernels.int4_matmul import (
    PACK, Int4Tuning, NibbleCode, check_activations, nibble_runner, pack_nibbles, unpack_nibbles)
from pallas_kernels.weight_stream import checked_group_sizes, dense_rows, grouped_rows, reference_dot, \
    reference_ragged_dot

GROUP = 16  # values per e4m3 scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_F16_UNIT = 2.0**14  # e2m1(code) = float16 bits of the code's fields * 2**14


def quantize_nvfp4(w_KN: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Real weights [..., K, N] -> (packed_QN int32, scales_GN float8_e4m3fn, global_scale float32
    [..., 1]); one global scale per matrix (per expert for [E, K, N])."""
    *lead, k, n = w_KN.shape
    if k % GROUP:
        raise ValueError(f"NVFP4 groups of {GROUP} inputs do not divide the input dimension {k}")
    w = w_KN.astype(jnp.float32)
    global_scale = nvfp4_global_scale(w)
    groups = w.reshape(*lead, k // GROUP, GROUP, n)
    scales = nvfp4_group_scales(jnp.max(jnp.abs(groups), axis=-2), global_scale[..., None])
    codes = nvfp4_codes(groups, scales[..., None, :], global_scale[..., None, None])
    return pack_nibbles(codes.reshape(*lead, k, n)), scales, global_scale


def nvfp4_global_scale(w_KN: jax.Array) -> jax.Array:
    """float32 [..., 1]: the global scale of matrices w [..., K, N] (global_scale_of_amax)."""
    return global_scale_of_amax(jnp.max(jnp.abs(w_KN.astype(jnp.float32)), axis=(-2, -1))[..., None])


def global_scale_of_amax(amax: jax.Array) -> jax.Array:
    """448 * 6 times the reciprocal of a tensor's largest magnitude, as torch evaluates
    compressed-tensors' `2688 / amax` (one float32 ulp from a division at times); an amax so small
    that this overflows (an all-zero tensor) gives 1, as there. Weights' and calibrated inputs' alike."""
    amax = jnp.maximum(jnp.asarray(amax, jnp.float32), jnp.finfo(jnp.float32).tiny)
    # Above 2**126 the reciprocal is subnormal, which XLA's CPU flushes to 0: scaling amax down and
    # the 2688 down by the same power of two gives the same product, rounded the same.
    down = jnp.where(amax > 1, 2.0**-64, 1.0)
    global_scale = (1.0 / (amax * down)) * (E4M3_MAX * E2M1_MAX * down)
    return jnp.where(jnp.isfinite(global_scale), global_scale, 1.0)


def nvfp4_group_scales(group_max: jax.Array, global_scale: jax.Array) -> jax.Array:
    """The e4m3 scale of groups whose largest magnitude is group_max: group_max / 6 * global_scale,
    saturating at 448."""
    limit = float(jnp.finfo(jnp.float8_e4m3fn).max)
    return jnp.clip(group_max / E2M1_MAX * global_scale, -limit, limit).astype(jnp.float8_e4m3fn)


def nvfp4_codes(w: jax.Array, scales: jax.Array, global_scale: jax.Array) -> jax.Array:
    """The nearest codes of weights w under their (broadcast) scales: e2m1(w / (scale / global)),
    divided as compressed-tensors does; a zero scale gives code 0."""
    step = scales.astype(jnp.float32) / global_scale
    return e2m1_codes(jnp.where(step > 0, w / jnp.where(step > 0, step, 1.0), 0.0))


def e2m1_codes(v: jax.Array) -> jax.Array:
    """float32 -> the nearest e2m1 code (ties to even, saturating at 6; -0 keeps its sign), uint8.

    Arithmetic, not XLA's float4_e2m1fn convert: on CPU with the loop emitters
    (--xla_cpu_use_fusion_emitters=false, this suite's flag) that convert rounds twice and
    sends 1.7499 to 2 and 1.2501 to 1. Within a binade the e2m1 values are multiples of its spacing
    s (0.5 below 2, 1 below 4, then 2) and the even multiples are the even mantissas, so rounding
    |v| / s half to even (exact: s is a power of two) is e2m1's rounding."""
    magnitude = jnp.minimum(jnp.abs(v), E2M1_MAX)
    spacing = jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0))
    rounded = jnp.round(magnitude / spacing) * spacing  # jnp.round: half to even
    # value -> code: 0, .5, 1, 1.5 -> 0-3; 2, 3 -> 4, 5; 4, 6 -> 6, 7
    code = jnp.where(rounded < 2, rounded * 2, jnp.where(rounded < 4, rounded + 2, rounded / 2 + 4))
    return (code.astype(jnp.uint8) | jnp.where(jnp.signbit(v), 8, 0).astype(jnp.uint8))


def dequantize_nvfp4(packed_QN: jax.Array, scales_GN: jax.Array, global_scale: jax.Array,
                     dtype=jnp.float32) -> jax.Array:
    """Real weights [..., K, N]: e2m1(code) * (scale * (1 / global_scale)) in float32, cast to dtype.
    The reciprocal once per matrix, then a product, as vLLM's Hopper (Marlin) path takes it;
    compressed-tensors divides each scale instead, which differs by at most one float32 rounding
    (2**-24 relative) before the cast."""
    values = jnp.asarray(E2M1_VALUES)[unpack_nibbles(packed_QN).astype(jnp.int32)]
    group = values.shape[-2] // scales_GN.shape[-2]
    step = scales_GN.astype(jnp.float32) * (1.0 / global_scale.astype(jnp.float32))[..., None]
    return (values * jnp.repeat(step, group, axis=-2)).astype(dtype)


def quantize_nvfp4_activations(x_MK: jax.Array, input_global_scale: jax.Array) -> jax.Array:
    """Rows x [..., M, K] as an FP4 tensor-core GPU (Blackwell) takes a W4A4 layer's input: each
    row's groups of 16 inputs get an e4m3 scale, amax(group) / 6 * input_global_scale, computed as
    the row arrives (dynamic), and the nearest e2m1 values under it, both as compressed-tensors
    computes them for weights (nvfp4_group_scales, nvfp4_codes). input_global_scale: float32,
    calibrated (static), broadcasting against [..., M, 1]: one per matrix, or per row where rows
    belong to different experts.

    Returns e2m1 * e4m3 scale in x's dtype, without the division by input_global_scale: 2 + 4
    significant bits and at most 6 * 448 in magnitude, which bfloat16 holds exactly, so a W4A16
    matmul of it computes the FP4 products exactly; the division belongs with the weight's global
    scale (1 / (input_global_scale * global_scale) per output, as vLLM's FP4 GEMMs take it)."""
    *lead, k = x_MK.shape
    if k % GROUP:
        raise ValueError(f"NVFP4 groups of {GROUP} inputs do not divide the input dimension {k}")
    groups = x_MK.astype(jnp.float32).reshape(*lead, k // GROUP, GROUP)
    g = jnp.asarray(input_global_scale, jnp.float32)[..., None]  # [..., M, 1, 1]
    scales = nvfp4_group_scales(jnp.max(jnp.abs(groups), axis=-1, keepdims=True), g)
    codes = nvfp4_codes(groups, scales, g)
    values = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)] * scales.astype(jnp.float32)
    return values.reshape(x_MK.shape).astype(x_MK.dtype)


def from_compressed_tensors(weight_packed_NH, weight_scale_NG, weight_global_scale):
    """compressed-tensors nvfp4-pack-quantized (..., uint8 [N, K/2], e4m3 [N, K/16], float32 [1])
    -> (packed_QN, scales_GN, global_scale). numpy in, numpy out (a checkpoint is read on the host)."""
    as_words = np.ascontiguousarray(np.asarray(weight_packed_NH, np.uint8)).view("<i4").astype(np.int32)
    return np.swapaxes(as_words, -1, -2), np.swapaxes(np.asarray(weight_scale_NG), -1, -2), \
        np.asarray(weight_global_scale, np.float32)


def to_compressed_tensors(packed_QN, scales_GN, global_scale):
    """(packed_QN, scales_GN, global_scale) -> compressed-tensors (weight_packed uint8 [N, K/2],
    weight_scale [N, K/16], weight_global_scale [1]), numpy."""
    words = np.ascontiguousarray(np.swapaxes(np.asarray(packed_QN), -1, -2)).astype("<i4")
    return words.view(np.uint8), np.swapaxes(np.asarray(scales_GN), -1, -2), np.asarray(global_scale, np.float32)


def check_nvfp4_operands(x_MK: jax.Array, packed_QN: jax.Array, scales_GN: jax.Array, global_scale: jax.Array,
                         group_size: int) -> None:
    """ValueError naming the mismatch; the weights may carry an expert axis."""
    check_activations(x_MK)
    k = x_MK.shape[1]
    if group_size <= 0 or group_size % PACK or GROUP % group_size or k % group_size:
        raise ValueError(f"group_size={group_size} must be {GROUP} (or a multiple of {PACK} dividing it, "
                         f"re-blocked for tensor parallelism) and divide K={k}")
    if packed_QN.dtype != jnp.int32 or packed_QN.shape[-2] != k // PACK:
        raise ValueError(f"packed weights must be int32 [..., K/8={k // PACK}, N], got {packed_QN.dtype}{packed_QN.shape}")
    expected = (*packed_QN.shape[:-2], k // group_size, packed_QN.shape[-1])
    if scales_GN.shape != expected or scales_GN.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"scales must be float8_e4m3fn [..., K/group_size, N] = {expected}, "
                         f"got {scales_GN.dtype}{scales_GN.shape}")
    if global_scale.shape != (*packed_QN.shape[:-2], 1) or global_scale.dtype != jnp.float32:
        raise ValueError(f"global_scale must be float32 {(*packed_QN.shape[:-2], 1)}, "
                         f"got {global_scale.dtype}{global_scale.shape}")


def nvfp4_matmul(x_MK: jax.Array, packed_QN: jax.Array, scales_GN: jax.Array, global_scale: jax.Array, *,
                 group_size: int = GROUP, backend: str | None = None, tuning: Int4Tuning = Int4Tuning()) -> jax.Array:
    """y = x @ dequantize_nvfp4(packed, scales, global_scale), f32 accumulation, in x's dtype.
    tuning: the kernel's launch choices (the INT4 kernel's); not the result."""
    backend = resolve_backend(backend)
    if packed_QN.ndim != 2:
        raise ValueError(f"packed weights must be [K/8, N], got {packed_QN.shape}")
    check_nvfp4_operands(x_MK, packed_QN, scales_GN, global_scale, group_size)
    if backend == "xla":
        return _reference(x_MK, packed_QN, scales_GN, global_scale)
    return _dense_kernel(x_MK, packed_QN, scales_GN, global_scale, group_size=group_size,
                         interpret=backend == "interpret", tuning=tuning)


def moe_nvfp4_matmul(x_TK: jax.Array, packed_EQN: jax.Array, scales_EGN: jax.Array, global_scale_E1: jax.Array,
                     group_sizes_E: jax.Array, *, group_size: int = GROUP, backend: str | None = None,
                     tuning: Int4Tuning = Int4Tuning()) -> jax.Array:
    """Expert-sorted rows (as lax.ragged_dot): row t uses the expert whose group contains t. Rows
    past sum(group_sizes_E) are zero; a negative size counts as 0 (moe_int4_matmul's rules)."""
    backend = resolve_backend(backend)
    if packed_EQN.ndim != 3:
        raise ValueError(f"packed expert weights must be [E, K/8, N], got {packed_EQN.shape}")
    check_nvfp4_operands(x_TK, packed_EQN, scales_EGN, global_scale_E1, group_size)
    group_sizes_E = checked_group_sizes(group_sizes_E, packed_EQN.shape[0])
    if backend == "xla":
        return _moe_reference(x_TK, packed_EQN, scales_EGN, global_scale_E1, group_sizes_E)
    return _moe_kernel(x_TK, packed_EQN, scales_EGN, global_scale_E1, group_sizes_E, group_size=group_size,
                       interpret=backend == "interpret", tuning=tuning)


@jax.jit
def _reference(x_MK, packed_QN, scales_GN, global_scale):
    return reference_dot(x_MK, dequantize_nvfp4(packed_QN, scales_GN, global_scale))


@jax.jit
def _moe_reference(x_TK, packed_EQN, scales_EGN, global_scale_E1, group_sizes_E):
    return reference_ragged_dot(x_TK, dequantize_nvfp4(packed_EQN, scales_EGN, global_scale_E1), group_sizes_E)


def _runner(packed_EQN, scales_EGN, global_scale_E1, *, group_size, tuning, interpret):
    # The reciprocal is XLA's, as in the reference.
    return nibble_runner(NVFP4_CODE, packed_EQN, scales_EGN, (1.0 / global_scale_E1,), group_size=group_size,
                         tuning=tuning, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "tuning"))
def _dense_kernel(x_MK, packed_QN, scales_GN, global_scale, *, group_size: int, interpret: bool, tuning: Int4Tuning):
    run = _runner(packed_QN[None], scales_GN[None], global_scale[None], group_size=group_size, tuning=tuning,
                  interpret=interpret)
    return dense_rows(x_MK, packed_QN.shape[-1], run)


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "tuning"))
def _moe_kernel(x_TK, packed_EQN, scales_EGN, global_scale_E1, group_sizes_E, *, group_size: int, interpret: bool,
                tuning: Int4Tuning):
    run = _runner(packed_EQN, scales_EGN, global_scale_E1, group_size=group_size, tuning=tuning, interpret=interpret)
    return grouped_rows(x_TK, group_sizes_E, packed_EQN.shape[-1], run)


# x read as float16 (bf16 x): weights e2m1 * scale * 2**-8, so that the least is no subnormal
# below float16's step and the largest (6 * 448 * 2**-8 = 10.5) is far from its limit.
_F16_WEIGHT_UNIT = 2.0**-8
_X_F16_TOP = 15  # a row's largest |x| is brought to [2**14, 2**15)
_SIGN_BITS = 0x80008000 - 2**32  # bit 15 of each half, as an int32


def _shift(bits: jax.Array, left: int) -> jax.Array:
    """bits << left, or >> -left (arithmetic: only bits the caller masks away come in)."""
    return bits << left if left >= 0 else bits >> -left


def _f16_halves(bits_QN: jax.Array) -> jax.Array:
    """int32 [Q, N] -> float16 [Q, N, 2]: its low and high 16 bits."""
    return jnp.stack([jax.lax.bitcast_convert_type(half_QN.astype(jnp.int16), jnp.float16)
                      for half_QN in (bits_QN, jax.lax.shift_right_logical(bits_QN, 16))], axis=-1)


def _scale_rows(dtype):
    """Each e4m3 scale in the decode's dtype, times what undoes the float16 decode's 2**-14: exact."""
    if dtype == jnp.float16:
        return lambda scale_QN: scale_QN.astype(jnp.float16) * jnp.float16(_F16_UNIT * _F16_WEIGHT_UNIT)
    return lambda scale_QN: scale_QN.astype(jnp.float32) * _F16_UNIT


def _fp4_pairs(packed_QN: jax.Array, j: int, scale_QN: jax.Array, dtype) -> jax.Array:
    """Nibbles j and j + 4 of a packed block, dequantized in pair order: [2Q, N] (int4_matmul's
    NibbleCode.dequantize_pairs), without the global scale. Each half of an int32 becomes a float16
    equal to e2m1(code) * 2**-14 (module docstring); times the scale row (which carries the 2**14),
    in float16 (exact, the float16 dots) or float32 (exact)."""
    # Magnitude bits 4j..4j+2 (and 16 higher) to 9..11, sign bit 4j+3 to 15: two shifts, two masks.
    f16_QN = (_shift(packed_QN, 9 - 4 * j) & 0x0E000E00) | (_shift(packed_QN, 12 - 4 * j) & _SIGN_BITS)
    decoded_QN2 = _f16_halves(f16_QN)
    if dtype != jnp.float16:
        decoded_QN2 = decoded_QN2.astype(jnp.float32)
    w_QN2 = (decoded_QN2 * scale_QN[:, :, None]).astype(dtype)
    q, n = packed_QN.shape
    return w_QN2.transpose(0, 2, 1).reshape(2 * q, n)


def _x_rows_scaled(x_MK: jax.Array):
    """x -> (x times a power of two per row, in float16 if x is bf16; the powers' inverses)
    (module docstring). float32 x stays float32 (its 24 significant bits would not fit float16).
    Infinities and NaNs pass through: the largest magnitude is taken over finite values."""
    x = x_MK.astype(jnp.float32)
    finite_M = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=-1)
    _, top_M = jnp.frexp(finite_M)  # |x| < 2**top (frexp(0) = (0, 0))
    shift_M = _X_F16_TOP - jnp.maximum(top_M, -100)  # no float32 overflow for rows of tiny values
    scaled = jnp.ldexp(x, shift_M[:, None])
    return (scaled.astype(jnp.float16) if x_MK.dtype == jnp.bfloat16 else scaled), jnp.ldexp(jnp.float32(1), -shift_M)


def _times_global(operand_refs, expert, dtype):
    """A program's sum times its expert's 1 / global_scale (and the float16 weights' 2**8)."""
    inv_global_ref = operand_refs[-1]
    factor_11 = inv_global_ref[expert, :][None, :]
    if dtype == jnp.float16:
        factor_11 = factor_11 * (1 / _F16_WEIGHT_UNIT)
    return lambda acc_MN: acc_MN * factor_11


NVFP4_CODE = NibbleCode("nvfp4", _scale_rows, _fp4_pairs, _x_rows_scaled, _times_global)
