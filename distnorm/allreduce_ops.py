"""User-facing all-reduce ops: fused all-reduce + residual add + RMSNorm (+ quantization), and a plain
all-reduce, over a `distnorm.comm.Workspace` (peer-mapped buffers + signal pads).

    out = allreduce_add_rmsnorm(x, residual, weight, eps, workspace=ws, quant="fp8", scale=s)
    s = allreduce(x, workspace=ws)

Semantics: docs/SEMANTICS.md (ordered float32 sum over ranks 0..N-1, h = T(acc + float(res)), ...);
outputs are bitwise identical on every rank.

Dispatch:
- CUDA tensors and a workspace with peer mappings: the CuTe kernels of kernels/allreduce.py,
  "lamport", "oneshot" or "twoshot" (`algo="auto"` picks by bytes per rank and world size:
  lamport up to LAMPORT_CROSSOVER_BYTES when one lamport area holds all of M, then one-shot up to
  AUTO_CROSSOVER_BYTES, then two-shot). M is processed in chunks that fit the workspace's data
  buffer (max_chunk_rows; the buffer's last quarter is kept for lamport's three areas, the rest
  serves oneshot / twoshot, see kernels/lamport.py).
- lamport: the first lamport call on a workspace fills its areas with the sentinel (collective:
  every rank must make the same calls; not during CUDA-graph capture: make one call before). After a
  timeout, call `lamport_reset(ws)` on every rank (after `ws.reset_error()`).
- a workspace without peer mappings (`workspace.fallback_reason` set: multi-node, no P2P): all-gather
  of x through torch.distributed (NCCL), ordered float32 sum (bitwise the reference), then the
  single-GPU fused kernel (`distnorm.ops.add_rmsnorm`). One log line says why.
- CPU tensors: gloo all-gather + the reference.
Registered as the torch.library custom ops `distnorm::allreduce_add_rmsnorm_out` and
`distnorm::allreduce_out` (outputs passed in and mutated); eager calls skip the dispatcher.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import Tensor

from .formats import NormQuantOutput, QuantSpec
from .ops import (_DTYPE_NAMES, allocate_outputs, cached_spec, check_aligned, check_inputs,
                  check_rows, inputs_look_valid, kernel_views, scalar_looks_valid, spec_from_args,
                  spec_to_args, spec_to_user_args)

log = logging.getLogger(__name__)

ALGOS = ("auto", "lamport", "oneshot", "twoshot")
# Crossovers in bytes per rank (M * H * element size), by world size.
# World 2: measured on 2 x H200 (NV18), benchmarks/results/allreduce_fusion_h200_x2.md, command
#   torchrun --nproc-per-node 2 benchmarks/bench_allreduce_fusion.py --out benchmarks/results/allreduce_fusion_h200_x2
#   fused fp8: lamport 17.6 us vs two-shot 22.2 at 4 MiB (512 x 4096); two-shot 34.2 vs lamport 35.3
#   at 8 MiB (512 x 8192), 61.2 vs 75.1 at 16 MiB: lamport up to 4 MiB. Plain all-reduce (no
#   epilogue): lamport 30.6 vs two-shot 33.1 at 8 MiB, two-shot 57.6 vs 64.7 at 16 MiB: lamport up
#   to 8 MiB. One-shot never wins.
# World 4: measured on 4 x H200, benchmarks/results/allreduce_fusion_h200_x4.md (same command with
#   --nproc-per-node 4): fused fp8, lamport 17.9 us vs two-shot 19.1 at 1 MiB (128 x 4096); two-shot
#   25.1 vs lamport 33.4 at 2 MiB (128 x 8192): lamport up to 1 MiB; plain all-reduce likewise
#   (17.2 vs 17.9 at 1 MiB, 24.3 vs 33.1 at 2 MiB).
# World 8: NOT measured (8-GPU machines were not lent): half of world 4's, to be replaced.
LAMPORT_CROSSOVER_BYTES = {2: 4 << 20, 4: 1 << 20, 8: 512 << 10}
LAMPORT_CROSSOVER_BYTES_PLAIN = {2: 8 << 20, 4: 1 << 20, 8: 512 << 10}  # distnorm.allreduce
# Bytes per rank up to which the barrier one-shot beats two-shot when lamport does not apply
# (M beyond one lamport area): one-shot lost to lamport or two-shot at every measured size.
AUTO_CROSSOVER_BYTES = {2: 8 << 20, 4: 1 << 20, 8: 512 << 10}

# Launch settings that are not part of the semantics (benchmarks A/B them):
# pdl: launch with programmatic dependent launch (kernels/allreduce.py NOTE [programmatic dependent
#   launch]); DISTNORM_PDL=0 turns it off.
# rows_per_cta: {algo: rows per CTA}, 0 = choose_tiling's (kernels/compile_allreduce.py). One row
#   per CTA spreads small-M lamport / one-shot calls over twice the SMs at H=4096: fused fp8 lamport
#   on 2 x H200, M=8 / 32 / 128 x 4096: 4.15 / 4.81 / 7.18 us vs 4.66 / 5.20 / 8.02 with two rows
#   per CTA, equal elsewhere (benchmarks/results/allreduce_fusion_h200_x2.md, --tuning runs).
TUNING = {
    "pdl": os.environ.get("DISTNORM_PDL", "1") != "0",
    "rows_per_cta": {"lamport": 1, "oneshot": 1, "twoshot": 0},
}

_SM_COUNT: dict = {}
_GRID_CAP: dict = {}
_ERR_VIEWS: dict = {}
_LOGGED_FALLBACK: set = set()


def choose_algo(algo: str, world: int, m: int, hidden: int, elem_size: int,
                buffer_bytes: Optional[int] = None, plain: bool = False) -> str:
    """The algorithm for `algo` ("auto" picks by bytes per rank; lamport only when, given the
    workspace's buffer_bytes, one lamport call holds all M rows). plain: a plain all-reduce (no
    residual, norm or quantization output)."""
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if algo != "auto":
        return algo
    if world <= 1:
        return "oneshot"
    nbytes = m * hidden * elem_size
    table = LAMPORT_CROSSOVER_BYTES_PLAIN if plain else LAMPORT_CROSSOVER_BYTES
    lam = table.get(world, table[8])
    if nbytes <= lam and (buffer_bytes is None
                          or m <= _lamport_capacity(world, hidden, elem_size, buffer_bytes)):
        return "lamport"
    limit = AUTO_CROSSOVER_BYTES.get(world, AUTO_CROSSOVER_BYTES[8])
    return "oneshot" if nbytes <= limit else "twoshot"


def _lamport_capacity(world: int, hidden: int, elem_size: int, buffer_bytes: int) -> int:
    from .kernels.lamport import capacity_rows
    return capacity_rows(world, hidden, elem_size, buffer_bytes)


def max_chunk_rows(algo: str, world: int, m: int, hidden: int, elem_size: int, buffer_bytes: int,
                   swizzled: bool, gather_acc: bool) -> int:
    """Most rows one launch may take without overflowing its part of the data buffer (>= 1 or
    ValueError). buffer_bytes: the workspace's whole data buffer.

    The buffer is split (kernels/lamport.py, lamport_layout): oneshot / twoshot use the first
    `general` bytes, lamport three areas of `area` bytes after them. one-shot uses world * rows * H
    elements; lamport the same in one area; two-shot world * ceil(rows_p / world) * H per part
    (scatter, gather h, optionally gather acc), rows_p = rows padded to 128 for swizzled scales.
    Swizzled chunks after the first must start at multiples of 128 rows.
    """
    from .kernels.lamport import lamport_layout

    row_bytes = hidden * elem_size
    general, area = lamport_layout(buffer_bytes)
    if algo == "lamport":
        cap = area // (world * row_bytes)
        if swizzled and m > cap:
            cap = cap // 128 * 128
    elif algo == "oneshot":
        buffer_bytes = general
        cap = buffer_bytes // (world * row_bytes)
        if swizzled and m > cap:
            cap = cap // 128 * 128
    else:
        buffer_bytes = general
        cap = buffer_bytes // ((2 + (1 if gather_acc else 0)) * row_bytes) - (world - 1)
        if swizzled:
            cap = cap // 128 * 128
    if cap < 1:
        raise ValueError(f"workspace buffer of {general + 3 * area} bytes cannot hold one chunk of "
                         f"H={hidden} for {algo} on {world} ranks; create it with a larger buffer_bytes")
    return cap


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def _grid_cap(device: torch.device, hidden: int, qparams, rows_per_cta: int) -> int:
    """Most CTAs one all-reduce launch may have: all of them co-resident (kernels/allreduce.py)."""
    key = (device, hidden, qparams, rows_per_cta)
    n = _GRID_CAP.get(key)
    if n is None:
        from .kernels.compile_allreduce import allreduce_tiling, co_resident_ctas_per_sm
        tiling = allreduce_tiling(hidden, qparams, rows_per_cta)
        n = _GRID_CAP[key] = _sm_count(device) * co_resident_ctas_per_sm(tiling)
    return n


def _err_view(ws) -> Tensor:
    """The workspace's pinned error words as a device tensor (the kernels write it on timeout)."""
    key = id(ws)
    hit = _ERR_VIEWS.get(key)
    if hit is None or hit[0] is not ws:
        flag = ws.error_flag
        if flag.is_cuda:
            view = flag
        else:
            from .comm._views import tensor_from_ptr
            view = tensor_from_ptr(ws.error_flag_ptr, flag.numel() * 4, ws.device).view(torch.int32)
        hit = _ERR_VIEWS[key] = (ws, view)
    return hit[1]


