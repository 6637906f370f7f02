"""distnorm: fused all-reduce + residual add + RMSNorm + FP8/NVFP4 quantization (CuTe DSL kernels)."""
from .formats import NormQuantOutput, QuantSpec, make_quant_spec
from .collectives import allreduce, allreduce_add_rmsnorm
from .comm import Workspace
from .args import set_value_checks
from .ops import add_rmsnorm
from . import tp  # noqa: E402 (tensor-parallel modules; distnorm.fusion is imported on demand)

__all__ = ["NormQuantOutput", "QuantSpec", "Workspace", "add_rmsnorm", "allreduce", "allreduce_add_rmsnorm",
           "make_quant_spec", "set_value_checks"]
__version__ = "0.1.0"
