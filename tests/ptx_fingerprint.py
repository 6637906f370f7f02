"""Hash the PTX of every kernel variant (single GPU, all-reduce, barrier test kernel), compiled for
sm_90a from fake tensors without a GPU: a refactor that claims to leave the kernels alone shows the
same hashes before and after.

    CUTE_DSL_ARCH=sm_90a DISTNORM_KEEP_PTX=1 python tests/ptx_fingerprint.py OUT_DIR
writes OUT_DIR/<variant>.ptx and OUT_DIR/hashes.json, and prints the number of variants.
(DISTNORM_KEEP_PTX=1 makes kernels.compat compile with --keep-ptx.)
"""
import hashlib
import json
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]

from barrier_kernel import compiled_barrier_rounds, compiled_primitives_smoke  # noqa: E402
from distnorm.formats import NO_QUANT, make_quant_spec  # noqa: E402
from distnorm.kernels.compile import compiled_fused_norm  # noqa: E402
from distnorm.kernels.compile_allreduce import compiled_allreduce  # noqa: E402

QUANTS = {
    "none": NO_QUANT, "fp8": make_quant_spec("fp8"), "pt": make_quant_spec("fp8_per_token"),
    "pg128": make_quant_spec("fp8_per_group"),
    "pg64c": make_quant_spec("fp8_per_group", group_size=64, scale_major="col", scale_ue8m0=True),
    "nvfp4s": make_quant_spec("nvfp4"), "nvfp4l": make_quant_spec("nvfp4", sf_layout="linear"),
    "mxfp8s": make_quant_spec("mxfp8"), "mxfp4l": make_quant_spec("mxfp4", sf_layout="linear"),
    "mxfp4s": make_quant_spec("mxfp4"),
}
FUSED_SHAPES = (("bfloat16", 4096, True, False, 1), ("float16", 1536, False, True, 1),
                ("bfloat16", 32768, True, False, 2), ("bfloat16", 8192, True, False, 8))
# (algo, world, dtype, H, quant, residual, gemma, write_y, write_allreduce[, pdl, rows_per_cta])
ALLREDUCE = [
    ("oneshot", 2, "bfloat16", 4096, "fp8", True, False, False, True),
    ("oneshot", 4, "bfloat16", 7168, "nvfp4s", True, False, True, False),
    ("oneshot", 8, "bfloat16", 8192, "none", False, False, False, True),
    ("twoshot", 2, "bfloat16", 4096, "mxfp8s", True, False, False, False),
    ("twoshot", 4, "bfloat16", 2048, "pt", True, False, True, True),
    ("twoshot", 8, "bfloat16", 8192, "none", True, False, True, False),
    ("twoshot", 2, "float16", 1536, "pg64c", True, True, False, False),
    ("lamport", 2, "bfloat16", 4096, "fp8", True, False, False, True),
    ("lamport", 4, "bfloat16", 7168, "nvfp4s", True, False, True, False),
    ("lamport", 8, "bfloat16", 8192, "none", False, False, False, True),
    ("lamport", 2, "float16", 2000, "pt", True, True, True, True),
    ("lamport", 2, "bfloat16", 4096, "fp8", True, False, False, False, True, 1),
    ("oneshot", 4, "bfloat16", 2048, "mxfp4s", True, False, False, False, True, 1),
    ("twoshot", 4, "float16", 8192, "fp8", True, False, True, True, True, 0),
    ("lamport", 2, "bfloat16", 4096, "pg128", True, False, True, False, True, 1),
    ("twoshot", 2, "bfloat16", 4096, "fp8", True, False, False, False, True, 0),
    ("reducescatter", 2, "bfloat16", 4096, "pt", True, False, False, False, True, 0),
    ("reducescatter", 4, "bfloat16", 7168, "nvfp4s", True, False, True, False, True, 0),
]


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    hashes = {}

    def record(name, compiled):
        ptx = compiled.__ptx__
        with open(os.path.join(out, name + ".ptx"), "w") as f:
            f.write(ptx)
        hashes[name] = hashlib.sha256(ptx.encode()).hexdigest()[:16]

    for qname in ("none", "fp8", "pt", "pg128", "pg64c", "nvfp4s", "nvfp4l", "mxfp8s", "mxfp4l"):
        for dtype, H, res, gemma, cluster in FUSED_SHAPES:
            record(f"fused_{qname}_{dtype}_{H}_{int(res)}{int(gemma)}_{cluster}",
                   compiled_fused_norm(dtype, H, QUANTS[qname], res, gemma, qname == "none", cluster))
    for v in ALLREDUCE:
        args = list(v)
        args[4] = QUANTS[v[4]]
        record("ar_" + "_".join(str(a) for a in (*v[:4], QUANTS[v[4]].kind, *v[5:])),
               compiled_allreduce(*args))
    for world in (2, 4, 8):
        for barrier_only in (False, True):
            record(f"barrier_{world}_{barrier_only}", compiled_barrier_rounds(world, barrier_only))
    record("smoke", compiled_primitives_smoke())
    with open(os.path.join(out, "hashes.json"), "w") as f:
        json.dump(hashes, f, indent=1, sort_keys=True)
    print(len(hashes))


if __name__ == "__main__":
    main(sys.argv[1])
