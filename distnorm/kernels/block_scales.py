"""Block and row scales of the norm-quant cores (a mixin of NormQuantCore, kernels/norm_quant.py).

The scale of a block (or row) from its amax, in each format's arithmetic of docs/SEMANTICS.md, and
how a block's lanes share that work (NOTE [one scale per lane]). Uses the core's `t` (RowTiling),
`q` (QuantSpec) and `split`.
"""
from __future__ import annotations

import numpy as np

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from distnorm.formats import E2M1_MAX, E4M3_MAX, PER_TOKEN_MIN_AMAX, VEC
from distnorm.kernels import ptx


def pairwise(op, vals: list):
    """op over vals as a balanced tree (trace time): (v0 op v1) op (v2 op v3), ... -- a chain of
    log2(len) instead of len - 1 dependent operations."""
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i]
                for i in range(0, len(vals), 2)]
    return vals[0]


# NOTE [one scale per lane]: at most this many vectors per scale group. Measured on H200
# (benchmarks/results/scale_group_ab_h200.md): 2 is never slower than computing every scale on
# every lane; 4 and 8 gain 1-2% more for per-group FP8 at H = 32768 and lose 7% at 1024 x 4096
# (each lane then waits on one longer chain: more vectors' amaxes, then their one scale).
MAX_SCALE_GROUP = 2
RCP_E2M1_MAX = float(np.float32(1.0) / np.float32(E2M1_MAX))  # = rcp.rn(6.0), folded at trace time


