"""The op the fusion pass puts into compiled graphs: a functional (non-mutating) torch.library op
around distnorm.allreduce_add_rmsnorm, so it can sit anywhere in a post-grad graph.

    distnorm::fused_allreduce_add_rmsnorm(x, residual, weight, eps, quant, scale, norm_out,
                                          allreduce_out, workspace, algo)
        -> (h, y, q, scales, allreduce)

x, residual: [..., H] bf16/fp16; weight [H]; quant: QuantSpec code (None, "fp8" or
"fp8_per_token"); scale: static fp8's float32 [1]. Outputs not produced are empty tensors:
h without a residual, y unless norm_out (or no quant), q / scales without quant (static fp8 returns
no scales: the graph keeps using its own scale tensor), allreduce unless allreduce_out. Per-token
scales come as float32 [..., 1] (the shape amax(..., keepdim=True) gives).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from distnorm.collectives.ops import _workspace, allreduce_add_rmsnorm
from distnorm.formats import QuantSpec

__all__ = ["fused_allreduce_add_rmsnorm"]


def _shapes(x: Tensor, residual, quant: Optional[QuantSpec], norm_out: bool, allreduce_out: bool):
    """(shape, dtype) of the five outputs; () for an empty output."""
    lead = tuple(x.shape[:-1])
    return (
        (tuple(x.shape) if residual is not None else (0,), x.dtype),
        (tuple(x.shape) if norm_out or quant is None else (0,), x.dtype),
        (tuple(x.shape) if quant is not None else (0,), torch.float8_e4m3fn),
        (lead + (1,) if quant is not None and quant.kind == "fp8_per_token" else (0,), torch.float32),
        (tuple(x.shape) if allreduce_out else (0,), x.dtype),
    )


@torch.library.custom_op("distnorm::fused_allreduce_add_rmsnorm", mutates_args=())
def fused_allreduce_add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                                quant: str, scale: Optional[Tensor], norm_out: bool,
                                allreduce_out: bool, workspace: int, algo: str
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """allreduce_add_rmsnorm as a functional op: shapes and empty outputs in the module docstring;
    workspace: the id the fusion pass registered its Workspace under."""
    spec = QuantSpec.from_code(quant)
    out = allreduce_add_rmsnorm(x, residual, weight, eps, workspace=_workspace(workspace),
                                quant=spec, scale=scale, norm_out=norm_out,
                                allreduce_out=allreduce_out, algo=algo)
    got = (out.residual, out.y, out.q,
           out.scales if spec is not None and spec.kind == "fp8_per_token" else None, out.allreduce)
    result = []
    for t, (shape, dtype) in zip(got, _shapes(x, residual, spec, norm_out, allreduce_out)):
        result.append(x.new_empty(shape, dtype=dtype) if t is None else t.view(shape))
    return tuple(result)


@fused_allreduce_add_rmsnorm.register_fake
def _(x, residual, weight, eps, quant, scale, norm_out, allreduce_out, workspace, algo):
    spec = QuantSpec.from_code(quant)
    return tuple(x.new_empty(shape, dtype=dtype)
                 for shape, dtype in _shapes(x, residual, spec, norm_out, allreduce_out))
