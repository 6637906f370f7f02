"""The plain-torch forms of RMSNorm and FP8 quantization that the fusion pass recognises (and that
the TP example uses for its unfused model). Write a model's norm and quantization like this and
`distnorm.fusion.allreduce_fusion_pass` swaps the all-reduce -> add -> norm -> quant chain for one
distnorm call. Shapes: x, h, y [..., H] bf16/fp16; weight [H].
"""
from __future__ import annotations

import torch
from torch import Tensor

from distnorm.formats import E4M3_MAX, PER_TOKEN_MIN_AMAX

__all__ = ["rms_norm_llama", "fp8_static_quant", "fp8_per_token_quant"]


def rms_norm_llama(h: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's hand-written RMSNorm: normalize in float32, cast to h's dtype, then multiply by the
    weight (two roundings; `torch.nn.functional.rms_norm` applies the weight before the cast)."""
    hf = h.float()
    var = hf.pow(2).mean(-1, keepdim=True)
    return (hf * torch.rsqrt(var + eps)).to(h.dtype) * weight


def fp8_static_quant(y: Tensor, scale: Tensor) -> Tensor:
    """Static FP8: e4m3(y / scale), saturating at +-448. scale: float32 [1]."""
    return (y.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_per_token_quant(y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token FP8: s = max(amax|y|, 1e-10) / 448 per row, q = e4m3(y / s). Returns (q, s) with
    s float32 [..., 1]."""
    yf = y.float()
    s = yf.abs().amax(-1, keepdim=True).clamp(min=PER_TOKEN_MIN_AMAX) / E4M3_MAX
    return (yf / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s