_TIMEOUT: list = []
_REGIONS_OK: dict = {}


def _timeout_ns() -> int:
    """How long a CTA waits for its peers (sync.timeout_ns: DISTNORM_BARRIER_TIMEOUT_S, default 10 s)."""
    if not _TIMEOUT:
        from .kernels.sync import timeout_ns
        _TIMEOUT.append(int(timeout_ns()))
    return _TIMEOUT[0]


def _check_regions(ws) -> None:
    """Once per workspace: the signal pad holds the one-shot / two-shot barrier regions and lamport's
    state region."""
    if _REGIONS_OK.get(id(ws)) is ws:
        return
    from .kernels.allreduce import REGION
    from .kernels.sync import check_region, region_word
    for name, idx in REGION.items():
        if name != "lamport":  # lamport's state region is checked when it is first prepared
            check_region(ws, region_word(idx))  # (and the device error word)
    _REGIONS_OK[id(ws)] = ws


_LAMPORT: dict = {}


def _lamport_table(ws) -> Tensor:
    """Once per workspace: fill the lamport areas with the sentinel (collective, kernels/lamport.py
    reset) and build the area pointer table; then the cached table."""
    hit = _LAMPORT.get(id(ws))
    if hit is not None and hit[0] is ws:
        return hit[1]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("distnorm: the first lamport all-reduce on a workspace prepares its buffers "
                           "(collective, not capturable): make one call with algo='lamport' (or "
                           "call distnorm.allreduce_ops.lamport_reset(ws) on every rank) before "
                           "CUDA-graph capture")
    lamport_reset(ws)
    return _LAMPORT[id(ws)][1]


