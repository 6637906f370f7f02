"""[..., H] inputs for ops written on [M, H] rows: the leading dims are flattened into M as a view
(never a copy), the op runs on the rows, and its row outputs come back with x's leading shape.

Scales keep the format's documented shape for the flattened M (e.g. per-token [M, 1], swizzled
[round_up(M, 128), ...]): they are laid out by row index, and that is what GEMMs consume.
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from .formats import NormQuantOutput

__all__ = ["as_rows", "call_on_rows"]


def as_rows(name: str, t, lead: Optional[tuple] = None) -> Optional[Tensor]:
    """``t`` [*lead, K] viewed as [M, K] (M = prod(lead)) without a copy; None stays None.

    lead: the leading shape ``t`` must have (x's); None for x itself. Raises TypeError / ValueError
    naming ``name`` when t is not a tensor, has no last dim, has other leading dims, or its leading
    dims cannot be merged without a copy (then the message says to pass a contiguous tensor).
    """
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"{name} must be a [..., H] tensor, got a 0-d tensor")
    if lead is not None and tuple(t.shape[:-1]) != lead:
        raise ValueError(f"{name} must have leading shape {lead} (that of x) and its own last dim, "
                         f"got shape {tuple(t.shape)}")
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be "
                         f"viewed as [M, {t.shape[-1]}] rows without a copy; pass "
                         f"{name}.contiguous()") from None


def _back(t: Optional[Tensor], lead: tuple, given: Optional[Tensor]) -> Optional[Tensor]:
    if t is None:
        return None
    return given if given is not None else t.view(*lead, t.shape[-1])


def call_on_rows(op: Callable[..., NormQuantOutput], x: Tensor, residual: Optional[Tensor], *args,
                 residual_out: Optional[Tensor] = None, y_out: Optional[Tensor] = None,
                 q_out: Optional[Tensor] = None, **kwargs) -> NormQuantOutput:
    """Run the [M, H] norm-quant op `op` on [..., H] inputs (see the module docstring). Outputs
    passed in must have x's leading shape and are returned as passed."""
    rows = as_rows("x", x)
    lead = tuple(x.shape[:-1])
    out = op(rows, as_rows("residual", residual, lead), *args,
             residual_out=as_rows("residual_out", residual_out, lead),
             y_out=as_rows("y_out", y_out, lead), q_out=as_rows("q_out", q_out, lead), **kwargs)
    # the constructor, not out._replace: torch 2.11's Dynamo cannot return what _replace builds
    # under torch.compile(fullgraph=True) (an assertion in its side-effect codegen)
    return NormQuantOutput(_back(out.residual, lead, residual_out), _back(out.y, lead, y_out),
                           _back(out.q, lead, q_out), out.scales, _back(out.allreduce, lead, None))
