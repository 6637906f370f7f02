"""Inline-PTX scalar helpers for the norm-quant cores.

Only what CuTe DSL lacks (or spells differently between 4.3.5 and 4.8) lives here, written with
`llvm.inline_asm`, whose interface is the same in both versions. Each helper is exact where
docs/SEMANTICS.md needs exactness: correctly rounded reciprocal/division, NaN-propagating max,
saturating e4m3 conversion.
"""
from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def inline_asm(ret_type, args, text: str, constraints: str, side_effects: bool = False):
    """llvm.inline_asm in AT&T dialect (shared by ptx.py and sync.py)."""
    return llvm.inline_asm(
        ret_type,
        args,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def ir_f32(x, loc=None, ip=None):
    return Float32(x).ir_value(loc=loc, ip=ip)


def ir_i32(x, loc=None, ip=None):
    return Int32(x).ir_value(loc=loc, ip=ip)


def ir_i64(x, loc=None, ip=None):
    return Int64(x).ir_value(loc=loc, ip=ip)


def _f32_asm(text: str, constraints: str, *args) -> Float32:
    """A float32 result of side-effect-free inline PTX over IR operands."""
    return Float32(inline_asm(T.f32(), list(args), text, constraints))


def _i32_asm(text: str, constraints: str, *args) -> Int32:
    return Int32(inline_asm(T.i32(), list(args), text, constraints))


def _unary_f32(text: str, doc: str):
    """A float32 -> float32 primitive f(x) running `text` ($0 = result, $1 = x)."""
    @dsl_user_op
    def op(x, *, loc=None, ip=None) -> Float32:
        return _f32_asm(text, "=f,f", ir_f32(x, loc, ip))
    op.__doc__ = doc
    return op


def _binary_f32(text: str, doc: str):
    """A (float32, float32) -> float32 primitive f(a, b) running `text` ($0 = result)."""
    @dsl_user_op
    def op(a, b, *, loc=None, ip=None) -> Float32:
        return _f32_asm(text, "=f,f,f", ir_f32(a, loc, ip), ir_f32(b, loc, ip))
    op.__doc__ = doc
    return op


rcp_rn = _unary_f32("rcp.rn.f32 $0, $1;", "Correctly rounded 1/x (SEMANTICS.md `rcp`).")
rsqrt_rn = _unary_f32("{ .reg .f32 s; sqrt.rn.f32 s, $1; rcp.rn.f32 $0, s; }",
                      "1/sqrt(x) as sqrt.rn then rcp.rn: what torch computes on the CPU for float32.")
fabs = _unary_f32("abs.f32 $0, $1;", "|x|.")
e2m1_clamp = _unary_f32("{ .reg .f32 t; abs.f32 t, $1; max.f32 t, t, 0f00000000; min.f32 $0, t, 0f40C00000; }",
                        "|x| clamped to [0, 6], NaN -> 0 (max.f32 returns the operand that is not NaN).")
div_rn = _binary_f32("div.rn.f32 $0, $1, $2;", "Correctly rounded a / b.")
fmax_nan = _binary_f32("max.NaN.f32 $0, $1, $2;",
                       "max that returns NaN if either input is NaN (torch.amax semantics).")


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None) -> Int32:
    return _i32_asm("mov.b32 $0, $1;", "=r,f", ir_f32(x, loc, ip))


@dsl_user_op
def bits_f32(x, *, loc=None, ip=None) -> Float32:
    return _f32_asm("mov.b32 $0, $1;", "=f,r", ir_i32(x, loc, ip))


@dsl_user_op
def select_f32(pick_a, a, b, *, loc=None, ip=None) -> Float32:
    """a where the int32 pick_a is nonzero, else b."""
    return _f32_asm("{ .reg .pred p; setp.ne.s32 p, $1, 0; selp.f32 $0, $2, $3, p; }", "=f,r,f,f",
                    ir_i32(pick_a, loc, ip), ir_f32(a, loc, ip), ir_f32(b, loc, ip))


@dsl_user_op
def e4m3x2(hi, lo, *, loc=None, ip=None) -> Int32:
    """Two float32 -> two saturating e4m3 bytes in the low 16 bits (`lo` in the low byte)."""
    return _i32_asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $2; cvt.u32.u16 $0, t; }",
                    "=r,f,f", ir_f32(hi, loc, ip), ir_f32(lo, loc, ip))


