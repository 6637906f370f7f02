"""Tensor-parallel building blocks around the fused op: what a TP model uses instead of wiring
all-reduce, add, RMSNorm and quantization by hand.

    norm = distnorm.tp.AllReduceAddRMSNorm(4096, ws, quant="fp8_per_token")
    down = distnorm.tp.RowParallelLinear(14336 // tp, 4096, norm)      # GEMM + fused epilogue
    out = down(act_shard, residual)          # out.residual: new residual, out.q / out.scales
    up = distnorm.tp.fp8_linear(out.q, out.scales, w_up_fp8, w_up_scale)   # next FP8 GEMM

Sequence parallel (the residual sharded by rows, `distnorm.shard_rows`): the same with
ReduceScatterAddRMSNorm, whose forward takes this rank's residual rows and returns its new
residual rows with the normed / quantized output of every row, for the next column-parallel GEMM.

Everything works eagerly, inside CUDA graphs and under torch.compile(fullgraph=True) (the ops are
torch.library custom ops). Shapes: activations [..., H] bf16/fp16; the quantized output q has x's
shape (float8_e4m3fn); per-token scales are float32 [M, 1] for the flattened M rows, static FP8
returns the module's scale tensor [1].
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from distnorm.args import check_count, check_eps, check_flags
from distnorm.collectives.ops import allreduce_add_rmsnorm
from distnorm.collectives.plan import check_algo
from distnorm.collectives.seqpar import reduce_scatter_add_rmsnorm
from distnorm.comm.workspace import Workspace
from distnorm.formats import E4M3_MAX, NormQuantOutput, check_hidden, make_quant_spec

__all__ = ["AllReduceAddRMSNorm", "ReduceScatterAddRMSNorm", "RowParallelLinear", "fp8_linear",
           "quantize_weight_fp8"]

_TP_QUANTS = (None, "fp8", "fp8_per_token")


class _GroupNorm(nn.Module):
    """What both norms hold: H, eps, the format (None, static FP8 with its scale buffer, per-token
    FP8), norm_out, gemma, the workspace and the RMSNorm weight [H] (ones until loaded)."""

    def __init__(self, hidden: int, workspace: Workspace, eps: float, quant: Optional[str],
                 scale: Optional[float], norm_out: bool, dtype: torch.dtype, device,
                 gemma: bool) -> None:
        super().__init__()
        if quant not in _TP_QUANTS:
            raise ValueError(f"quant must be one of {_TP_QUANTS}, got {quant!r}")
        check_count("hidden", hidden, 1)
        check_hidden(make_quant_spec(quant), hidden)
        check_eps(eps)
        if (quant == "fp8") != (scale is not None):
            raise ValueError("scale (a float > 0) is required for quant='fp8' and only for it")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not 0 < scale < math.inf):
            raise ValueError(f"scale must be a finite float > 0, got {scale!r}")
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a distnorm.Workspace, got {type(workspace).__name__}")
        check_flags(norm_out=norm_out, gemma=gemma)
        device = workspace.device if device is None else device
        self.hidden, self.eps, self.quant, self.norm_out = hidden, float(eps), quant, norm_out
        self.gemma, self.workspace = gemma, workspace
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.register_buffer("scale", None if scale is None else
                             torch.tensor([float(scale)], dtype=torch.float32, device=device))


class AllReduceAddRMSNorm(_GroupNorm):
    """All-reduce of a row-parallel partial output + residual add + RMSNorm [+ FP8 quantization].

    hidden: H. workspace: the TP group's distnorm.Workspace. quant: None (bf16/fp16 y), "fp8"
    (static: `scale`, a float, becomes the float32 [1] buffer `scale`) or "fp8_per_token".
    norm_out: also return y when quantizing. algo: the all-reduce algorithm ("auto").
    forward(partial [..., H], residual [..., H] or None) -> NormQuantOutput(residual=h, y, q,
    scales); h is the new residual (written into a new tensor; pass residual_out= to the op
    directly to update in place).
    """

    def __init__(self, hidden: int, workspace: Workspace, eps: float = 1e-6, *,
                 quant: Optional[str] = None, scale: Optional[float] = None,
                 norm_out: bool = False, algo: str = "auto", dtype: torch.dtype = torch.bfloat16,
                 device=None, gemma: bool = False) -> None:
        check_algo(algo)  # here, not at the first forward
        super().__init__(hidden, workspace, eps, quant, scale, norm_out, dtype, device, gemma)
        self.algo = algo

    def forward(self, partial: Tensor, residual: Optional[Tensor]) -> NormQuantOutput:
        return allreduce_add_rmsnorm(partial, residual, self.weight, self.eps,
                                     workspace=self.workspace, quant=self.quant, scale=self.scale,
                                     norm_out=self.norm_out, gemma=self.gemma, algo=self.algo)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, quant={self.quant}, algo={self.algo}"


class ReduceScatterAddRMSNorm(_GroupNorm):
    """Sequence-parallel AllReduceAddRMSNorm: reduce-scatter of a row-parallel partial output, the
    residual add + RMSNorm [+ FP8] of this rank's rows only, and (gather=True, the default) the
    normed / quantized rows of every rank gathered for the next column-parallel GEMM. Bitwise the
    rows AllReduceAddRMSNorm gives for the same inputs (distnorm.reduce_scatter_add_rmsnorm).

    forward(partial [..., H] (every row: this rank's partial sums of all M = prod(...) rows),
    residual [M_r, H] (this rank's rows, distnorm.shard_rows(M, workspace)) or None) ->
    NormQuantOutput(residual = new residual rows [M_r, H], y / q with partial's shape (every row;
    gather=False: the rank's rows [M_r, H]), scales: per-token float32 [M, 1] (gather=False:
    [M_r, 1]) or the static scale [1]).
    """

    def __init__(self, hidden: int, workspace: Workspace, eps: float = 1e-6, *,
                 quant: Optional[str] = None, scale: Optional[float] = None,
                 norm_out: bool = False, gather: bool = True,
                 dtype: torch.dtype = torch.bfloat16, device=None, gemma: bool = False) -> None:
        check_flags(gather=gather)
        super().__init__(hidden, workspace, eps, quant, scale, norm_out, dtype, device, gemma)
        self.gather = gather

    def forward(self, partial: Tensor, residual: Optional[Tensor]) -> NormQuantOutput:
        out = reduce_scatter_add_rmsnorm(partial, residual, self.weight, self.eps,
                                         workspace=self.workspace, quant=self.quant,
                                         scale=self.scale, norm_out=self.norm_out,
                                         gemma=self.gemma, gather=self.gather)
        if not self.gather:
            return out
        lead = partial.shape[:-1]  # the gathered rows in partial's leading shape
        # a new tuple, not _replace: Dynamo (torch 2.11, fullgraph) refused NamedTuple._replace
        return NormQuantOutput(out.residual,
                               None if out.y is None else out.y.view(*lead, out.y.shape[-1]),
                               None if out.q is None else out.q.view(*lead, out.q.shape[-1]),
                               out.scales, None)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, quant={self.quant}, gather={self.gather}"


class RowParallelLinear(nn.Module):
    """A row-parallel linear layer whose epilogue is `norm` (an AllReduceAddRMSNorm).

    in_features: this rank's shard of the input features; out_features: H. weight [H, in] of the
    norm's dtype. forward(x_shard [..., in], residual [..., H]) -> the norm's NormQuantOutput over
    the group's sum of x_shard @ weight.T.
    """

    def __init__(self, in_features: int, out_features: int, norm: AllReduceAddRMSNorm,
                 dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        if norm.hidden != out_features:
            raise ValueError(f"norm.hidden ({norm.hidden}) must equal out_features ({out_features})")
        device = norm.weight.device if device is None else device
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=in_features ** -0.5)
        self.norm = norm

    def forward(self, x: Tensor, residual: Optional[Tensor]) -> NormQuantOutput:
        return self.norm(nn.functional.linear(x, self.weight), residual)


def quantize_weight_fp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor FP8 of a linear weight [N, K]: (w_t, scale) with w_t float8_e4m3fn [K, N]
    column-major (the layout torch._scaled_mm reads as its second operand) and scale float32 [1]
    (weight ~= w_t.T * scale)."""
    from distnorm.fusion.forms import fp8_static_quant  # (distnorm.fusion imports Inductor)

    s = (weight.float().abs().amax() / E4M3_MAX).clamp(min=1e-12).reshape(1)
    return fp8_static_quant(weight, s).t(), s


def fp8_linear(q: Tensor, scales: Tensor, w_t: Tensor, w_scale: Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """q [..., K] float8_e4m3fn (a distnorm output) times an FP8 weight (quantize_weight_fp8):
    [..., N] out_dtype. scales: the op's scales, float32 [1] (static) or [M, 1] (per token)."""
    lead = q.shape[:-1]
    q2 = q.reshape(-1, q.shape[-1])
    n = w_t.shape[1]
    if scales.numel() == 1:
        out = torch._scaled_mm(q2, w_t, scale_a=scales.reshape(()), scale_b=w_scale.reshape(()),
                               out_dtype=out_dtype)
    else:  # row-wise: [M, 1] activations x [1, N] weight
        out = torch._scaled_mm(q2, w_t, scale_a=scales.reshape(-1, 1),
                               scale_b=w_scale.reshape(1, 1).expand(1, n).contiguous(),
                               out_dtype=out_dtype)
    return out.reshape(*lead, n)
