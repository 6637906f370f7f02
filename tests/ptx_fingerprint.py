"""Hash the PTX of every kernel variant (single GPU, all-reduce, barrier test kernel), compiled for
sm_90a from fake tensors without a GPU: a refactor that claims to leave the kernels alone shows the
same hashes before and after.

    CUTE_DSL_ARCH=sm_90a DISTNORM_KEEP_PTX=1 python tests/ptx_fingerprint.py OUT_DIR
writes OUT_DIR/<variant>.ptx and OUT_DIR/hashes.json, and prints the number of variants.
(DISTNORM_KEEP_PTX=1 makes kernels.compat compile with --keep-ptx, which also leaves .ptx files in the
working directory: run two of these from different directories, or the later reads the other's.)
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
from distnorm.kernels.compile_allreduce import compiled_allreduce, compiled_rowgather  # noqa: E402

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
# (quant, H, cluster, pdl, split, slots): split rows (NOTE [split rows]; at H = 768 a part with no
# vector: NOTE [compact parts]), PDL, rank slots (NOTE [slots]), and one with an SM per CTA (NOTE [one
# CTA per SM])
FUSED_LAUNCH_FORMS = (("nvfp4s", 4096, 1, True, 4, 1), ("pg128", 32768, 4, True, 4, 1),
                      ("mxfp8s", 16384, 2, True, 2, 1), ("fp8", 8192, 1, False, 2, 1),
                      ("pt", 4096, 1, True, 1, 2), ("pg128", 768, 1, True, 4, 1),
                      ("pt", 768, 1, True, 4, 1), ("nvfp4s", 12288, 1, True, 4, 1, True))
# (algo, world, dtype, H, quant, residual, gemma, write_y, write_allreduce[, pdl, rows_per_cta,
#  form]): every all-reduce algorithm at world 2 / 4 / 8, plain and fused, the formats' scale kinds,
# fp16 and ragged rows, PDL and rows per CTA, every form. Also what tests/test_allreduce_compile.py
# compiles with the newest CuTe DSL.
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
    # NOTE [two-shot forms]: loads instead of stores (both outputs gathered; block scales)
    ("twoshot", 4, "bfloat16", 4096, "pt", True, False, True, True, True, 0, "pull"),
    ("twoshot", 8, "bfloat16", 8192, "nvfp4s", True, False, False, False, True, 0, "pull-gather"),
    # NOTE [wide two-shot]: a CTA per (slice, row group), pushed and pulled
    ("twoshot", 4, "bfloat16", 4096, "fp8", True, False, False, False, True, 0, "pull-wide"),
    ("twoshot", 8, "bfloat16", 8192, "nvfp4s", True, False, True, True, True, 0, "push-wide"),
    # NOTE [two-shot rounds]: the next round's rows pushed while this one is finished
    ("twoshot", 2, "bfloat16", 8192, "fp8", True, False, False, False, True, 0, "push-rounds"),
    ("twoshot", 4, "bfloat16", 4096, "nvfp4s", True, False, True, True, True, 0, "pull-rounds"),
    # NOTE [lamport polls]: only the vectors not yet arrived (ragged row: predicated vectors)
    ("lamport", 4, "float16", 2000, "pt", True, True, True, True, True, 0, "poll-unseen"),
    ("reducescatter", 2, "bfloat16", 4096, "pt", True, False, False, False, True, 0),
    ("reducescatter", 4, "bfloat16", 7168, "nvfp4s", True, False, True, False, True, 0),
    ("reducescatter", 8, "float16", 2000, "none", False, True, True, False, True, 0),
    # NOTE [reduce-scatter rounds]: rounds of pushes and barriers (and swizzled padding groups)
    ("reducescatter", 2, "bfloat16", 4096, "pt", True, False, True, False, True, 0, "pipelined"),
    ("reducescatter", 4, "bfloat16", 7168, "nvfp4s", True, False, True, False, True, 0,
     "pipelined"),
    # NOTE [gather in the epilogue]: q pushed from the epilogue (a row of whole lanes' units, a
    # ragged one, packed fp4; every form; linear block scales)
    ("rsgather", 2, "bfloat16", 8192, "fp8", True, False, False, False, True, 0),
    ("rsgather", 2, "bfloat16", 2880, "pt", True, False, True, False, True, 0),
    ("rsgather", 4, "bfloat16", 7168, "nvfp4l", True, False, True, False, True, 0, "pipelined"),
    ("rsgather", 2, "bfloat16", 8192, "nvfp4l", True, False, False, False, True, 0, "pipelined-8"),
    ("rsgather", 2, "bfloat16", 4096, "fp8", True, False, False, False, True, 0, "pipelined-16"),
    ("rsgather", 2, "bfloat16", 8192, "nvfp4l", True, False, False, False, True, 0, "pipelined-32"),
    ("rsgather", 2, "bfloat16", 4096, "nvfp4l", True, False, False, False, True, 0, "pipelined-2"),
    ("rsgather", 2, "bfloat16", 8192, "fp8", True, False, False, False, True, 0, "pipelined-g4"),
    ("rsgather", 8, "float16", 4096, "pg128", False, True, False, False, True, 0),
    # NOTE [swizzled scales gathered]: swizzled block scales of the whole output, pushed word by
    # word (16-byte units, 4-byte units at H 2880, ue8m0 at world 4), stored at their places
    ("rsgather", 2, "bfloat16", 4096, "nvfp4s", True, False, False, False, True, 0),
    ("rsgather", 2, "bfloat16", 8192, "nvfp4s", True, False, False, False, True, 0, "pipelined-g2"),
    ("rsgather", 4, "bfloat16", 2880, "nvfp4s", True, False, True, False, True, 0, "pipelined"),
    ("rsgather", 4, "bfloat16", 7168, "mxfp8s", True, False, False, False, True, 0),
    # NOTE [bulk-copy pushes]: x pushed by TMA bulk copies, rounds of one row group (two rows per
    # CTA at H 4096) and of two (gathered, one row per CTA), world 4 (three peers per stage, a
    # ragged row); at world 4 and H 4096 a row group passes the stage: thread stores in g2's rounds
    ("reducescatter", 2, "bfloat16", 4096, "fp8", True, False, False, False, True, 0,
     "pipelined-tma"),
    ("rsgather", 2, "bfloat16", 4096, "nvfp4s", True, False, False, False, True, 1,
     "pipelined-tma"),
    ("reducescatter", 4, "bfloat16", 1536, "pt", True, False, True, False, True, 0,
     "pipelined-tma"),
    ("rsgather", 4, "bfloat16", 4096, "fp8", True, False, False, False, True, 0, "pipelined-tma"),
    # NOTE [reduce-scatter roles by TMA]: pusher and finisher CTAs (two rows per CTA, one gathered
    # with swizzled scales, three peers with a ragged row); at H 32768 two parts of 64 KiB pass
    # the shared memory: "serial"
    ("reducescatter", 2, "bfloat16", 4096, "fp8", True, False, False, False, True, 0, "roles-tma"),
    ("rsgather", 2, "bfloat16", 4096, "nvfp4s", True, False, False, False, True, 1, "roles-tma"),
    ("rsgather", 4, "bfloat16", 2880, "pt", True, False, True, False, True, 0, "roles-tma"),
    ("reducescatter", 2, "bfloat16", 32768, "none", True, False, False, False, True, 0,
     "roles-tma"),
]

# (world, copy unit per segment) of the row gather (kernels/rowgather.py): q alone; q, per-token
# scales and y; world 4 and 8
ROWGATHER = [(2, (16,)), (2, (16, 4, 16)), (4, (16, 4)), (8, (16, 16, 4))]
# NOTE [row gather batches]: the "batched" form (world 2 and 8, three segments)
ROWGATHER_BATCHED = [(2, (16, 4, 16)), (8, (16, 16, 4))]


def allreduce_args(v: tuple) -> tuple:
    """compiled_allreduce's arguments for an ALLREDUCE entry (its format named by QUANTS key)."""
    return (*v[:4], QUANTS[v[4]], *v[5:])