@dsl_user_op
def nibble_signs(v, *, loc=None, ip=None) -> Int32:
    """The sign bits of eight float32 values v[0..7] at bits 4e + 3 of one word (the sign bit of
    each e2m1 nibble), everything else zero. Byte permutes gather each value's top byte; the odd
    elements' signs are then the bytes' top bits, the even ones' come from bytes of 0xFF / 0x00
    (prmt's sign-replicating selectors 8..F). 6 PRMT + 2 LOP3 for 8 values, where a shift and a
    mask per value took 16."""
    text = ("{ .reg .b32 t, u, o, e; "
            "prmt.b32 t, $2, $4, 0x73; prmt.b32 u, $6, $8, 0x73; prmt.b32 o, t, u, 0x5410; "
            "prmt.b32 t, $1, $3, 0x73; prmt.b32 u, $5, $7, 0x73; prmt.b32 e, t, u, 0xDC98; "
            "and.b32 o, o, 0x80808080; and.b32 e, e, 0x08080808; or.b32 $0, o, e; }")
    return _i32_asm(text, "=r" + ",f" * 8, *[ir_f32(x, loc, ip) for x in v])


@dsl_user_op
def add_x2(a, b, half: str, *, loc=None, ip=None) -> Int32:
    """Two packed 16-bit floats plus two, one correct rounding each (`half`: "bf16" or "f16").

    Equal to rounding float(a) + float(b) to the 16-bit type (the reference's one rounding): the
    float32 sum of two such values is exact unless their exponents are far apart, and then the
    smaller is far below half an ulp of the larger, so the float32 rounding cannot land on a
    16-bit midpoint (docs/SEMANTICS.md, "Sum, residual, norm")."""
    return _i32_asm(f"add.rn.{half}x2 $0, $1, $2;", "=r,r,r", ir_i32(a, loc, ip), ir_i32(b, loc, ip))


@dsl_user_op
def f16_to_f32(word, high: bool, *, loc=None, ip=None) -> Float32:
    """The float32 value of the low (high=False) or high fp16 half of a packed 32-bit word (exact)."""
    half = "h" if high else "l"
    return _f32_asm(f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; cvt.f32.f16 $0, {half}; }}", "=f,r",
                    ir_i32(word, loc, ip))


@dsl_user_op
def e4m3_to_f32(byte, *, loc=None, ip=None) -> Float32:
    """The float32 value of the e4m3 byte in the low 8 bits of `byte` (exact)."""
    return _f32_asm("{ .reg .b16 b; .reg .b32 h2; .reg .f16 h; cvt.u16.u32 b, $1; "
                    "cvt.rn.f16x2.e4m3x2 h2, b; mov.b32 {h, _}, h2; cvt.f32.f16 $0, h; }",
                    "=f,r", ir_i32(byte, loc, ip))


@dsl_user_op
def smem_ptr_u32(ptr, *, loc=None, ip=None) -> Int32:
    """Shared-memory address of a CuTe smem pointer, as a 32-bit integer for PTX."""
    return Int32(ptr.toint(loc=loc, ip=ip))


@dsl_user_op
def mbarrier_init_expect_tx(mbar_addr, tx_bytes, *, loc=None, ip=None) -> None:
    """Initialize the shared-memory mbarrier at `mbar_addr` (32-bit shared address) for one
    arrival and make that arrival at once, expecting `tx_bytes` of st.async data: its phase 0 then
    completes when the bytes have landed (NOTE [cluster exchange] in norm_quant.py)."""
    inline_asm(None, [ir_i32(mbar_addr, loc, ip), ir_i32(tx_bytes, loc, ip)],
               "{ .reg .b64 st; mbarrier.init.shared::cta.b64 [$0], 1; "
               "mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }",
               "r,r", side_effects=True)


@dsl_user_op
def fence_mbarrier_init_cluster(*, loc=None, ip=None) -> None:
    """Make this thread's mbarrier initializations visible to the cluster (before its arrive)."""
    inline_asm(None, [], "fence.mbarrier_init.release.cluster;", "", side_effects=True)


@dsl_user_op
def st_async_cluster_f32(local_smem_addr, local_mbar_addr, cta_rank, value, *, loc=None,
                         ip=None) -> None:
    """Store `value` at the same smem offset in CTA `cta_rank` of this cluster and count its 4
    bytes on that CTA's mbarrier at the same offset as ours (st.async: no fence, so no wait for
    this thread's earlier global stores)."""
    inline_asm(
        None,
        [ir_i32(local_smem_addr, loc, ip), ir_i32(local_mbar_addr, loc, ip),
         ir_i32(cta_rank, loc, ip), ir_f32(value, loc, ip)],
        "{ .reg .b32 a, b, v; mapa.shared::cluster.u32 a, $0, $2; mapa.shared::cluster.u32 b, $1, $2; "
        "mov.b32 v, $3; st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [a], v, [b]; }",
        "r,r,r,f",
        side_effects=True,
    )


@dsl_user_op
def mbarrier_try_wait(mbar_addr, parity, *, loc=None, ip=None) -> Int32:
    """1 once the phase of parity `parity` of the mbarrier at `mbar_addr` has completed, else 0
    (after a bounded hardware wait)."""
    return Int32(inline_asm(
        T.i32(), [ir_i32(mbar_addr, loc, ip), ir_i32(parity, loc, ip)],
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }",
        "=r,r,r", side_effects=True))
