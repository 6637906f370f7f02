"""Every single-GPU kernel variant compiles for sm_90a and sm_100a from fake tensors, no GPU needed.

Runs in CI on CPU machines with the newest CuTe DSL 4.x (4.8 compiles without a driver when
CUTE_DSL_ARCH is set; 4.3.5 stops at a driver check, so there the test skips and says why).
Each arch compiles in its own process: the DSL reads CUTE_DSL_ARCH once.
"""
from __future__ import annotations

import pytest

from cute_compile import compile_in_subprocess

BODY = """
from distnorm.kernels.compile import compiled_fused_norm
from distnorm.formats import NO_QUANT, make_quant_spec as Q
variants = [NO_QUANT, Q("fp8"), Q("fp8_per_token"),
            Q("fp8_per_group"), Q("fp8_per_group", group_size=64, scale_major="col", scale_ue8m0=True),
            Q("nvfp4"), Q("nvfp4", sf_layout="linear"),
            Q("mxfp8"), Q("mxfp4", sf_layout="linear")]
for q in variants:
    for dtype, H, res, gemma, cn, pdl in (("bfloat16", 4096, True, False, 1, True),
                                          ("float16", 1536, False, True, 1, False),
                                          ("bfloat16", 32768, True, False, 2, True),
                                          ("bfloat16", 32768, True, False, 8, False)):
        compiled_fused_norm(dtype, H, q, res, gemma, q.kind == "none", cn, pdl)
        done.append((q.kind, H, cn))
    # decode: each row split over CTAs (NOTE [split rows]), as ops._split_rows picks
    split = 2 if q.kind in ("fp8", "fp8_per_token") else 4
    compiled_fused_norm("bfloat16", 8192, q, True, False, True, 1, True, split)
    done.append((q.kind, 8192, split))
    # 3 vectors per thread in 4 parts: compact columns past nv, a part with none (NOTE [compact parts])
    compiled_fused_norm("bfloat16", 768, q, True, False, True, 1, True, 4)
    done.append((q.kind, 768, 4))
    # long decode rows: split clusters, fp16 (its register fragments read as words)
    compiled_fused_norm("float16", 32768, q, True, False, True, 4, True, split)
    done.append((q.kind, 32768, split))
    # the no-peer all-reduce's epilogue: x [slots, M, H] summed over the slots (NOTE [slots])
    compiled_fused_norm("bfloat16", 4096, q, True, False, q.kind == "none", 1, True, 1, 2)
    compiled_fused_norm("float16", 8192, q, False, False, True, 1, True, split, 8)
    done.append((q.kind, 4096, "slots"))
"""


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_single_gpu_kernels_compile(arch):
    assert compile_in_subprocess(BODY, arch) == 72

