"""Bad calls of the fused ops, one per argument, and the library's message for each: used by the
single-GPU tests (tests/test_ops_args.py) and the all-reduce ones (tests/multigpu)."""
from __future__ import annotations

import torch


def inputs(shape, device, seed=0, dtype=torch.bfloat16):
    """x (scaled randn), residual (randn), weight (in [0.5, 1.5)) of `shape` [..., H]."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(device)
    res = torch.randn(*shape, generator=g).to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(device)
    return x, res, w


BAD_CASES = ["residual rows", "residual dtype", "residual type", "weight length", "weight dtype",
             "x dtype", "H", "scale missing", "scale dtype", "scale size", "residual_out rows",
             "y_out dtype", "q_out dtype", "q_out shape", "scales_out strides", "q_out misaligned",
             "scales_out misaligned", "eps int-like string", "gemma string", "norm_out int"]


def bad_call(case: str, device, op):
    """(call, the library's message) of the bad call `case` of `op` (distnorm.add_rmsnorm, or an
    all-reduce op with its workspace bound): one per argument the CUDA kernel's own entry checks
    (the eager CUDA paths leave those checks to it: ops._launch_kernel_checked,
    collectives/dispatch.launch_eager)."""
    x, res, w = inputs((4, 512), device)
    s = torch.tensor([0.05], device=device)
    f8 = torch.float8_e4m3fn
    calls = {
        "residual rows": (lambda: op(x, res[:3], w), "residual must have shape"),
        "residual dtype": (lambda: op(x, res.half(), w), "residual must have dtype"),
        "residual type": (lambda: op(x, [1.0], w), "residual must be a torch.Tensor"),
        "weight length": (lambda: op(x, res, w[:256]), "weight must be a [512]"),
        "weight dtype": (lambda: op(x, res, w.float()), "weight must be a [512]"),
        "x dtype": (lambda: op(x.float(), None, w.float()),
                    "x must be bfloat16 or float16"),
        "H": (lambda: op(x[:, :264], None, w[:264], quant="fp8_per_group", group_size=128),
              "hidden size H=264"),
        "scale missing": (lambda: op(x, res, w, quant="fp8"), "scale is required"),
        "scale dtype": (lambda: op(x, res, w, quant="fp8", scale=s.double()),
                        "scale must be a float32 tensor of one element"),
        "scale size": (lambda: op(x, res, w, quant="fp8", scale=s.repeat(2)),
                       "scale must be a float32 tensor of one element"),
        "residual_out rows": (lambda: op(x, res, w, residual_out=res[:2].clone()),
                              "residual_out must have shape"),
        "y_out dtype": (lambda: op(x, res, w, y_out=res.half()), "y_out must have dtype"),
        "q_out dtype": (lambda: op(x, res, w, quant="fp8", scale=s, q_out=res.clone()),
                        "q_out must have dtype"),
        "q_out shape": (lambda: op(
            x, res, w, quant="nvfp4", global_scale=s, q_out=torch.empty(4, 512, dtype=torch.uint8, device=device)),
            "q_out must have shape"),
        "scales_out strides": (lambda: op(
            x, res, w, quant="fp8_per_group", group_size=128,
            scales_out=torch.empty(4, 4, device=device).t().contiguous().t()), "scales_out must have shape"),
        "q_out misaligned": (lambda: op(
            x, res, w, quant="fp8", scale=s,
            q_out=torch.empty(4 * 512 + 8, dtype=f8, device=device)[1:1 + 4 * 512].view(4, 512)),
            "q_out rows must start at 8-byte aligned"),
        # the swizzled layout's padding rows are 16-byte stores (a misaligned one faults the kernel)
        "scales_out misaligned": (lambda: op(
            x, res, w, quant="nvfp4", global_scale=s,
            scales_out=torch.empty(128 * 32 + 16, dtype=f8, device=device)[4:4 + 128 * 32].view(128, 32)),
            "scales_out must start at a 16-byte aligned address"),
        "eps int-like string": (lambda: op(x, res, w, "1e-6"), "eps must be a finite"),
        # "False" is truthy: taken as a flag it would select gemma's (1 + w) without a word
        "gemma string": (lambda: op(x, res, w, gemma="False"), "gemma must be a bool"),
        "norm_out int": (lambda: op(x, res, w, quant="fp8", scale=s, norm_out=1),
                         "norm_out must be a bool"),
    }
    return calls[case]
