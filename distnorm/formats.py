"""Quantization formats: specs, output geometry, exact conversions and scale layouts.

Everything here follows docs/SEMANTICS.md bit for bit. The helpers are plain vectorized torch code
that runs on CPU and CUDA tensors alike, so the reference (and the GPU tests) can use them on any
device. Bit tricks go through int32 views of float32 tensors, never through Python loops.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MIN_HIDDEN = 256
MAX_HIDDEN = 32768
VEC = 8  # elements per 16-byte vector of bf16/fp16: H is always a multiple of it
PER_TOKEN_MIN_AMAX = 1e-10  # used as float32(1e-10), the floor of a row / group amax
_FP32_NAN_BITS = 0x7FC00000


@dataclass(frozen=True)
class FormatInfo:
    """Facts of one quantization format (docs/SEMANTICS.md). The one table of them is FORMATS.

    scales: "none" (no quantization), "static" (the caller's float32 scale), "row" (float32 [M, 1]),
      "group" (float32 [M, H/g], row- or column-major) or "block" (1-byte scales, linear or 128x4
      swizzled).
    group_sizes: allowed elements per scale along H (the first is the default; () = no blocks).
    elem_max: largest magnitude of the element format (e4m3 448, e2m1 6).
    packed_fp4: two e2m1 codes per byte.
    scale_dtype: dtype of the scales output (None: none, or the caller's tensor).
    scalar: the float32 [1] tensor argument the format needs ("scale", "global_scale" or "").
    """

    scales: str
    group_sizes: tuple = ()
    elem_max: float = E4M3_MAX
    packed_fp4: bool = False
    scale_dtype: Optional[torch.dtype] = None
    scalar: str = ""


FORMATS = {
    "none": FormatInfo("none"),
    "fp8": FormatInfo("static", scalar="scale"),
    "fp8_per_token": FormatInfo("row", scale_dtype=torch.float32),
    "fp8_per_group": FormatInfo("group", (128, 64), scale_dtype=torch.float32),
    "nvfp4": FormatInfo("block", (16,), E2M1_MAX, True, torch.float8_e4m3fn, "global_scale"),
    "mxfp8": FormatInfo("block", (32,), E4M3_MAX, False, torch.uint8),
    "mxfp4": FormatInfo("block", (32,), E2M1_MAX, True, torch.uint8),
}
QUANT_KINDS = tuple(k for k in FORMATS if k != "none")  # what users pass as `quant`
SF_LAYOUTS = ("linear", "swizzled")
SCALE_MAJORS = ("row", "col")


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
    """A normalized quantization format: what the ops, the reference and the kernels' compile keys
    all take. Build it with make_quant_spec; ``QuantSpec("none")`` (NO_QUANT) is the kernels' form
    of quant=None.

    group_size: elements per scale along H (per-group 64/128, nvfp4 16, mx 32; 0 for static fp8,
    per-token and none). Fields irrelevant to `kind` hold neutral values (sf_layout "linear",
    scale_major "row", scale_ue8m0 False) so that equal formats compare (and hash) equal.
    """

    kind: str
    group_size: int = 0
    sf_layout: str = "linear"
    scale_major: str = "row"
    scale_ue8m0: bool = False

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        # hashed once: specs key the compiled-kernel caches on every eager call (a __post_init__
        # setting it broke torch 2.11's dynamo under fullgraph=True)
        return hash((self.kind, self.group_size, self.sf_layout, self.scale_major, self.scale_ue8m0))

    @property
    def info(self) -> FormatInfo:
        return FORMATS[self.kind]

    @property
    def packed_fp4(self) -> bool:
        return FORMATS[self.kind].packed_fp4

    @property
    def grouped(self) -> bool:
        """One scale per group_size elements along H (per-group and the block-scaled formats)."""
        return self.group_size > 0

    @property
    def block_scaled(self) -> bool:
        """nvfp4 / mxfp8 / mxfp4: 1-byte scales with a linear or swizzled layout."""
        return FORMATS[self.kind].scales == "block"

    @property
    def float_scales(self) -> bool:
        """per-token / per-group: float32 scales written by the op."""
        return FORMATS[self.kind].scales in ("row", "group")

    @property
    def swizzled(self) -> bool:
        return self.sf_layout == "swizzled"

    @property
    def col_major(self) -> bool:
        return self.scale_major == "col"

    @property
    def elem_max(self) -> float:
        return FORMATS[self.kind].elem_max

    @property
    def hidden_multiple(self) -> int:
        """H must be a multiple of this: the vector width or the scale block along H."""
        return self.group_size if self.group_size else VEC

    @property
    def code(self) -> str:
        """A string that names this spec exactly (custom-op schemas take no dataclasses);
        QuantSpec.from_code inverts it."""
        return f"{self.kind}:{self.group_size}:{self.sf_layout}:{self.scale_major}:{int(self.scale_ue8m0)}"

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def from_code(code: str) -> Optional["QuantSpec"]:
        """The spec named by `code` (None for "none")."""
        kind, g, layout, major, ue8m0 = code.split(":")
        return None if kind == "none" else QuantSpec(kind, int(g), layout, major, ue8m0 == "1")


NO_QUANT = QuantSpec("none")


def kernel_spec(spec: Optional[QuantSpec]) -> QuantSpec:
    """The spec a kernel is compiled for: NO_QUANT for quant=None."""
    return NO_QUANT if spec is None else spec


def spec_code(spec: Optional[QuantSpec]) -> str:
    """`spec` as the string the torch.library ops take (QuantSpec.from_code reads it back)."""
    return kernel_spec(spec).code


def _validated_spec(quant, group_size, sf_layout, scale_major, scale_ue8m0) -> Optional[QuantSpec]:
    if quant is None:
        return None
    if isinstance(quant, QuantSpec):
        return quant
    if quant not in QUANT_KINDS:
        raise ValueError(f"quant must be None or one of {QUANT_KINDS}, got {quant!r}")
    info = FORMATS[quant]
    if info.scales in ("static", "row"):
        return QuantSpec(quant)
    if info.scales == "group":
        if isinstance(group_size, bool) or group_size not in info.group_sizes:
            raise ValueError(f"group_size must be one of {info.group_sizes} for quant={quant!r}, "
                             f"got {group_size!r}")
        if scale_major not in SCALE_MAJORS:
            raise ValueError(f"scale_major must be one of {SCALE_MAJORS}, got {scale_major!r}")
        if not isinstance(scale_ue8m0, bool):
            raise ValueError(f"scale_ue8m0 must be a bool, got {scale_ue8m0!r}")
        return QuantSpec(quant, int(group_size), "linear", scale_major, scale_ue8m0)
    if sf_layout not in SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {SF_LAYOUTS} for quant={quant!r}, got {sf_layout!r}")
    return QuantSpec(quant, info.group_sizes[0], sf_layout)


_cached_spec = functools.lru_cache(maxsize=256, typed=True)(_validated_spec)


def make_quant_spec(quant: Union[str, QuantSpec, None], *, group_size: int = 128,
                    sf_layout: str = "swizzled", scale_major: str = "row",
                    scale_ue8m0: bool = False) -> Optional[QuantSpec]:
    """Validate the user's quant options and return a QuantSpec (None for quant=None).

    `quant` may also be a QuantSpec, returned as is (the keyword options are then ignored).
    Options that do not apply to `quant` are ignored (not validated). Memoized: the eager ops call
    it on every call.
    """
    if torch.compiler.is_compiling():  # dynamo traces through caches; validate plainly
        return _validated_spec(quant, group_size, sf_layout, scale_major, scale_ue8m0)
    try:
        return _cached_spec(quant, group_size, sf_layout, scale_major, scale_ue8m0)
    except TypeError:  # an unhashable option: validate uncached (it raises with the reason)
        return _validated_spec(quant, group_size, sf_layout, scale_major, scale_ue8m0)


def format_variants() -> list:
    """(name, quant, options) for every format and every layout choice of FORMATS, quant=None first:
    what the main job (python -m distnorm) checks."""
    variants = [("none", None, {})]
    for kind in QUANT_KINDS:
        info = FORMATS[kind]
        if info.scales == "group":
            variants += [(f"{kind}{g}_{major}{'_ue8m0' * ue8m0}", kind,
                          {"group_size": g, "scale_major": major, "scale_ue8m0": ue8m0})
                         for g in info.group_sizes for major in SCALE_MAJORS for ue8m0 in (False, True)]
        elif info.scales == "block":
            variants += [(f"{kind}_{layout}", kind, {"sf_layout": layout}) for layout in SF_LAYOUTS]
        else:
            variants.append((kind, kind, {}))
    return variants


def hidden_multiple(spec: Optional[QuantSpec]) -> int:
    """H must be a multiple of this: 8 (vector width) or the scale block along H."""
    return VEC if spec is None else spec.hidden_multiple


def check_hidden(spec: Optional[QuantSpec], H: int) -> None:
    """ValueError unless 256 <= H <= 32768 and H is a multiple of hidden_multiple(spec)."""
    m = hidden_multiple(spec)
    if not (MIN_HIDDEN <= H <= MAX_HIDDEN) or H % m:
        kind = None if spec is None else spec.kind
        raise ValueError(f"hidden size H={H} must be in [{MIN_HIDDEN}, {MAX_HIDDEN}] and a multiple "
                         f"of {m} for quant={kind!r}")


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return (n + m - 1) // m * m


# ---- output geometry (shared by the reference and the op's allocator) ----

def q_shape(spec: QuantSpec, M: int, H: int) -> Tuple[int, int]:
    """Shape of q for M x H inputs: [M, H] of 1-byte codes, [M, H / 2] for packed FP4."""
    return (M, H // 2) if spec.packed_fp4 else (M, H)


def q_dtype(spec: QuantSpec) -> torch.dtype:
    """Dtype of q: float8_e4m3fn, or uint8 holding two packed FP4 codes per byte."""
    return torch.uint8 if spec.packed_fp4 else torch.float8_e4m3fn


def scales_geometry(spec: Optional[QuantSpec], M: int, H: int):
    """(shape, stride, dtype) of the scales output, or None (no quant, or static fp8 which returns
    the caller's scale tensor)."""
    info = kernel_spec(spec).info
    if info.scale_dtype is None:
        return None
    if info.scales == "row":
        return (M, 1), (1, 1), info.scale_dtype
    K = H // spec.group_size
    if info.scales == "group":
        stride = (1, M) if spec.col_major else (K, 1)
        return (M, K), stride, info.scale_dtype
    if not spec.swizzled:
        return (M, K), (K, 1), info.scale_dtype
    Mp, Kp = round_up(M, 128), round_up(K, 4)
    return (Mp, Kp), (Kp, 1), info.scale_dtype


def pushed_scale_row_bytes(spec: Optional[QuantSpec], H: int) -> int:
    """Bytes of one row of spec's scales when a kernel can push them as rows of whole 4-byte
    units (16-byte units where the row has them), else 0 (no scales, column-major layouts, rows
    of another size). Row-major linear layouts hold each row's scales contiguous; the 128x4
    swizzled one holds a row's blocks 4b .. 4b + 3 in one 4-byte word (swizzled_offset), so a row
    of whole words is read word by word and pushed as its linear row (NOTE [swizzled scales
    gathered] in kernels/reducescatter.py)."""
    if spec is not None and spec.block_scaled and spec.swizzled:
        spec = dataclasses.replace(spec, sf_layout="linear")  # its rows' words, read as linear
    geo = scales_geometry(spec, 1, H)
    if geo is None or spec.col_major:
        return 0
    (_, k), _, dtype = geo
    row_bytes = k * dtype.itemsize
    return row_bytes if row_bytes % 4 == 0 else 0


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


def swizzle_into(linear: Tensor, out: Tensor) -> None:
    """Write [M, K] linear scales into out, a contiguous swizzled [Mp, Kp] tensor of the same
    dtype (1-byte scales), as to_swizzled lays them out. With K % 4 == 0 the whole 128-row tiles
    are one copy of 4-byte words (a tile row's blocks 4b..4b + 3 are one word in both layouts)
    into a permuted view of out, and a last partial tile goes through to_swizzled; other K take
    to_swizzled whole. Words, not bytes: on one H200, 8192 x 256 scales 4.9 us against 7.8 for
    the byte copy, 16384 x 512 13.9 against 25.5 (benchmarks/results/swizzle_into_h200.md)."""
    M, K = linear.shape
    whole = M // 128 * 128
    words = _as_words(linear[:whole]) if K % 4 == 0 and out.is_contiguous() and whole else None
    if words is None:
        out.copy_(to_swizzled(linear).view(out.shape))
        return
    flat = out.view(-1)
    dst = _as_words(flat[:whole * K].view(whole, K))
    dst.view(whole // 128, K // 4, 32, 4).permute(0, 3, 2, 1).copy_(
        words.reshape(whole // 128, 4, 32, K // 4))
    if whole < M:
        flat[whole * K:].copy_(to_swizzled(linear[whole:]).view(-1))


def _as_words(t: Tensor) -> Optional[Tensor]:
    """The [rows, K] 1-byte tensor t (K % 4 == 0) as [rows, K / 4] int32 words, a view; None
    when t's offset or row stride does not fall on 4-byte words."""
    try:
        return t.view(torch.uint8).view(torch.int32)
    except RuntimeError:
        return None


def swizzled_offset(row, blk, k: int):
    """Offset of scale (row, blk) in the flat 128x4-swizzled layout of k blocks per row (the
    order of to_swizzled: row = m0*128 + m1*32 + m2, blk = b0*4 + b1 -> (m0, b0, m2, m1, b1)).
    Plain integer arithmetic (>>, &, *, +) so that the kernels run it on their run-time Int32
    values and the tests on Python ints or tensors: one formula for both."""
    kp4 = (k + 3) // 4
    return ((row >> 7) * kp4 + (blk >> 2)) * 512 + (row & 31) * 16 + ((row & 127) >> 5) * 4 + (blk & 3)


def swizzled_tile_words(k: int) -> int:
    """4-byte words in one 128-row tile of the swizzled layout of k blocks per row (k padded to 4)."""
    return (k + 3) // 4 * 128


def swizzled_word_row(w):
    """The row (0..127, within its 128-row tile) whose 4 scales (blocks 4b .. 4b + 3) fill 4-byte
    word w of the tile (word offset of swizzled_offset(row, 4b, k) less the tile's first word): a
    tile is kp4 = ceil(k / 4) runs of 128 words, word w % 128 of a run holding row
    (w % 4) * 32 + (w % 128) // 4. Integer arithmetic for Python ints, tensors and kernel Int32."""
    return ((w & 3) << 5) + ((w & 127) >> 2)


def from_swizzled(sw: Tensor, M: int, K: int) -> Tensor:
    """Inverse of to_swizzled: the [M, K] linear scales held by a swizzled [Mp, Kp] tensor."""
    Mp, Kp = round_up(M, 128), round_up(K, 4)
    if sw.numel() != Mp * Kp:
        raise ValueError(f"swizzled scales must hold {Mp}x{Kp} elements for M={M}, K={K}, "
                         f"got shape {tuple(sw.shape)}")
    t = sw.reshape(Mp // 128, Kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(Mp, Kp)
    return t[:M, :K]
