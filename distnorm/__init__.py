"""distnorm: fused all-reduce + residual add + RMSNorm + FP8/NVFP4 quantization (CuTe DSL kernels)."""
from .formats import NormQuantOutput, QuantSpec, make_quant_spec
from .collectives import (all_gather, all_gather_scales, allreduce, allreduce_add_rmsnorm,
                          reduce_scatter_add_rmsnorm, shard_rows)
from .comm import Workspace
from .args import set_value_checks
from .ops import add_rmsnorm
from . import tp  # noqa: E402 (tensor-parallel modules; distnorm.fusion is imported on demand)

__all__ = ["NormQuantOutput", "QuantSpec", "Workspace", "add_rmsnorm", "allreduce", "allreduce_add_rmsnorm",
           "reduce_scatter_add_rmsnorm", "all_gather", "all_gather_scales", "shard_rows",
           "make_quant_spec", "set_value_checks", "tp"]
__version__ = "0.1.0"