def lamport_reset(ws) -> None:
    """(Re)initialize the workspace's lamport state: sentinel-fill this rank's three areas, zero the
    call state, then a host barrier. Collective: call on every rank while no kernel of `ws` runs,
    e.g. after `ws.reset_error()` following a timeout (the areas may be half written then)."""
    from .kernels import lamport

    torch.cuda.synchronize(ws.device)
    lamport.reset(ws)
    _LAMPORT[id(ws)] = (ws, lamport.area_ptr_table(ws))


def _chunk(t: Optional[Tensor], a: int, b: int) -> Optional[Tensor]:
    return None if t is None else t[a:b]


def _scales_chunk(spec: Optional[QuantSpec], sv: Optional[Tensor], a: int, b: int, H: int):
    """Kernel view of the scale rows [a, b) (swizzled: chunks start at multiples of 128)."""
    if sv is None or spec is None:
        return sv
    if spec.kind == "fp8_per_group" and spec.scale_major == "col":
        return sv[a:b]  # strides (1, M): a row slice keeps the column stride
    if spec.block_scaled and spec.sf_layout == "swizzled":
        k = H // spec.group_size
        kp = (k + 3) // 4 * 4
        return sv[a * kp: ((b + 127) // 128 * 128) * kp]
    return sv[a:b]


def run_allreduce_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                         y_out, q_out, scales_out, ar_out, ws, algo: str) -> None:
    from .kernels.compile_allreduce import compiled_allreduce

    M, H = x.shape
    if M == 0:
        return
    world = ws.world_size
    plain = residual_out is None and y_out is None and q_out is None
    algo = choose_algo(algo, world, M, H, x.element_size(), ws.buffer_bytes, plain)
    qparams = cached_spec(*spec_to_user_args(spec))[1]
    if algo == "lamport" and qparams.swizzled and M > 1:
        cap = _lamport_capacity(world, H, x.element_size(), ws.buffer_bytes)
        if cap < M and cap < 128:
            # swizzled-scale chunks must start at multiples of 128 rows; a lamport area holds fewer
            algo = "oneshot"
    write_y = y_out is not None
    write_ar = ar_out is not None
    gather_acc = write_ar and residual is not None
    rpc = TUNING["rows_per_cta"].get(algo, 0)
    kernel = compiled_allreduce(algo, world, _DTYPE_NAMES[x.dtype], H, qparams, residual is not None,
                                gemma, write_y, write_ar, TUNING["pdl"], rpc)
    for name, t in (("x", x), ("residual", residual), ("residual_out", residual_out),
                    ("y_out", y_out), ("allreduce_out", ar_out)):
        if t is not None and (t.data_ptr() | (t.stride(0) * 2 if M > 1 else 0)) % 16:
            check_aligned(name, t)
    qv, sv = kernel_views(spec, q_out, scales_out)
    swizzled = qparams.swizzled
    step = max_chunk_rows(algo, world, M, H, x.element_size(), ws.buffer_bytes, swizzled, gather_acc)
    err = _err_view(ws)
    _check_regions(ws)
    ptrs = _lamport_table(ws) if algo == "lamport" else ws.buffer_ptrs
    ctas = _grid_cap(x.device, H, qparams, rpc)
    for a in range(0, M, step):
        b = min(M, a + step)
        kernel(x[a:b], _chunk(residual, a, b), _chunk(residual_out, a, b), weight, _chunk(y_out, a, b),
               _chunk(qv, a, b), _scales_chunk(spec, sv, a, b, H), scale, global_scale,
               _chunk(ar_out, a, b), ptrs, ws.signal_ptrs, err, ws.rank, ctas, float(eps),
               _timeout_ns())
    if not torch.cuda.is_current_stream_capturing():
        ws.raise_if_failed()  # reads pinned memory: cheap; an error shows after the kernel ran


# ---- fallback (no peer mappings) and CPU -----------------------------------------------------------

def gathered_sum(x: Tensor, group) -> Tensor:
    """Ordered float32 sum of every rank's x (all-gather, then acc = x0 + x1 + ...): bitwise the
    reference on every rank."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


def _copy_outputs(ref: NormQuantOutput, spec, residual_out, y_out, q_out, scales_out, ar_out):
    for out, val in ((residual_out, ref.residual), (y_out, ref.y), (q_out, ref.q), (ar_out, ref.allreduce)):
        if out is not None and val is not None:
            out.copy_(val)
    if scales_out is not None and spec is not None and spec.kind != "fp8":
        scales_out.copy_(ref.scales)


def run_fallback(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                 q_out, scales_out, ar_out, group, reason: Optional[str]) -> None:
    if reason and reason not in _LOGGED_FALLBACK:
        _LOGGED_FALLBACK.add(reason)
        log.warning("distnorm.allreduce_add_rmsnorm: using torch.distributed all-gather + single-GPU "
                    "kernel (%s)", reason)
    if x.shape[0] == 0:
        return
    acc = gathered_sum(x, group)
    if ar_out is not None:
        ar_out.copy_(acc.to(x.dtype))
    if not x.is_cuda:
        from .reference import _norm_quant
        ref = _norm_quant(acc, x.dtype, residual, weight, eps, spec, scale, global_scale, gemma,
                          y_out is not None, None)
        _copy_outputs(ref, spec, residual_out, y_out, q_out, scales_out, None)
        return
    from .ops import run_fused_norm_kernel

    if residual_out is None and y_out is None and q_out is None:
        return  # plain all-reduce
    if residual is not None:
        # h = T(acc + float(res)) with one rounding, then the fused kernel on (h, no residual)
        h = (acc + residual.float()).to(x.dtype)
        residual_out.copy_(h)
    else:
        h = acc.to(x.dtype)
    run_fused_norm_kernel(h, None, weight, eps, spec, scale, global_scale, gemma, None, y_out,
                          q_out, scales_out)


def _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out, q_out,
          scales_out, ar_out, ws, algo) -> None:
    if x.is_cuda and getattr(ws, "p2p_ok", False):
        run_allreduce_kernel(x, residual, weight, eps, spec, scale, global_scale, gemma,
                             residual_out, y_out, q_out, scales_out, ar_out, ws, algo)
    else:
        reason = getattr(ws, "fallback_reason", None)
        if x.is_cuda and reason is None:
            reason = "workspace is closed" if getattr(ws, "closed", False) else "no peer mappings"
        run_fallback(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out,
                     y_out, q_out, scales_out, ar_out, getattr(ws, "group", None),
                     reason if x.is_cuda else None)


# ---- torch.library registration -------------------------------------------------------------------
# The workspace cannot travel through a schema: it is registered in a table and passed by handle.
_WORKSPACES: dict = {}


def _handle(ws) -> int:
    h = id(ws)
    _WORKSPACES[h] = ws
    return h


@torch.library.custom_op("distnorm::allreduce_add_rmsnorm_out",
                         mutates_args=("residual_out", "y_out", "q_out", "scales_out", "allreduce_out"))
def _allreduce_add_rmsnorm_out(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                               kind: str, group_size: int, sf_layout: str, scale_major: str,
                               ue8m0: bool, scale: Optional[Tensor], global_scale: Optional[Tensor],
                               gemma: bool, residual_out: Optional[Tensor], y_out: Optional[Tensor],
                               q_out: Optional[Tensor], scales_out: Optional[Tensor],
                               allreduce_out: Optional[Tensor], workspace: int, algo: str) -> None:
    spec = spec_from_args(kind, group_size, sf_layout, scale_major, ue8m0)
    _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out, q_out,
          scales_out, allreduce_out, _WORKSPACES[workspace], algo)


@_allreduce_add_rmsnorm_out.register_fake
def _(x, residual, weight, eps, kind, group_size, sf_layout, scale_major, ue8m0, scale,
      global_scale, gemma, residual_out, y_out, q_out, scales_out, allreduce_out, workspace,
      algo) -> None:
    return None


def _check_workspace(ws, x: Tensor) -> None:
    if ws is None or not hasattr(ws, "world_size"):
        raise TypeError(f"workspace must be a distnorm Workspace, got {type(ws).__name__}")
    if getattr(ws, "closed", False):
        raise RuntimeError("workspace is closed")
    if x.is_cuda and getattr(ws, "p2p_ok", False) and x.device != ws.device:
        raise ValueError(f"x is on {x.device} but the workspace on {ws.device}")


def allreduce_add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6,
                          *, workspace, quant: Optional[str] = None, scale: Optional[Tensor] = None,
                          global_scale: Optional[Tensor] = None, group_size: int = 128,
                          sf_layout: str = "swizzled", scale_major: str = "row",
                          scale_ue8m0: bool = False, gemma: bool = False, norm_out: bool = False,
                          allreduce_out: bool = False, algo: str = "auto",
                          residual_out: Optional[Tensor] = None, y_out: Optional[Tensor] = None,
                          q_out: Optional[Tensor] = None, scales_out: Optional[Tensor] = None,
                          ) -> NormQuantOutput:
    """All-reduce of x over the workspace's group (ordered float32 sum), then [residual add] +
    RMSNorm [+ quantization], as distnorm.add_rmsnorm with x replaced by the sum.

    Every rank passes its own x [M, H] (same M, H, dtype, options on all ranks) and the same
    residual/weight. Returns NormQuantOutput(residual=h, y, q, scales, allreduce=T(acc) when
    allreduce_out). algo: "auto" | "lamport" | "oneshot" | "twoshot".
    """
    spec, _ = cached_spec(quant, group_size, sf_layout, scale_major, scale_ue8m0)
    kind = None if spec is None else spec.kind
    if (not inputs_look_valid(x, residual, weight, spec, eps)
            or (kind == "fp8" and not scalar_looks_valid(scale, x))
            or (kind == "nvfp4" and not scalar_looks_valid(global_scale, x))):
        check_inputs(x, residual, weight, spec, scale, global_scale, eps)
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    _check_workspace(workspace, x)
    want_y = norm_out or spec is None or y_out is not None
    residual_out, y_out, q_out, scales_out = allocate_outputs(
        x, spec, residual is not None, want_y, residual_out, y_out, q_out, scales_out)
    ar_out = torch.empty_like(x, memory_format=torch.contiguous_format) if allreduce_out else None
    if torch.compiler.is_compiling():
        _allreduce_add_rmsnorm_out(x, residual, weight, float(eps), *spec_to_args(spec), scale,
                                   global_scale, gemma, residual_out, y_out, q_out, scales_out,
                                   ar_out, _handle(workspace), algo)
    else:
        _impl(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
              q_out, scales_out, ar_out, workspace, algo)
    return NormQuantOutput(residual_out, y_out, q_out, scale if kind == "fp8" else scales_out, ar_out)


def allreduce(x: Tensor, *, workspace, algo: str = "auto", out: Optional[Tensor] = None) -> Tensor:
    """Plain all-reduce: T(ordered float32 sum of every rank's x), bitwise identical on all ranks.
    Runs the same kernels with no residual, no norm output and no quantization."""
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [M, H] tensor, got {getattr(x, 'shape', x)!r}")
    check_rows("x", x, None, x.shape)
    if x.shape[1] % 8 or not 256 <= x.shape[1] <= 32768:
        raise ValueError(f"H must be a multiple of 8 in [256, 32768], got {x.shape[1]}")
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    _check_workspace(workspace, x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_rows("out", out, x, x.shape)
    # weight is unused by the norm when nothing but the all-reduce output is written; the kernel
    # still takes one (a ones vector, cached per device/dtype/H)
    w = _ones(x)
    if torch.compiler.is_compiling():
        _allreduce_add_rmsnorm_out(x, None, w, 1e-6, *spec_to_args(None), None, None, False, None,
                                   None, None, None, out, _handle(workspace), algo)
    else:
        _impl(x, None, w, 1e-6, None, None, None, False, None, None, None, None, out, workspace, algo)
    return out


_ONES: dict = {}


def _ones(x: Tensor) -> Tensor:
    key = (x.device, x.dtype, x.shape[1])
    w = _ONES.get(key)
    if w is None:
        w = _ONES[key] = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    return w
