"""distnorm: fused all-reduce + residual add + RMSNorm + FP8/NVFP4 quantization (CuTe DSL kernels)."""
from .formats import NormQuantOutput, QuantSpec, make_quant_spec
from .ops import add_rmsnorm

__all__ = ["NormQuantOutput", "QuantSpec", "add_rmsnorm", "make_quant_spec"]
__version__ = "0.1.0"
