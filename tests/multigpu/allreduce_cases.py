"""The shared cases of the fused all-reduce GPU tests: inputs (seeded per rank, with +-B terms that
expose the summation order), the formats' arguments, poisoned outputs, one call checked against the
reference and compared across ranks. Used by test_allreduce_gpu.py, test_allreduce_shapes_gpu.py
and test_forms_gpu.py; everything here runs on every rank of run_distributed's group.
"""
from __future__ import annotations

import hashlib
import os

import torch

from harness import all_gather_tensors as _all_gather, gathered_check as _gathered_check

MiB = 1 << 20
BUFFER_BYTES = 32 * MiB
ALGOS = ("oneshot", "twoshot", "lamport")  # the all-reduce kernels (algo="auto" picks among them)
FULL = os.environ.get("DISTNORM_FULL") == "1"
TIMEOUT_S = 900 if FULL else 400  # of one run_distributed test

QUANTS = {
    "none": (None, {}),
    "fp8": ("fp8", {}),
    "fp8_per_token": ("fp8_per_token", {}),
    "nvfp4": ("nvfp4", {"sf_layout": "swizzled"}),
    "mxfp8": ("mxfp8", {"sf_layout": "swizzled"}),
}


# NOTE [bulk-copy pushes], [reduce-scatter roles by TMA]: reduce-scatter forms not yet run on two
# GPUs (they passed with 2 ranks sharing one, where every peer write stays in one GPU's memory and
# no bulk copy crosses NVLink). The GPU tests take them only with DISTNORM_UNVERIFIED_FORMS=1, so that
# a fault in an unverified kernel (a fault poisons the process's CUDA context) cannot take a user's
# suite down with it; a form leaves this tuple once a run on two GPUs passed it.
UNVERIFIED_RS_FORMS = ("pipelined-tma", "roles-tma")


def rs_forms_under_test() -> tuple:
    """The reduce-scatter forms the GPU tests run: every one with DISTNORM_UNVERIFIED_FORMS=1,
    else those a GPU run has passed; DISTNORM_RS_FORMS=a,b,... keeps only those of them (e.g. a
    compute-sanitizer run of a few forms: "serial" first, the one the others are compared with)."""
    from distnorm.collectives.plan import REDUCESCATTER_FORMS
    forms = REDUCESCATTER_FORMS
    if os.environ.get("DISTNORM_UNVERIFIED_FORMS") != "1":
        forms = tuple(f for f in forms if f not in UNVERIFIED_RS_FORMS)
    wanted = [f.strip() for f in os.environ.get("DISTNORM_RS_FORMS", "").split(",") if f.strip()]
    unknown = [f for f in wanted if f not in REDUCESCATTER_FORMS]
    if unknown:
        raise ValueError(f"DISTNORM_RS_FORMS: unknown forms {unknown}; expected some of "
                         f"{REDUCESCATTER_FORMS}")
    return tuple(f for f in forms if f in wanted) if wanted else forms


def group_bootstrap():
    from distnorm.comm import resolve_bootstrap
    return resolve_bootstrap(None)


def make_inputs(M, H, rank, seed, dtype=torch.bfloat16, world=None):
    """x (per rank), residual and weight (shared). With `world`, x also carries +B on rank 0 and
    -B on the last rank (B ~ 2^18, shared): the running sum sits near B, where float32 rounds the
    other ranks' terms, so a sum in any order but the ranks' shows in the bf16 residual (values of
    like magnitude add exactly in float32 in any order, which hides the order)."""
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + 1000003 * (rank + 1))
    x = torch.randn(M, H, generator=g, device="cuda") * 2
    if world is not None and world > 1 and rank in (0, world - 1):
        g.manual_seed(seed * 7919 + 17)  # the same B on both ranks
        big = torch.randn(M, H, generator=g, device="cuda") * 2.0 ** 18
        x = x + big if rank == 0 else x - big
    x = x.to(dtype)
    g.manual_seed(seed * 7919)  # shared by all ranks
    res = torch.randn(M, H, generator=g, device="cuda").to(dtype)
    w = (torch.rand(H, generator=g, device="cuda") + 0.5).to(dtype)
    return x, res, w


