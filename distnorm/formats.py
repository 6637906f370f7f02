"""Quantization formats: specs, output geometry, exact conversions and scale layouts.

Everything here follows docs/SEMANTICS.md bit for bit. The helpers are plain vectorized torch code
that runs on CPU and CUDA tensors alike, so the reference (and the GPU tests) can use them on any
device. Bit tricks go through int32 views of float32 tensors, never through Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

QUANT_KINDS = ("fp8", "fp8_per_token", "fp8_per_group", "nvfp4", "mxfp8", "mxfp4")
GROUP_SIZES = (128, 64)
SF_LAYOUTS = ("linear", "swizzled")
SCALE_MAJORS = ("row", "col")

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MIN_HIDDEN = 256
MAX_HIDDEN = 32768
PER_TOKEN_MIN_AMAX = 1e-10  # used as float32(1e-10), the floor of a row / group amax
NVFP4_BLOCK = 16
MX_BLOCK = 32

_BLOCK_SCALED = ("nvfp4", "mxfp8", "mxfp4")
_FP32_NAN_BITS = 0x7FC00000


class NormQuantOutput(NamedTuple):
    """What every norm-quant op returns; fields not asked for are None.

    residual: new residual h [M, H] T (only when a residual was given).
    y: normed output T(y) [M, H] (when norm_out=True or quant is None).
    q: quantized y (float8_e4m3fn [M, H], or uint8 [M, H/2] for packed fp4).
    scales: see scales_geometry (static fp8: the given scale tensor).
    allreduce: the plain all-reduce result T(acc) [M, H] (only when asked).
    """

    residual: Optional[Tensor] = None
    y: Optional[Tensor] = None
    q: Optional[Tensor] = None
    scales: Optional[Tensor] = None
    allreduce: Optional[Tensor] = None


@dataclass(frozen=True)
class QuantSpec:
    """A normalized quantization format. Build it with make_quant_spec.

    group_size: elements per scale along H (per-group 64/128, nvfp4 16, mx 32; 0 for static fp8 and
    per-token). Fields irrelevant to `kind` hold neutral values (sf_layout "linear", scale_major "row",
    scale_ue8m0 False) so that equal formats compare (and hash, e.g. as kernel cache keys) equal.
    """

    kind: str
    group_size: int = 0
    sf_layout: str = "linear"
    scale_major: str = "row"
    scale_ue8m0: bool = False

    @property
    def block(self) -> int:
        return self.group_size

    @property
    def packed_fp4(self) -> bool:
        return self.kind in ("nvfp4", "mxfp4")

    @property
    def block_scaled(self) -> bool:
        """nvfp4 / mxfp8 / mxfp4: 1-byte scales with a linear or swizzled layout."""
        return self.kind in _BLOCK_SCALED

    @property
    def is_mx(self) -> bool:
        return self.kind in ("mxfp8", "mxfp4")

    @property
    def swizzled(self) -> bool:
        return self.sf_layout == "swizzled"

    @property
    def elem_max(self) -> float:
        """Largest magnitude of the element format (e2m1: 6, e4m3: 448)."""
        return E2M1_MAX if self.packed_fp4 else E4M3_MAX

    @property
    def hidden_multiple(self) -> int:
        return self.group_size if self.group_size else 8


def make_quant_spec(quant: Union[str, QuantSpec, None], *, group_size: int = 128,
                    sf_layout: str = "swizzled", scale_major: str = "row",
                    scale_ue8m0: bool = False) -> Optional[QuantSpec]:
    """Validate the user's quant options and return a QuantSpec (None for quant=None).

    `quant` may also be a QuantSpec, returned as is (the keyword options are then ignored).
    Options that do not apply to `quant` are ignored (not validated).
    """
    if quant is None:
        return None
    if isinstance(quant, QuantSpec):
        return quant
    if quant not in QUANT_KINDS:
        raise ValueError(f"quant must be None or one of {QUANT_KINDS}, got {quant!r}")
    if quant in ("fp8", "fp8_per_token"):
        return QuantSpec(quant)
    if quant == "fp8_per_group":
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES} for quant='fp8_per_group', "
                             f"got {group_size!r}")
        if scale_major not in SCALE_MAJORS:
            raise ValueError(f"scale_major must be one of {SCALE_MAJORS}, got {scale_major!r}")
        if not isinstance(scale_ue8m0, bool):
            raise ValueError(f"scale_ue8m0 must be a bool, got {scale_ue8m0!r}")
        return QuantSpec(quant, int(group_size), "linear", scale_major, scale_ue8m0)
    if sf_layout not in SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {SF_LAYOUTS} for quant={quant!r}, got {sf_layout!r}")
    return QuantSpec(quant, NVFP4_BLOCK if quant == "nvfp4" else MX_BLOCK, sf_layout)


def hidden_multiple(spec: Optional[QuantSpec]) -> int:
    """H must be a multiple of this: 8 (vector width) or the scale block along H."""
    return 8 if spec is None else spec.hidden_multiple


def check_hidden(spec: Optional[QuantSpec], H: int) -> None:
    """ValueError unless 256 <= H <= 32768 and H is a multiple of hidden_multiple(spec)."""
    m = hidden_multiple(spec)
    if not (MIN_HIDDEN <= H <= MAX_HIDDEN) or H % m:
        kind = None if spec is None else spec.kind
        raise ValueError(f"hidden size H={H} must be in [{MIN_HIDDEN}, {MAX_HIDDEN}] and a multiple "
                         f"of {m} for quant={kind!r}")


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ---- output geometry (shared by the reference and the op's allocator) ----

def q_shape(spec: QuantSpec, M: int, H: int) -> Tuple[int, int]:
    return (M, H // 2) if spec.packed_fp4 else (M, H)


def q_dtype(spec: QuantSpec) -> torch.dtype:
    return torch.uint8 if spec.packed_fp4 else torch.float8_e4m3fn


def scales_geometry(spec: Optional[QuantSpec], M: int, H: int):
    """(shape, stride, dtype) of the scales output, or None (no quant, or static fp8 which returns
    the caller's scale tensor)."""
    if spec is None or spec.kind == "fp8":
        return None
    if spec.kind == "fp8_per_token":
        return (M, 1), (1, 1), torch.float32
    K = H // spec.group_size
    if spec.kind == "fp8_per_group":
        stride = (1, M) if spec.scale_major == "col" else (K, 1)
        return (M, K), stride, torch.float32
    dtype = torch.float8_e4m3fn if spec.kind == "nvfp4" else torch.uint8
    if spec.sf_layout == "linear":
        return (M, K), (K, 1), dtype
    Mp, Kp = round_up(M, 128), round_up(K, 4)
    return (Mp, Kp), (Kp, 1), dtype


def empty_scales(spec: Optional[QuantSpec], M: int, H: int, device) -> Optional[Tensor]:
    """Uninitialized scales output (the writer must also zero any swizzle padding)."""
    geo = scales_geometry(spec, M, H)
    if geo is None:
        return None
    shape, stride, dtype = geo
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


# ---- exact scalar conversions ----

def f32_bits(v: Tensor) -> Tensor:
    """int32 view of a float32 tensor (same storage)."""
    return v.view(torch.int32)


def bits_f32(b: Tensor) -> Tensor:
    return b.to(torch.int32).view(torch.float32)


def rcp(v: Tensor) -> Tensor:
    """Correctly rounded float32 1/v (torch's reciprocal is a true division on CPU and CUDA)."""
    return torch.reciprocal(v.float())


def div_f32(a: Tensor, b: float) -> Tensor:
    """Correctly rounded float32 a / b for a constant b.

    The divisor is a 0-dim tensor on a's device on purpose: CUDA torch turns `t / python_float`
    into `t * (1/b)`, which rounds differently (e.g. for b = 448).
    """
    return a / torch.tensor(b, dtype=torch.float32, device=a.device)


def amax_nan(t: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """max |t| along dim; NaN when any element is NaN (torch.amax propagates NaN, unlike fmax)."""
    return t.abs().amax(dim=dim, keepdim=keepdim)


def e4m3_rn_satfinite(v: Tensor) -> Tensor:
    """float32 -> float8_e4m3fn, round-to-nearest-even, |v| > 448 (inf included) -> ±448, NaN -> NaN.

    Clamp first: depending on version and device, torch's own cast may map overflow to NaN.
    clamp keeps NaN (and its sign bit: 0x7F or 0xFF).
    """
    return v.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# Magnitude code = number of thresholds passed; '>' at the thresholds whose lower neighbour has an
# even code (ties go down to it), '>=' where the upper neighbour is even (ties go up).
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                    (2.5, False), (3.5, True), (5.0, False))
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_codes(v: Tensor) -> Tensor:
    """float32 -> e2m1 4-bit codes (uint8 0..15): sign bit 3 from v's sign bit (-0.0 -> 8),
    magnitude RNE with ties to the even code, saturating at 6 (inf -> 6), NaN -> magnitude 0."""
    a = v.float().abs()
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t, inclusive in _E2M1_THRESHOLDS:
        mag += (a >= t) if inclusive else (a > t)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_values(codes: Tensor) -> Tensor:
    """e2m1 codes (0..15) -> float32 values (code 8 is -0.0)."""
    grid = list(E2M1_GRID) + [-g for g in E2M1_GRID]
    table = torch.tensor(grid, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """[..., 2k] codes -> [..., k] uint8 bytes, element 2j in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """[..., k] uint8 bytes -> [..., 2k] codes (inverse of pack_fp4)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def ue8m0_code(v: Tensor) -> Tensor:
    """Smallest power of two >= v (v >= 0) as a UE8M0 code: exponent field, +1 if the mantissa is
    nonzero, capped at 255; 0 -> 0, subnormals -> 1, NaN and inf -> 255. Returns uint8."""
    b = f32_bits(v.float())
    c = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(torch.int32)
    return c.clamp(max=255).to(torch.uint8)


def ue8m0_inverse(code: Tensor) -> Tensor:
    """2^(127 - c) as float32, built from bits: c=0 -> 2^127, c=254 -> 2^-127 (subnormal), 255 -> NaN."""
    c = code.to(torch.int32)
    normal = (254 - c) << 23
    special = torch.where(c == 254, 1 << 22, _FP32_NAN_BITS).to(torch.int32)
    return bits_f32(torch.where(c < 254, normal, special))


def ue8m0_value(code: Tensor) -> Tensor:
    """2^(c - 127) as float32 (the dequant scale): c=0 -> 2^-127 (subnormal), c=255 -> NaN."""
    c = code.to(torch.int32)
    special = torch.where(c == 0, 1 << 22, _FP32_NAN_BITS).to(torch.int32)
    return bits_f32(torch.where((c >= 1) & (c <= 254), c << 23, special))


def round_up_pow2_bits(s: Tensor) -> Tensor:
    """Per-group UE8M0 rounding of a positive float32 scale: b = ((b >> 23) + (mantissa != 0)) << 23.
    NaN stays NaN (the bit formula alone would turn it into -0.0)."""
    s = s.float()
    b = f32_bits(s)
    r = bits_f32(((b >> 23) + ((b & 0x7FFFFF) != 0).to(torch.int32)) << 23)
    return torch.where(torch.isnan(s), s, r)


# ---- 128x4 swizzled scale layout ----

def swizzled_offset(m, k, Kp: int):
    """Flat offset of scale (m, k) in the swizzled [Mp, Kp] layout (ints or integer tensors)."""
    return (((m // 128) * (Kp // 4) + k // 4) * 512 + (m % 32) * 16
            + ((m % 128) // 32) * 4 + k % 4)


def to_swizzled(linear: Tensor) -> Tensor:
    """[M, K] linear scales -> [Mp, Kp] swizzled (Mp = M up to 128, Kp = K up to 4), zero padding."""
    M, K = linear.shape
    Mp, Kp = round_up(M, 128), round_up(K, 4)
    src = linear.view(torch.uint8) if linear.element_size() == 1 else linear
    pad = src.new_zeros((Mp, Kp))
    pad[:M, :K] = src
    # m = m0*128 + m1*32 + m2, k = k0*4 + k1; memory order (m0, k0, m2, m1, k1)
    out = pad.view(Mp // 128, 4, 32, Kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(Mp, Kp)
    return out.view(linear.dtype) if linear.element_size() == 1 else out


def from_swizzled(sw: Tensor, M: int, K: int) -> Tensor:
    """Inverse of to_swizzled: the [M, K] linear scales held by a swizzled [Mp, Kp] tensor."""
    Mp, Kp = round_up(M, 128), round_up(K, 4)
    if sw.numel() != Mp * Kp:
        raise ValueError(f"swizzled scales must hold {Mp}x{Kp} elements for M={M}, K={K}, "
                         f"got shape {tuple(sw.shape)}")
    t = sw.reshape(Mp // 128, Kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(Mp, Kp)
    return t[:M, :K]
