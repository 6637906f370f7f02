"""GPU tests of the single-GPU fused kernel against distnorm.reference (skipped without CUDA).

Fresh random inputs, outputs poisoned first, every element checked (bounds: tests/quant_check.py).
The grid of test_fused_norm (docs/TESTING.md), variants x {bf16, fp16} x H x M; a kernel compiles
once per (variant, dtype, H), which is what a grid costs:
- default: every (variant, dtype) at two hidden sizes, one edge (256 or 32768, alternating so each
  variant meets both) and one middle size (rotating so each middle size is met), every M;
- DISTNORM_QUICK=1: every (variant, dtype) at its edge hidden size only, M in {0, 1, 4099};
- DISTNORM_FULL=1: every variant x dtype x H x M.
Under a launcher with several ranks the cases of one (variant, dtype, H) run on one rank
(shard_by, tests/sharding.py).
"""
from __future__ import annotations

import os

import pytest
import torch

import distnorm
from distnorm import formats
from distnorm.args import DTYPE_NAMES
from distnorm.reference import add_rmsnorm_ref
from invariance import BATCHES, assert_same_bytes, embed, row_bytes
from quant_check import assert_quant_close, assert_y_close, poison_like, quant_kwargs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (quant, options) for every format and layout; "none" also runs the Gemma variant
VARIANTS = {
    "none": (None, {}),
    "none_gemma": (None, {"gemma": True}),
    "fp8": ("fp8", {}),
    "fp8_per_token": ("fp8_per_token", {}),
    "fp8_g128": ("fp8_per_group", {"group_size": 128}),
    "fp8_g64_col_ue8m0": ("fp8_per_group", {"group_size": 64, "scale_major": "col", "scale_ue8m0": True}),
    "fp8_g128_col": ("fp8_per_group", {"group_size": 128, "scale_major": "col"}),
    "nvfp4_swizzled": ("nvfp4", {"sf_layout": "swizzled"}),
    "nvfp4_linear": ("nvfp4", {"sf_layout": "linear"}),
    "mxfp8_swizzled": ("mxfp8", {"sf_layout": "swizzled"}),
    "mxfp8_linear": ("mxfp8", {"sf_layout": "linear"}),
    "mxfp4_swizzled": ("mxfp4", {"sf_layout": "swizzled"}),
    "mxfp4_linear": ("mxfp4", {"sf_layout": "linear"}),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def variant_spec(variant: str):
    """The QuantSpec of a VARIANTS entry (None for bf16 output; Gemma is not a format option)."""
    quant, opts = VARIANTS[variant]
    return formats.make_quant_spec(quant, **{k: v for k, v in opts.items() if k != "gemma"})


EDGE_HIDDEN = (256, 32768)
MIDDLE_HIDDEN = (1536, 4096, 5120, 8192, 16384)
TOKENS = (0, 1, 7, 128, 4099)
EDGE_TOKENS = (0, 1, 4099)


def grid_level(environ) -> str:
    """"quick", "default" or "full", from DISTNORM_QUICK / DISTNORM_FULL."""
    quick, full = environ.get("DISTNORM_QUICK") == "1", environ.get("DISTNORM_FULL") == "1"
    if quick and full:
        raise ValueError("DISTNORM_QUICK=1 and DISTNORM_FULL=1 ask for different grids; set one")
    return "quick" if quick else "full" if full else "default"


def fused_norm_cases(level: str) -> list[tuple[str, str, int, int]]:
    """(variant, dtype id, H, M) of test_fused_norm's grid at ``level``."""
    if level not in ("quick", "default", "full"):
        raise ValueError(f"level must be 'quick', 'default' or 'full', got {level!r}")
    cases = []
    for i, variant in enumerate(VARIANTS):
        for d, dtype in enumerate(DTYPES):
            if level == "full":
                sizes = [(h, TOKENS) for h in sorted(EDGE_HIDDEN + MIDDLE_HIDDEN)]
            else:
                edge = EDGE_HIDDEN[(i + d) % 2]
                middle = MIDDLE_HIDDEN[(2 * i + d) % len(MIDDLE_HIDDEN)]
                sizes = [(edge, EDGE_TOKENS)] if level == "quick" else [(edge, TOKENS), (middle, TOKENS)]
            cases += [(variant, dtype, h, m) for h, tokens in sizes for m in tokens]
    return cases


FUSED_NORM_CASES = fused_norm_cases(grid_level(os.environ))


def make_inputs(M, H, dtype, seed, row_pad=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    big = torch.randn(M, H + row_pad, generator=g, device="cuda", dtype=torch.float32) * 3
    x = big.to(dtype)[:, :H]
    res = torch.randn(M, H, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    w = (torch.rand(H, generator=g, device="cuda") + 0.5).to(dtype)
    return x, res, w


def run_and_check(variant, dtype, M, H, *, residual=True, in_place=False, row_pad=0, seed=0):
    quant, opts = VARIANTS[variant]
    x, res, w = make_inputs(M, H, dtype, seed + M * 31 + H, row_pad)
    scale = torch.tensor([0.05], device="cuda")
    gs = torch.tensor([448 * 6 / 12.0], device="cuda")
    kw = dict(quant=quant, **opts)
    if quant == "fp8":
        kw["scale"] = scale
    if quant == "nvfp4":
        kw["global_scale"] = gs
    spec = variant_spec(variant)
    ref = add_rmsnorm_ref(  # before the call: with in_place the kernel overwrites res
x, res if residual else None, w, 1e-6, norm_out=True, **kw)
    outs = {}
    if residual:
        outs["residual_out"] = res if in_place else poison_like(torch.empty_like(res))
    outs["y_out"] = poison_like(torch.empty(M, H, dtype=dtype, device="cuda"))
    if spec is not None:
        outs["q_out"] = poison_like(torch.empty(formats.q_shape(spec, M, H), dtype=formats.q_dtype(spec), device="cuda"))
        if formats.scales_geometry(spec, M, H) is not None:
            outs["scales_out"] = poison_like(formats.empty_scales(spec, M, H, "cuda"))
    out = distnorm.add_rmsnorm(x, res if residual else None, w, 1e-6, norm_out=True, **kw, **outs)
    torch.cuda.synchronize()
    if residual:
        assert torch.equal(out.residual.view(torch.int16), ref.residual.view(torch.int16)), "residual not bitwise equal"
    assert_y_close(out.y, ref.y)
    if spec is not None:
        assert_quant_close(out.q, out.scales, ref, spec, M, H, scale=kw.get("scale"), global_scale=kw.get("global_scale"))


@pytest.mark.shard_by("variant", "dtype", "H")
@pytest.mark.parametrize("variant, dtype, H, M", FUSED_NORM_CASES,
                         ids=["-".join(map(str, case)) for case in FUSED_NORM_CASES])
def test_fused_norm(variant, dtype, H, M):
    quant, _ = VARIANTS[variant]
    spec = formats.make_quant_spec(quant)
    if H % formats.hidden_multiple(spec):
        pytest.skip(f"H={H} is not a multiple of {variant}'s block")
    run_and_check(variant, DTYPES[dtype], M, H)


# From H = 16384 a row may be spread over a cluster, so each (variant, H) compiles up to three
# kernels (about a second each at H = 32768). A row's thread layout depends on H and the cluster only
# (kernels/tiling.py), what crosses threads on the scale kind and group size, so by default the
# clustered sizes check one variant per (group size, scale kind, fp4 or not): 8 of 13 (layouts and
# Gemma differ only per element). Compiling is what the test costs, so by default each check uses a
# (variant, dtype, H) that test_fused_norm's grid compiles anyway (in the same process, plain pytest
# or one rank, the kernels are reused): every variant at its middle grid size (below 16384), and
# at 16384 / 32768 a variant of each kind whose grid has that size where one does.
# DISTNORM_FULL=1 checks every variant in bf16 at 4096, 8192, 16384 and 32768.
def _invariance_key(variant: str):
    spec = variant_spec(variant)
    return None if spec is None else (spec.group_size, spec.info.scales, spec.packed_fp4)


CLUSTER_HIDDEN = (16384, 32768)


def invariance_cases(level: str) -> dict[str, list[tuple[str, str, int]]]:
    """{test id: [(variant, dtype id, H), ...]} of test_batch_invariance at grid level `level`."""
    if level == "full":
        return {str(h): [(v, "bf16", h) for v in VARIANTS] for h in (4096, 8192) + CLUSTER_HIDDEN}
    grid = set(fused_norm_cases("default"))
    in_grid = {(v, d, h) for v, d, h, _m in grid}
    cases = {"no_cluster": []}
    for variant in VARIANTS:  # its middle size, bf16 first: below 16384 in one of the dtypes
        cases["no_cluster"].append(next((variant, d, h) for d in DTYPES for h in MIDDLE_HIDDEN
                                        if h < CLUSTER_HIDDEN[0] and (variant, d, h) in in_grid))
    for h in CLUSTER_HIDDEN:
        kinds: dict = {}
        for variant in VARIANTS:
            kinds.setdefault(_invariance_key(variant), []).append(variant)
        cases[str(h)] = [next(((v, d, h) for v in same for d in DTYPES if (v, d, h) in in_grid),
                              (same[0], "bf16", h)) for same in kinds.values()]
    return cases


INVARIANCE_CASES = invariance_cases(grid_level(os.environ))


@pytest.mark.parametrize("label", list(INVARIANCE_CASES))
def test_batch_invariance(label):
    """A row's outputs are bitwise the same in batches of M = 1, 7, 60, 128, 4099 (the cluster size
    changes with M, H and format: 1 to 4 CTAs per row; M = 60 is the 49..64-row choice), every
    format (at H >= 16384 one per group size and scale kind unless DISTNORM_FULL=1)."""
    for variant, dtype, H in INVARIANCE_CASES[label]:
        g = torch.Generator(device="cuda").manual_seed(H)
        x, res, w = make_inputs(1, H, DTYPES[dtype], H)
        quant, opts = VARIANTS[variant]
        spec = variant_spec(variant)
        kw = dict(quant=quant, norm_out=True, **opts)
        if quant == "fp8":
            kw["scale"] = torch.tensor([0.05], device="cuda")
        if quant == "nvfp4":
            kw["global_scale"] = torch.tensor([448 * 6 / 12.0], device="cuda")
        first = None
        for M, pos in BATCHES + ((60, 17),):
            out = distnorm.add_rmsnorm(embed(x[0], M, pos, g), embed(res[0], M, pos, g), w, 1e-6,
                                       **kw)
            got = row_bytes(out, spec, M, H, pos)
            if first is None:
                first = got
            else:
                assert_same_bytes(got, first, f"{variant} {dtype} H={H}: M={M} vs M=1")


def kernel_keys(test: str, params: dict) -> list[tuple]:
    """The kernels (distnorm.kernels.precompile keys) a case of test_fused_norm /
    test_batch_invariance / test_no_residual_strided_in_place compiles: tests/conftest.py compiles
    them ahead, in parallel."""
    from distnorm.ops import fused_kernel_key

    def key(variant, dtype, H, M, residual=True, in_place=False, slots=1):
        gemma = VARIANTS[variant][1].get("gemma", False)
        return ("fused_norm", *fused_kernel_key(DTYPES[dtype], H, variant_spec(variant), residual,
                                                gemma, True, M, in_place, slots))

    if test == "test_fused_norm":
        variant, H, M = params["variant"], params["H"], params["M"]
        if M == 0 or H % formats.hidden_multiple(formats.make_quant_spec(VARIANTS[variant][0])):
            return []
        return [key(variant, params["dtype"], H, M)]
    if test == "test_batch_invariance":
        return [key(v, d, h, M) for v, d, h in INVARIANCE_CASES[params["label"]]
                for M, _ in BATCHES + ((60, 17),)]
    if test == "test_split_rows_store_one_ctas_bits":
        spec = formats.kernel_spec(variant_spec(params["variant"]))
        return [("fused_norm", DTYPE_NAMES[DTYPES[params["dtype"]]], params["H"], spec, True,
                 False, True, params["cluster"], True, s) for s in (1, params["split"])]
    if test == "test_slots_sum_in_rank_order":
        v, d, slots, M, H = (params[k] for k in ("variant", "dtype", "slots", "M", "H"))
        return [key(v, d, H, M, in_place=params["in_place"], slots=slots),
                key(v, d, H, M, residual=False)]
    if test == "test_model_hidden_sizes":
        return [key(params["variant"], params["dtype"], params["H"], M) for M in (1, 7, 130)]
    if test == "test_one_cta_per_sm_rows_against_the_reference":
        return [key(params["variant"], "bf16", params["H"], M) for M in PACKED_EDGE_ROWS]
    if test == "test_ragged_rows_against_the_reference":
        return [key(params["variant"], params["dtype"], RAGGED_HIDDEN, M) for M in (3, 130)]
    if test == "test_no_residual_strided_in_place":  # its three run_and_check calls
        v = params["variant"]
        return [key(v, "bf16", 4096, 300, residual=False), key(v, "bf16", 4096, 300, in_place=True),
                key(v, "bf16", 4096, 7, in_place=True)]
    return []


# (variant, cluster, split, H, dtype): H = 32768 has 8 vectors per thread; 768 has 3 (a split of
# 4 leaves part 3 none: NOTE [compact parts]); 2880 a ragged tail (360 vectors on 96 threads)
SPLIT_CASES = [("none", 1, 4, 32768, "fp16"), ("none", 4, 4, 32768, "fp16"),
               ("nvfp4_swizzled", 4, 4, 32768, "fp16"), ("fp8_g128", 4, 2, 32768, "fp16"),
               ("fp8_per_token", 1, 2, 32768, "fp16"), ("nvfp4_swizzled", 1, 4, 768, "fp16"),
               ("fp8_per_token", 1, 4, 768, "fp16"), ("fp8", 1, 2, 768, "fp16"),
               ("fp8_g128", 1, 4, 768, "fp16"), ("mxfp8_swizzled", 1, 4, 2880, "fp16"),
               ("nvfp4_swizzled", 1, 2, 2880, "fp16"), ("fp8_per_token", 1, 2, 2880, "bf16"),
               ("fp8", 1, 2, 2880, "bf16"), ("none", 1, 2, 2880, "bf16"), ("fp8", 1, 4, 8192, "bf16"),
               ("fp8_per_token", 1, 4, 12288, "bf16")]
if grid_level(os.environ) == "full":  # every format, 2 and 4 parts, at the ragged and odd tilings
    SPLIT_CASES += [(v, 1, split, H, d) for H in (2880, 2816, 5120, 768) for v in VARIANTS
                    for d in DTYPES for split in (2, 4)
                    if v != "none_gemma" and not H % formats.hidden_multiple(variant_spec(v))]


@pytest.mark.parametrize("variant, cluster, split, H, dtype", SPLIT_CASES)
def test_split_rows_store_one_ctas_bits(variant, cluster, split, H, dtype):
    """Rows split over `split` CTAs (clusters of `cluster` CTAs) store every output bit the
    unsplit kernel stores (NOTE [split rows] in kernels/fused_norm.py, NOTE [compact parts] in
    kernels/split_parts.py), whatever ops' rule picks: fp16, where at H = 32768 a miscompile once
    made part 1 store vector column 0's residual in column 1; bf16 at 2880, where per-token FP8
    (and static FP8 before its parts were compacted) stored vector 1's y in vector 2's place. 3
    rows, so parts of several rows run side by side."""
    from distnorm.args import allocate_outputs
    from distnorm.kernels.compile import compiled_fused_norm

    M = 3
    spec = variant_spec(variant)
    x, res, w = make_inputs(M, H, DTYPES[dtype], 5)
    kw = quant_kwargs(*VARIANTS[variant], device="cuda")
    ref = add_rmsnorm_ref(x, res, w, 1e-6, norm_out=True, **kw)
    got = []
    for s in (1, split):
        outs = allocate_outputs(x, spec, True, True, None, None, None, None)
        for t in outs:
            if t is not None:
                poison_like(t)
        kernel = compiled_fused_norm(DTYPE_NAMES[DTYPES[dtype]], H, formats.kernel_spec(spec),
                                     True, False, True, cluster, True, s)
        kernel(x, res, *outs[:1], w, *outs[1:], kw.get("scale"), kw.get("global_scale"), 1e-6)
        # .contiguous(): column-major scales ([M, G] with strides (1, M)) have no byte view
        got.append([t.contiguous().view(torch.uint8) for t in outs if t is not None])
        if s == 1:
            _, y, q, scales = outs
    torch.cuda.synchronize()
    assert torch.equal(got[0][0], ref.residual.view(torch.uint8)), "residual not bitwise equal"
    assert_y_close(y, ref.y)  # the unsplit kernel against the reference (768, 2880: no grid size)
    if spec is not None:
        assert_quant_close(q, scales, ref, spec, M, H, scale=kw.get("scale"),
                           global_scale=kw.get("global_scale"))
    for one_cta, parts in zip(*got):
        assert torch.equal(one_cta, parts), f"split {split} (cluster {cluster}) changed bits"


# (variant, dtype): every scale kind, both FP4 packings, both activation dtypes
RAGGED_CASES = [("none", "bf16"), ("fp8", "fp16"), ("fp8_per_token", "bf16"),
                ("fp8_g64_col_ue8m0", "bf16"), ("nvfp4_swizzled", "fp16"), ("mxfp8_swizzled", "bf16"),
                ("mxfp4_linear", "bf16")]
RAGGED_HIDDEN = 2880


@pytest.mark.parametrize("variant, dtype", RAGGED_CASES)
def test_ragged_rows_against_the_reference(variant, dtype):
    """H = 2880 (gpt-oss's hidden size): 360 vectors on 96 threads, so the last vector of a
    thread is past the row for some threads (a predicated tail: RowTiling.exact False), a tiling
    test_fused_norm's sizes never have. Every output against the reference, outputs poisoned, at
    3 rows (split over CTAs) and 130."""
    for M in (3, 130):
        run_and_check(variant, DTYPES[dtype], M, RAGGED_HIDDEN)


# NOTE [one CTA per SM] in kernels/fused_norm.py: swizzled split calls of 18-31 rows from H = 8192
# reserve an SM per CTA; 17 and 32 rows are the edges (other kernels)
PACKED_EDGE_ROWS = (17, 18, 24, 31, 32)
PACKED_CASES = [(v, H) for v in ("nvfp4_swizzled", "mxfp8_swizzled", "mxfp4_swizzled")
                for H in (8192, 12288)]


@pytest.mark.parametrize("variant, H", PACKED_CASES)
def test_one_cta_per_sm_rows_against_the_reference(variant, H):
    """Every output (the padding rows' zero scales included) against the reference, outputs
    poisoned, at the row counts whose kernels take an SM per CTA and at their edges."""
    for M in PACKED_EDGE_ROWS:
        run_and_check(variant, torch.bfloat16, M, H)


# hidden sizes of released models (Qwen2.5-0.5B 896, Gemma 3 1B 1152, Gemma 2 2B 2304, Qwen3-4B
# 2560, Qwen2-7B 3584, Gemma 3 12B 3840, Gemma 3 27B 5376, Mixtral 8x22B 6144, DeepSeek-V3 7168,
# Mistral Large 12288): tilings the power-of-two grid never builds (3, 5 or 7 vectors per thread,
# 28 or 224 threads per row, ragged tails at 896)
MODEL_HIDDEN = (896, 1152, 2304, 2560, 3584, 3840, 5376, 6144, 7168, 12288)


def model_cases(level: str) -> list[tuple[str, str, int]]:
    """(variant, dtype id, H) of test_model_hidden_sizes: every variant and dtype at every size
    with DISTNORM_FULL=1, else two per size, rotating over the variants and dtypes."""
    names = list(VARIANTS)
    if level == "full":
        return [(v, d, H) for H in MODEL_HIDDEN for v in names for d in DTYPES]
    dtypes = list(DTYPES)
    return [(names[(2 * i + k) % len(names)], dtypes[(i + k) % 2], H)
            for i, H in enumerate(MODEL_HIDDEN) for k in range(2)]


MODEL_CASES = model_cases(grid_level(os.environ))


@pytest.mark.parametrize("variant, dtype, H", MODEL_CASES)
def test_model_hidden_sizes(variant, dtype, H):
    """Every output against the reference, outputs poisoned, at the hidden sizes of released
    models and 1, 7 (rows split over CTAs) and 130 rows, with the launch rules' own choices."""
    for M in (1, 7, 130):
        run_and_check(variant, DTYPES[dtype], M, H)


@pytest.mark.parametrize("variant", ["none", "fp8_per_token", "nvfp4_swizzled"])
def test_no_residual_strided_in_place(variant):
    run_and_check(variant, torch.bfloat16, 300, 4096, residual=False, row_pad=64)
    run_and_check(variant, torch.bfloat16, 300, 4096, residual=True, in_place=True, row_pad=64)
    # decode rows in place: the host must not split them over CTAs (NOTE [split rows])
    run_and_check(variant, torch.bfloat16, 7, 4096, residual=True, in_place=True)


# (variant, dtype, slots, M, H, in place): fp16 and a long row, decode rows split over CTAs
SLOTS_CASES = [("none", "bf16", 2, 1, 4096, False), ("fp8", "bf16", 2, 130, 4096, True),
               ("fp8_per_token", "fp16", 3, 5, 8192, False),
               ("fp8_g128_col", "bf16", 4, 300, 4096, False),
               ("nvfp4_swizzled", "bf16", 8, 33, 4096, False),
               ("mxfp4_linear", "fp16", 2, 2, 32768, True)]


@pytest.mark.parametrize("variant, dtype, slots, M, H, in_place", SLOTS_CASES)
def test_slots_sum_in_rank_order(variant, dtype, slots, M, H, in_place):
    """x [N, M, H] (the no-peer all-reduce's epilogue, NOTE [slots] in kernels/fused_norm.py):
    residual_out is bitwise h = T(x_0 + ... + x_{N-1} + float(res)) summed in float32 in slot order
    (torch, as the reference and the peer kernels do), and every other output bitwise the plain
    kernel's on h. Slot 0 carries +B and the last slot -B (B ~ 2^18): a sum in another order
    shows. Slots sit apart in memory (a slot stride of M + 3 rows); outputs poisoned."""
    from distnorm.args import allocate_outputs
    from distnorm.collectives.nopeer import fold_epilogue

    dt, spec = DTYPES[dtype], variant_spec(variant)
    kw = quant_kwargs(*VARIANTS[variant], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(M * 31 + slots)
    vals = torch.randn(slots, M + 3, H, generator=g, device="cuda") * 2
    big = torch.randn(M + 3, H, generator=g, device="cuda") * 2.0 ** 18
    vals[0] += big
    vals[-1] -= big
    parts = vals.to(dt)[:, :M]
    res = torch.randn(M, H, generator=g, device="cuda").to(dt)
    w = (torch.rand(H, generator=g, device="cuda") + 0.5).to(dt)
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    h = (acc + res.float()).to(dt)
    want = distnorm.add_rmsnorm(h, None, w, 1e-6, norm_out=True, **kw)
    outs = list(allocate_outputs(parts[0], spec, True, True, None, None, None, None))
    for t in outs:
        if t is not None:
            poison_like(t)
    if in_place:
        outs[0] = res
    fold_epilogue(parts, res, w, 1e-6, spec, kw.get("scale"), kw.get("global_scale"), False, *outs)
    torch.cuda.synchronize()
    assert torch.equal(outs[0].view(torch.uint8), h.view(torch.uint8)), "residual_out is not h"
    for name, got, ref in zip(("y", "q", "scales"), outs[1:], (want.y, want.q, want.scales)):
        if spec is not None and spec.info.scales == "static" and name == "scales":
            continue  # static FP8 has no scales output
        if got is not None or ref is not None:
            assert torch.equal(got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), \
                f"{name} differs from the kernel's on h"


def test_cuda_graph_and_compile():
    x, res, w = make_inputs(64, 4096, torch.bfloat16, 7)
    scale = torch.tensor([0.05], device="cuda")
    ref = add_rmsnorm_ref(x, res, w, 1e-6, quant="fp8", scale=scale)
    out = distnorm.add_rmsnorm(x, res, w, 1e-6, quant="fp8", scale=scale)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = distnorm.add_rmsnorm(x, res, w, 1e-6, quant="fp8", scale=scale)
    for _ in range(3):
        poison_like(out.q)
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.residual, ref.residual)
    assert (out.q.view(torch.uint8) == ref.q.view(torch.uint8)).float().mean() > 0.999
    f = torch.compile(lambda a, b, c: distnorm.add_rmsnorm(a, b, c, 1e-6, quant="fp8", scale=scale), fullgraph=True)
    o2 = f(x, res, w)
    assert torch.equal(o2.residual, ref.residual)
    assert (o2.q.view(torch.uint8) == ref.q.view(torch.uint8)).float().mean() > 0.999


@pytest.mark.parametrize("M", [1, 300])
def test_dependent_chain_in_graph(M):
    """Each call reads the previous call's outputs (x = y, residual = residual_out), 40 calls in
    one CUDA graph: with programmatic dependent launch (the default) a call may be launched while
    its predecessor still runs, and must still read only finished outputs. Every step's outputs,
    poisoned before each replay, are checked against the reference on that step's own inputs."""
    steps, H = 40, 4096
    x, res, w = make_inputs(M, H, torch.bfloat16, 11 + M)
    ys = [poison_like(torch.empty_like(x)) for _ in range(steps)]
    hs = [poison_like(torch.empty_like(res)) for _ in range(steps)]

    def chain():
        a, r = x, res
        for i in range(steps):
            distnorm.add_rmsnorm(a, r, w, 1e-6, y_out=ys[i], residual_out=hs[i])
            a, r = ys[i], hs[i]

    chain()  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    for _ in range(2):
        for t in ys + hs:
            poison_like(t)
        g.replay()
    torch.cuda.synchronize()
    a, r = x, res
    for i in range(steps):
        ref = add_rmsnorm_ref(a, r, w, 1e-6)
        assert torch.equal(hs[i].view(torch.int16), ref.residual.view(torch.int16)), f"step {i}: residual"
        assert_y_close(ys[i], ref.y)
        a, r = ys[i], hs[i]


def test_bad_inputs_on_gpu():
    x, res, w = make_inputs(4, 4096, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="residual"):
        distnorm.add_rmsnorm(x, res.half(), w)
    with pytest.raises(ValueError, match="weight"):
        distnorm.add_rmsnorm(x, res, w[:100])
    with pytest.raises(ValueError, match="scale"):
        distnorm.add_rmsnorm(x, res, w, quant="fp8")
    with pytest.raises(ValueError, match="x rows"):
        distnorm.add_rmsnorm(x.view(-1)[1:4097].view(1, 4096), None, w)