def quant_spec(qname):
    """The QuantSpec of format `qname` of QUANTS (no CUDA: usable where kernel keys are listed)."""
    from distnorm import formats
    quant, opts = QUANTS[qname]
    return formats.make_quant_spec(quant, **opts)


def quant_kwargs(qname):
    """(the ops' keyword arguments for format `qname`, its QuantSpec)."""
    quant, opts = QUANTS[qname]
    kw = dict(quant=quant, **opts)
    if quant == "fp8":
        kw["scale"] = torch.tensor([0.05], device="cuda")
    if quant == "nvfp4":
        kw["global_scale"] = torch.tensor([448 * 6 / 12.0], device="cuda")
    return kw, quant_spec(qname)


def poisoned_outs(spec, M, H, dtype):
    from distnorm import formats
    from quant_check import poison_like
    outs = {"residual_out": poison_like(torch.empty(M, H, dtype=dtype, device="cuda")),
            "y_out": poison_like(torch.empty(M, H, dtype=dtype, device="cuda"))}
    if spec is not None:
        outs["q_out"] = poison_like(torch.empty(formats.q_shape(spec, M, H), dtype=formats.q_dtype(spec),
                                                device="cuda"))
        if formats.scales_geometry(spec, M, H) is not None:
            outs["scales_out"] = poison_like(formats.empty_scales(spec, M, H, "cuda"))
    return outs


def launched_key(world, algo, M, H, spec, residual, write_y, write_ar, dtype=torch.bfloat16,
                 buffer_bytes=BUFFER_BYTES, tuning=None) -> tuple:
    """The kernel (a distnorm.kernels.precompile key) one all-reduce call of M x H launches, as the
    call plans it (dispatch.planned_kernel_key: "auto", the lamport fallbacks, the sized forms and
    rows per CTA; `tuning`: the workspace's, default Tuning.from_env()). No CUDA: usable where the
    test files' kernel_keys list what tests/conftest.py compiles ahead."""
    from distnorm.collectives.dispatch import planned_kernel_key
    plain = not (residual or write_y or spec is not None)
    return ("allreduce", *planned_kernel_key(algo, world, M, H, dtype, buffer_bytes, spec, residual,
                                             False, write_y, write_ar, plain, tuning)[2])