class BlockScales:
    """Scale arithmetic and the lanes' share of it; mixed into NormQuantCore."""

    @cute.jit
    def _block_scale(self, amax: Float32, global_scale: Float32, rcp_global_scale: Float32):
        """(stored scale value, multiplier applied to y) for one block or row.
        rcp_global_scale: rcp_rn(global_scale), computed once per row by the caller (NVFP4)."""
        kind = self.q.kind
        stored = Float32(0.0)
        inv = Float32(0.0)
        if const_expr(self.q.float_scales):
            s = ptx.div_rn(ptx.fmax_nan(amax, Float32(PER_TOKEN_MIN_AMAX)), Float32(E4M3_MAX))
            if const_expr(self.q.scale_ue8m0):
                b = ptx.f32_bits(s)
                e = (b >> 23) + Int32((b & 0x7FFFFF) != 0)
                s = ptx.bits_f32(e << 23)
            stored = s
            inv = ptx.rcp_rn(s)
        elif const_expr(kind == "nvfp4"):
            sf = ptx.e4m3x2(Float32(0.0), global_scale * (amax * Float32(RCP_E2M1_MAX))) & 0xFF
            sf_f = ptx.e4m3_to_f32(sf)
            stored = Float32(sf)  # carried as a number, stored as a byte
            # a select, not a branch: 1/0 is inf and is discarded
            inv = ptx.rcp_rn(sf_f * rcp_global_scale)
            if sf_f == Float32(0.0):
                inv = Float32(0.0)
        else:  # mxfp8 / mxfp4
            code = self._ue8m0_of_quotient(amax)
            stored = Float32(code)
            # 2^(127 - code): normal for code <= 253, subnormal 2^-127 for 254, NaN for 255
            inv_bits = (254 - code) << 23
            if code == 254:
                inv_bits = Int32(1 << 22)
            if code == 255:
                inv_bits = Int32(0x7FC00000)
            inv = ptx.bits_f32(inv_bits)
        return stored, inv

    @cute.jit
    def _ue8m0_of_quotient(self, amax: Float32) -> Int32:
        """formats.ue8m0_code(RN(amax / elem_max)) for amax >= 0 or NaN, without the division.

        With elem_max = (1 + T / 2^23) * 2^S (e4m3: 1.75 * 2^8, e2m1: 1.5 * 2^2) and 2^k a normal
        float, RN(amax / elem_max) <= 2^k exactly when amax <= elem_max * 2^k (no float lies
        between elem_max * 2^k and the real bound elem_max * 2^k * (1 + 2^-24), and the tie rounds
        to 2^k's even mantissa). So for a normal quotient the code, the smallest such k biased, is
        amax's exponent field - S, + 1 when amax's mantissa exceeds T: one add carries that into
        the exponent. A subnormal quotient's code is 1, a zero one's 0 (amax <= elem_max * 2^-150,
        i.e. amax's bits <= elem_max / 2), inf / NaN's 255. tests/test_kernel_arithmetic.py checks
        this against the division for amax around every threshold and exponent."""
        e_bits = int(np.float32(self.q.elem_max).view(np.int32))
        shift = (e_bits >> 23) - 127
        b = ptx.f32_bits(amax)
        code = ((b + (0x7FFFFF - (e_bits & 0x7FFFFF))) >> 23) - shift
        if code < 1:
            code = Int32(1)  # a subnormal quotient (a zero one is caught next)
        if b <= int(self.q.elem_max) // 2:
            code = Int32(0)
        if b >= 0x7F800000:
            code = Int32(255)
        return code

    # NOTE [one scale per lane]
    # A block's `lanes` lanes all need its scale, and the scale's arithmetic (a correctly rounded
    # division and reciprocal for per-group FP8, the e4m3 round trip and reciprocal for NVFP4, the
    # UE8M0 code for MX) costs more than quantizing a vector. A lane holds `vecs_per_thread`
    # vectors, each in another block, so a block's lanes share `group` blocks: lane l computes
    # only the scale of vector j0 + l % group, from that block's amax (the vectors' own amaxes
    # reduced and scattered over the lanes by recursive halving, then reduced over the lanes
    # holding the same vector), and reads the other vectors' multipliers from the lanes that
    # computed them. The same max and the same scale arithmetic on the same values: the bits do not
    # change. A split part shares the scales of its compact columns the same way (NOTE [compact
    # parts] in norm_quant.py).
    def _scale_group(self, lanes: int, columns: int) -> int:
        """Vectors whose block scales a block's lanes compute one each (NOTE [one scale per
        lane]): the largest power of two <= min(lanes, MAX_SCALE_GROUP) dividing `columns`, the
        thread's vectors (a split part's compact columns: NOTE [compact parts] in split_parts.py)."""
        group = 1
        while group * 2 <= min(lanes, MAX_SCALE_GROUP) and columns % (group * 2) == 0:
            group *= 2
        return group

    def _block_amax(self, rY, j0: int, group: int, lanes: int, lane: Int32) -> Float32:
        """The amax of the block of vector j0 + lane % group (trace-time loops; lanes <= 32, so a
        block never leaves its warp)."""
        # a tree over the vector's 8 values (NOTE [short chains] in norm_quant.py)
        vals = [pairwise(ptx.fmax_nan, [ptx.fabs(rY[(j0 + k) * VEC + e]) for e in range(VEC)])
                for k in range(group)]
        o = group // 2
        while o > 0:  # recursive halving: keep the half of the vectors whose bit o is lane's
            upper = lane & o
            kept = []
            for i in range(o):
                send = ptx.select_f32(upper, vals[i], vals[i + o])
                keep = ptx.select_f32(upper, vals[i + o], vals[i])
                kept.append(ptx.fmax_nan(keep, cute.arch.shuffle_sync_bfly(
                    send, offset=o, mask=-1, mask_and_clamp=31)))
            vals = kept
            o //= 2
        amax = vals[0]
        o = group
        while o < lanes:  # the lanes holding the same vector
            amax = ptx.fmax_nan(amax, cute.arch.shuffle_sync_bfly(
                amax, offset=o, mask=-1, mask_and_clamp=31))
            o *= 2
        return amax

    def _lane_value(self, value: Float32, k: int, group: int, lane: Int32) -> Float32:
        """`value` of the lane of this lane's aligned group of `group` lanes whose index in it is k
        (the multiplier of vector j0 + k); the lane itself when group is 1."""
        if group == 1:
            return value
        return cute.arch.shuffle_sync(value, offset=(lane & ~(group - 1)) + k, mask=-1,
                                      mask_and_clamp=31)