def kernel_variants() -> list:
    """(name, compile thunk) of every kernel variant above: the single-GPU kernel for each format
    and shape, the all-reduce list, the barrier test kernels. Also what tests/oldest_dsl_compile.py
    compiles with the oldest supported CuTe DSL."""
    variants = []
    for qname in ("none", "fp8", "pt", "pg128", "pg64c", "nvfp4s", "nvfp4l", "mxfp8s", "mxfp4l"):
        for dtype, H, res, gemma, cluster in FUSED_SHAPES:
            variants.append((f"fused_{qname}_{dtype}_{H}_{int(res)}{int(gemma)}_{cluster}",
                             lambda q=QUANTS[qname], a=(dtype, H, res, gemma, qname == "none", cluster):
                             compiled_fused_norm(a[0], a[1], q, a[2], a[3], a[4], a[5])))
    for qname, H, cluster, pdl, split, slots, *one_per_sm in FUSED_LAUNCH_FORMS:
        variants.append((f"fused_{qname}_{H}_c{cluster}_pdl{int(pdl)}_split{split}_slots{slots}"
                         + ("_one_per_sm" if one_per_sm else ""),
                         lambda q=QUANTS[qname], a=(H, cluster, pdl, split, slots, *one_per_sm):
                         compiled_fused_norm("bfloat16", a[0], q, True, False, False, *a[1:])))
    for v in ALLREDUCE:
        variants.append(("ar_" + "_".join(str(a) for a in (*v[:4], QUANTS[v[4]].kind, *v[5:])),
                         lambda a=allreduce_args(v): compiled_allreduce(*a)))
    for world, units in ROWGATHER:
        variants.append((f"rowgather_{world}_" + "_".join(map(str, units)),
                         lambda w=world, u=units: compiled_rowgather(w, u)))
    for world, units in ROWGATHER_BATCHED:
        variants.append((f"rowgather_batched_{world}_" + "_".join(map(str, units)),
                         lambda w=world, u=units: compiled_rowgather(w, u, "batched")))
    for world in (2, 4, 8):
        for barrier_only in (False, True):
            variants.append((f"barrier_{world}_{barrier_only}",
                             lambda w=world, b=barrier_only: compiled_barrier_rounds(w, b)))
    variants.append(("smoke", compiled_primitives_smoke))
    return variants


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    hashes = {}
    for name, compile_variant in kernel_variants():
        ptx = compile_variant().__ptx__
        with open(os.path.join(out, name + ".ptx"), "w") as f:
            f.write(ptx)
        hashes[name] = hashlib.sha256(ptx.encode()).hexdigest()[:16]
    with open(os.path.join(out, "hashes.json"), "w") as f:
        json.dump(hashes, f, indent=1, sort_keys=True)
    print(len(hashes))


if __name__ == "__main__":
    main(sys.argv[1])
