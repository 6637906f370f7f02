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
    # decode: each row split over CTAs (NOTE [split rows]): FP8 with one scale per row in 2 parts
    # (what ops._split_rows picks for it below H = 8192 and at 17-48 rows; its 4 parts at 768 below)
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
    # an SM per CTA (NOTE [one CTA per SM]: the launch reserves shared memory)
    compiled_fused_norm("bfloat16", 12288, q, True, False, False, 1, True, split, 1, True)
    done.append((q.kind, 12288, "one CTA per SM"))
"""


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_single_gpu_kernels_compile(arch):
    assert compile_in_subprocess(BODY, arch) == 81



# NOTE [scalars after the row loads] (kernels/norm_quant.py): in the PTX of the single-GPU kernel
# the scalar loads (ld.global.b32: the static scale, NVFP4's global scale) follow the row's vector
# loads (x, residual) and precede its first vector store (residual_out), and no rcp.rn of the scale
# precedes the row loads
ORDER_BODY = """
import os, re, tempfile
os.environ["DISTNORM_KEEP_PTX"] = "1"  # the PTX text (--keep-ptx also leaves files in the cwd)
os.chdir(tempfile.mkdtemp())
from distnorm.kernels.compile import compiled_fused_norm
from distnorm.formats import make_quant_spec as Q
for kind, H, split, slots in (("fp8", 8192, 2, 1), ("fp8", 4096, 4, 1), ("fp8", 4096, 1, 1),
                              ("nvfp4", 4096, 4, 1), ("nvfp4", 8192, 1, 1), ("fp8", 4096, 1, 2)):
    ptx = compiled_fused_norm("bfloat16", H, Q(kind), True, False, True, 1, True, split,
                              slots).__ptx__
    lines = ptx.splitlines()
    vec_loads = [i for i, s in enumerate(lines) if "ld.global.v4" in s]
    scalar_loads = [i for i, s in enumerate(lines) if re.search(r"ld\\.global(\\.nc)?\\.b32", s)]
    vec_stores = [i for i, s in enumerate(lines) if "st.global.v4" in s]
    rcps = [i for i, s in enumerate(lines) if s.strip().startswith("rcp.rn.f32")]
    assert len(scalar_loads) == 1, (kind, H, split, slots, scalar_loads)
    rows_issued = [i for i in vec_loads if i < vec_stores[0]]
    assert len(rows_issued) >= 2, (kind, H, split, slots)
    assert rows_issued[-1] < scalar_loads[0] < vec_stores[0], (kind, H, split, slots)
    assert not [i for i in rcps if i < rows_issued[-1]], (kind, H, split, slots)
    done.append((kind, H, split, slots))
"""


def test_single_gpu_scalars_follow_the_row_loads():
    """NOTE [scalars after the row loads]: on main before it, the scale's rcp.rn and both scalar
    loads stood before the row loads."""
    assert compile_in_subprocess(ORDER_BODY) == 6
