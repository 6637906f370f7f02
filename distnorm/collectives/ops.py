"""User-facing all-reduce ops over a `distnorm.comm.Workspace`: fused all-reduce + residual add +
RMSNorm (+ quantization), and a plain all-reduce.

    out = allreduce_add_rmsnorm(x, residual, weight, eps, workspace=ws, quant="fp8", scale=s)
    s = allreduce(x, workspace=ws)

This module checks arguments and allocates outputs; collectives/dispatch.py runs the call
(plan.py picks the algorithm and the rows per launch; state.py keeps the workspace's state).
Both are the torch.library custom op `distnorm::allreduce_add_rmsnorm_out` (outputs passed in and
mutated) under torch.compile; eager calls skip the dispatcher.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from distnorm.args import (allocate_outputs, check_op_inputs, check_rows, check_values,
                           check_flags, check_outputs_apart, checked_mode,
                           returned_scales)
from distnorm.collectives import dispatch
from distnorm.collectives.faults import raise_if_failed
from distnorm.collectives.plan import check_algo
from distnorm.collectives.state import state_of
from distnorm.comm.workspace import Workspace
from distnorm.formats import (MAX_HIDDEN, MIN_HIDDEN, VEC, NormQuantOutput, QuantSpec,
                              make_quant_spec, spec_code)
from distnorm.rows import as_rows, call_on_rows

__all__ = ["allreduce_add_rmsnorm", "allreduce", "reset", "check"]

def _handle(ws: Workspace) -> int:
    """The number compiled graphs carry for `ws` (NOTE [workspace handle] in comm/workspace.py): an
    attribute read, which torch.compile traces as a guarded constant."""
    return ws.handle


def _workspace(handle: int) -> Workspace:
    ws = Workspace.from_handle(handle)
    if ws is None:
        raise RuntimeError(f"distnorm: the workspace this graph was compiled with (handle {handle}) "
                           "no longer exists")
    return ws


@torch.library.custom_op("distnorm::allreduce_add_rmsnorm_out",
                         mutates_args=("residual_out", "y_out", "q_out", "scales_out", "allreduce_out"))
def _allreduce_add_rmsnorm_out(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                               quant: str, scale: Optional[Tensor], global_scale: Optional[Tensor],
                               gemma: bool, residual_out: Optional[Tensor], y_out: Optional[Tensor],
                               q_out: Optional[Tensor], scales_out: Optional[Tensor],
                               allreduce_out: Optional[Tensor], workspace: int, algo: str) -> None:
    dispatch.run(x, residual, weight, eps, QuantSpec.from_code(quant), scale, global_scale, gemma,
                 residual_out, y_out, q_out, scales_out, allreduce_out, _workspace(workspace), algo)


@_allreduce_add_rmsnorm_out.register_fake
def _(x, residual, weight, eps, quant, scale, global_scale, gemma, residual_out, y_out, q_out,
      scales_out, allreduce_out, workspace, algo) -> None:
    return None


def _eager_cuda(x: Tensor, ws) -> bool:
    """An eager call on CUDA tensors over a workspace with peer mappings, outside checked mode: it
    may take dispatch.launch_eager."""
    return (x.is_cuda and isinstance(ws, Workspace) and ws.p2p_ok and not checked_mode()
            and not torch.compiler.is_compiling())


def _check_call(ws, x: Tensor, algo: str) -> None:
    check_algo(algo)
    if not isinstance(ws, Workspace):
        raise TypeError(f"workspace must be a distnorm.Workspace, got {type(ws).__name__}")
    if ws.closed:
        raise RuntimeError("workspace is closed")
    if x.is_cuda and ws.p2p_ok and x.device != ws.device:
        raise ValueError(f"x is on {x.device} but the workspace on {ws.device}")


def allreduce_add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6,
                          *, workspace: Workspace, quant: Optional[str] = None,
                          scale: Optional[Tensor] = None, global_scale: Optional[Tensor] = None,
                          group_size: int = 128, sf_layout: str = "swizzled",
                          scale_major: str = "row", scale_ue8m0: bool = False, gemma: bool = False,
                          norm_out: bool = False, allreduce_out: bool = False, algo: str = "auto",
                          residual_out: Optional[Tensor] = None, y_out: Optional[Tensor] = None,
                          q_out: Optional[Tensor] = None, scales_out: Optional[Tensor] = None,
                          ) -> NormQuantOutput:
    """All-reduce of x over the workspace's group (ordered float32 sum), then [residual add] +
    RMSNorm [+ quantization], as distnorm.add_rmsnorm with x replaced by the sum.

    Every rank passes its own x [..., H] (same shape, dtype, options on all ranks; leading dims are
    flattened into M rows as a view) and the same residual/weight. Returns NormQuantOutput(
    residual=h, y, q, scales, allreduce=T(acc) when allreduce_out), row outputs with x's leading
    shape. algo: "auto" | "lamport" | "oneshot" | "twoshot".
    """
    if not isinstance(x, Tensor) or x.dim() != 2:  # subclasses (Parameter) too
        return call_on_rows(allreduce_add_rmsnorm, x, residual, weight, eps, workspace=workspace,
                            quant=quant, scale=scale, global_scale=global_scale,
                            group_size=group_size, sf_layout=sf_layout, scale_major=scale_major,
                            scale_ue8m0=scale_ue8m0, gemma=gemma, norm_out=norm_out,
                            allreduce_out=allreduce_out, algo=algo, residual_out=residual_out,
                            y_out=y_out, q_out=q_out, scales_out=scales_out)
    if type(gemma) is not bool or type(norm_out) is not bool or type(allreduce_out) is not bool:
        check_flags(gemma=gemma, norm_out=norm_out, allreduce_out=allreduce_out)
    spec = make_quant_spec(quant, group_size=group_size, sf_layout=sf_layout,
                           scale_major=scale_major, scale_ue8m0=scale_ue8m0)
    want_y = norm_out or spec is None or y_out is not None
    ar_out = None
    if _eager_cuda(x, workspace):
        # the argument checks left to the kernel's entry (dispatch.launch_eager); outputs it
        # allocated stay allocated for the checked path if it declines
        try:
            residual_out, y_out, q_out, scales_out = allocate_outputs(
                x, spec, residual is not None, want_y, residual_out, y_out, q_out, scales_out,
                check_given=False)
        except Exception:  # noqa: BLE001 - the checked path says what was wrong
            pass
        else:
            if allreduce_out:
                ar_out = torch.empty_like(x, memory_format=torch.contiguous_format)
            if dispatch.launch_eager(x, residual, weight, eps, spec, scale, global_scale, gemma,
                                     residual_out, y_out, q_out, scales_out, ar_out, workspace,
                                     algo):
                # tuple.__new__: the NamedTuple's own __new__ is a Python function (host time)
                return tuple.__new__(NormQuantOutput, (
                    residual_out, y_out, q_out, returned_scales(spec, scale, scales_out), ar_out))
    check_op_inputs(x, residual, weight, spec, scale, global_scale, eps)
    _check_call(workspace, x, algo)
    check_outputs_apart({"x": x, "residual": residual}, {
        "residual_out": residual_out, "y_out": y_out, "q_out": q_out, "scales_out": scales_out})
    residual_out, y_out, q_out, scales_out = allocate_outputs(
        x, spec, residual is not None, want_y, residual_out, y_out, q_out, scales_out)
    if allreduce_out and ar_out is None:
        ar_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if torch.compiler.is_compiling():
        _allreduce_add_rmsnorm_out(x, residual, weight, float(eps), spec_code(spec), scale,
                                   global_scale, gemma, residual_out, y_out, q_out, scales_out,
                                   ar_out, _handle(workspace), algo)
    else:
        dispatch.run(x, residual, weight, eps, spec, scale, global_scale, gemma, residual_out, y_out,
                     q_out, scales_out, ar_out, workspace, algo)
    return NormQuantOutput(residual_out, y_out, q_out, returned_scales(spec, scale, scales_out),
                           ar_out)


def allreduce(x: Tensor, *, workspace: Workspace, algo: str = "auto",
              out: Optional[Tensor] = None) -> Tensor:
    """Plain all-reduce: T(ordered float32 sum of every rank's x), bitwise identical on all ranks.
    x: [..., H] bf16/fp16 (out, when given, of x's shape). Runs the same kernels with no residual,
    no norm output and no quantization."""
    if not isinstance(x, Tensor) or x.dim() != 2:  # subclasses (Parameter) too
        result = allreduce(as_rows("x", x), workspace=workspace, algo=algo,
                           out=as_rows("out", out, tuple(x.shape[:-1])))
        return out if out is not None else result.view(x.shape)
    if _eager_cuda(x, workspace):  # the argument checks left to the kernel's entry
        if out is None:  # kept for the checked path if launch_eager declines
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if dispatch.launch_eager(x, None, state_of(workspace).ones(x), 1e-6, None, None, None,
                                 False, None, None, None, None, out, workspace, algo):
            return out
    check_rows("x", x, None, x.shape)
    if x.shape[1] % VEC or not MIN_HIDDEN <= x.shape[1] <= MAX_HIDDEN:
        raise ValueError(f"x's last dim H must be a multiple of {VEC} in [{MIN_HIDDEN}, "
                         f"{MAX_HIDDEN}], got {x.shape[1]}")
    _check_call(workspace, x, algo)
    check_values(x, None, None, None, None, None)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_rows("out", out, x, x.shape)
        check_outputs_apart({"x": x}, {"out": out})
    # the kernel takes a weight even when nothing but the all-reduce output is written
    w = state_of(workspace).ones(x)
    if torch.compiler.is_compiling():
        _allreduce_add_rmsnorm_out(x, None, w, 1e-6, spec_code(None), None, None, False, None,
                                   None, None, None, out, _handle(workspace), algo)
    else:
        dispatch.run(x, None, w, 1e-6, None, None, None, False, None, None, None, None, out,
                     workspace, algo)
    return out


def reset(workspace: Workspace) -> None:
    """Make a workspace usable again after a CommError (timeout or mismatch): clear its error
    words, zero its barrier regions and refill its lamport areas. Collective: call on every rank,
    while no kernel of the workspace runs anywhere (synchronize first); it waits for the other
    ranks at most DISTNORM_HOST_TIMEOUT_S."""
    if workspace.p2p_ok and not workspace.closed:
        torch.cuda.synchronize(workspace.device)
        state_of(workspace).reset(workspace)
    else:
        workspace.reset_error()


def check(workspace: Workspace) -> None:
    """Raise the CommError a kernel of `workspace` recorded (CommTimeoutError, CommMismatchError),
    if any. Errors are recorded when the kernel runs: synchronize first to include the last call's.
    Checked mode (DISTNORM_CHECK=1) does this after every call."""
    raise_if_failed(workspace)