def scatter_keys(world, M, H, spec, write_ys=(True,), tuning=None, dtype=torch.bfloat16) -> list:
    """Every reduce-scatter kernel a sequence-parallel call of M x H (with a residual) may launch,
    gathered or not: "reducescatter" and, with a format, "rsgather" (q gathered in its epilogue),
    each with spec's scales and linear ones (NOTE [gathered scales]), y written or not as write_ys
    says. A few more than a call takes: compiling ahead costs little, a kernel missed here compiles
    inside the test on every rank (tests/precompile_keys.py)."""
    from distnorm.collectives.dispatch import allreduce_kernel_key
    from distnorm.collectives.rowsplit import linear_spec
    nbytes = world * -(-M // world) * H * dtype.itemsize  # one launch over the padded rows
    specs = [None] if spec is None else list(dict.fromkeys([spec, linear_spec(spec)]))
    algos = ("reducescatter",) if spec is None else ("reducescatter", "rsgather")
    return [("allreduce", *allreduce_kernel_key(algo, world, dtype, H, s, True, False,
                                                write_y or spec is None, False, tuning, nbytes))
            for algo in algos for s in specs for write_y in write_ys]


def one_case_keys(world, algo, qname, M, H, dtype=torch.bfloat16) -> list:
    """The kernels one_case launches: the fused call (residual, y and the all-reduce written) and,
    for "none", the plain allreduce()."""
    spec = quant_spec(qname)
    keys = [launched_key(world, algo, M, H, spec, True, True, True, dtype)]
    if qname == "none":
        keys.append(launched_key(world, algo, M, H, None, False, False, True, dtype))
    return keys


def check_outputs(out, ref, spec, kw, M, H):
    from quant_check import assert_quant_close, assert_y_close
    assert torch.equal(out.residual.view(torch.int16), ref.residual.view(torch.int16)), \
        f"residual not bitwise equal at {(out.residual.view(torch.int16) != ref.residual.view(torch.int16)).sum().item()} elements"
    assert torch.equal(out.allreduce.view(torch.int16), ref.allreduce.view(torch.int16)), "allreduce_out differs"
    assert_y_close(out.y, ref.y)
    if spec is not None:
        assert_quant_close(out.q, out.scales, ref, spec, M, H, scale=kw.get("scale"),
                           global_scale=kw.get("global_scale"))


def output_digests(out, spec) -> list:
    """SHA-256 of each output's bytes: compared across ranks after the checks (gathered as
    objects, so a rank that failed its checks never meets the others in a tensor collective)."""
    tensors = [out.residual, out.y, out.allreduce]
    if spec is not None:
        tensors.append(out.q)
        if spec.kind != "fp8":
            tensors.append(out.scales)
    return [hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            for t in tensors]


def assert_same_across_ranks(boot, digests) -> None:
    every = boot.all_gather_object(digests)
    for r, d in enumerate(every):
        differ = [i for i, (a, b) in enumerate(zip(d, every[0])) if a != b]
        assert not differ, f"outputs {differ} of rank {r} differ from rank 0's"


def algo_capacity_rows(algo, world, H, spec):
    from distnorm.collectives.plan import max_chunk_rows
    swz = spec is not None and spec.block_scaled and spec.sf_layout == "swizzled"
    try:
        return max_chunk_rows(algo, world, 1 << 30, H, 2, BUFFER_BYTES, swz, True)
    except ValueError:
        # lamport area < 128 rows with swizzled scales: the op runs one-shot for such M instead
        assert algo == "lamport" and swz
        return max_chunk_rows(algo, world, 1 << 30, H, 2, BUFFER_BYTES, False, True)


def one_case(ws, boot, algo, qname, M, H, seed, dtype=torch.bfloat16):
    """One call checked here against the reference; returns the outputs' digests. Every collective
    (the all-gather of x, the two ops) comes before the first check, so a failed check on one rank
    never leaves the others in a collective. fp16 inputs carry no +-B terms (2^18 is past fp16's
    range)."""
    from distnorm.collectives import allreduce, allreduce_add_rmsnorm
    from distnorm.reference import allreduce_add_rmsnorm_ref, allreduce_ref

    kw, spec = quant_kwargs(qname)
    x, res, w = make_inputs(M, H, ws.rank, seed, dtype,
                        world=ws.world_size if dtype == torch.bfloat16 else None)
    xs = _all_gather(x)
    ref = allreduce_add_rmsnorm_ref(xs, res, w, 1e-6, norm_out=True, allreduce_out=True, **kw)
    outs = poisoned_outs(spec, M, H, x.dtype)
    out = allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws, algo=algo, norm_out=True,
                                allreduce_out=True, **kw, **outs)
    plain = allreduce(x, workspace=ws, algo=algo) if qname == "none" else None  # same kernels
    torch.cuda.synchronize()
    ws.raise_if_failed()
    check_outputs(out, ref, spec, kw, M, H)
    if plain is not None:
        assert torch.equal(plain.view(torch.int16), allreduce_ref(xs).view(torch.int16)), \
            "allreduce() differs"
    return output_digests(out, spec)


def checked_on_every_rank(boot, ws, what: str, algo, qname, M, H, seed,
                           dtype=torch.bfloat16) -> list:
    """one_case on every rank (failures gathered), then its outputs compared across ranks; an
    AssertionError names the case as `what`. Returns the outputs' digests (output_digests)."""
    try:
        digests = _gathered_check(boot, one_case, ws, boot, algo, qname, M, H, seed, dtype)
        assert_same_across_ranks(boot, digests)
        return digests
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None
