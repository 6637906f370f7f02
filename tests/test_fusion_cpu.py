"""The fusion pass (distnorm/fusion) on the CPU: two gloo ranks, a CPU workspace (the ops run
through torch.distributed and the reference), toy tensor-parallel graphs compiled by Inductor.

The pass must fuse exactly the recognised chains (F.rms_norm and Llama RMSNorm, with and without a
residual, static and per-token FP8 in plain torch), leave the others alone, and the compiled
outputs must be bitwise distnorm's (the reference over the gathered partial sums) and close to the
unfused model's (about one bf16 / FP8 rounding step: graph_pass.py says why they differ).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cute_compile import skip_inductor_cpu_check_where_a_gpu_is
from distnorm.launch import spawn

H = 256


def _model(kind: str, w: torch.Tensor, scale: torch.Tensor):
    import torch.distributed as dist
    from distnorm.fusion import fp8_per_token_quant, fp8_static_quant, rms_norm_llama

    def f(x, residual):
        x = x * 1.0  # a partial sum computed in the graph, as a row-parallel GEMM's output is
        dist.all_reduce(x)
        if kind == "no_residual":
            return (F.rms_norm(x, (H,), w, 1e-6),)
        h = x + residual if kind != "residual_first" else residual + x
        if kind == "llama":
            return h, rms_norm_llama(h, w, 1e-5)
        if kind == "fused_op":  # F.rms_norm as the single aten op some backends keep
            return h, torch.ops.aten._fused_rms_norm(h, [H], w, 1e-6)[0]
        y = F.rms_norm(h, (H,), w, 1e-6)
        if kind == "static":
            return h, fp8_static_quant(y, scale)
        if kind == "per_token":
            return (h, *fp8_per_token_quant(y))
        if kind == "y_and_quant":
            return (h, y, *fp8_per_token_quant(y))
        if kind == "not_rmsnorm":  # layer norm: left alone
            return h, F.layer_norm(h, (H,))
        if kind == "inner_used":  # the variance is also an output: the chain cannot go
            var = h.float().pow(2).mean(-1, keepdim=True)
            return h, (h.float() * torch.rsqrt(var + 1e-6)).to(h.dtype) * w, var
        return h, y
    return f


KINDS = {  # kind -> (sites the pass must fuse, distnorm options of the fused call)
    "plain": (1, dict()), "residual_first": (1, dict()), "llama": (1, dict()),
    "fused_op": (1, dict()),
    "no_residual": (1, dict()), "static": (1, dict(quant="fp8")),
    "per_token": (1, dict(quant="fp8_per_token")), "y_and_quant": (1, dict(quant="fp8_per_token")),
    "not_rmsnorm": (0, dict()), "inner_used": (0, dict()),
}


def _rows(kind: str) -> int:
    """Each kind's activations are [2, rows, H] with rows of its own: the pass's log of a fused site
    names the all_reduce's shape, which then says which kind it was."""
    return 1 + list(KINDS).index(kind)


def _compile_with_pass(fn, fusion, *args):
    torch._dynamo.reset()
    torch._inductor.config.post_grad_custom_pre_pass = fusion
    try:
        return torch.compile(fn, fullgraph=True)(*args)
    finally:
        torch._inductor.config.post_grad_custom_pre_pass = None


def _body() -> None:
    """Every kind in one compiled graph (one Inductor compile per rank instead of one per kind),
    each on inputs of its own shape."""
    import re

    import torch.distributed as dist

    import distnorm
    from distnorm.fusion import allreduce_fusion_pass

    rank = dist.get_rank()
    torch.manual_seed(0)
    w = (torch.rand(H) + 0.5).to(torch.bfloat16)
    scale = torch.tensor([0.05])
    residuals = [torch.randn(2, _rows(kind), H).to(torch.bfloat16) for kind in KINDS]
    torch.manual_seed(1 + rank)
    xs = [(torch.randn(2, _rows(kind), H) * 2).to(torch.bfloat16) for kind in KINDS]
    models = [_model(kind, w, scale) for kind in KINDS]

    def every_kind(xs, residuals):
        return [model(x, res) for model, x, res in zip(models, xs, residuals)]

    ws = distnorm.Workspace(dist.group.WORLD, device="cpu")
    fusion = allreduce_fusion_pass(ws)
    compiled = _compile_with_pass(every_kind, fusion, [x.clone() for x in xs], residuals)
    fused_rows = sorted(int(re.match(r"all_reduce\(\(2, (\d+), ", d).group(1)) for d in fusion.fused)
    assert fused_rows == sorted(_rows(k) for k, (sites, _) in KINDS.items() for _ in range(sites)), \
        (fusion.fused, fusion.skipped)
    eagers = every_kind([x.clone() for x in xs], residuals)
    for (kind, (sites, opts)), x, residual, got, eager in zip(KINDS.items(), xs, residuals, compiled,
                                                              eagers):
        _check_kind(kind, sites, opts, x, residual, got, eager, w, scale)
    # a workspace of another group: the WORLD all-reduce is seen, and left alone with the reason
    pair = dist.new_group([0, 1])
    other = distnorm.Workspace(pair, device="cpu")
    fusion = allreduce_fusion_pass(other)
    _compile_with_pass(_model("plain", w, scale), fusion, xs[0].clone(), residuals[0])
    assert not fusion.fused and len(fusion.skipped) == 1 and "no distnorm workspace" in \
        fusion.skipped[0], fusion.skipped
    other.close()
    ws.close()


def _check_kind(kind, sites, opts, x, residual, got, eager, w, scale) -> None:
    """Compiled outputs `got` against the unfused model's (`eager`, close) and, where fused,
    against distnorm's reference over the gathered partial sums (bitwise)."""
    import torch.distributed as dist

    from distnorm.reference import allreduce_add_rmsnorm_ref

    for g, e in zip(got, eager):
        assert g.shape == e.shape and g.dtype == e.dtype, (kind, g.shape, e.shape)
        if g.dtype == torch.float8_e4m3fn:
            # one e4m3 step, or a bf16 rounding of the sum (large where x + residual cancels)
            tol = 0.02 * e.float().abs().max().item()
            bad = ~torch.isclose(g.float(), e.float(), rtol=0.13, atol=tol)
            assert not bad.any(), (kind, g.float()[bad][:5], e.float()[bad][:5])
            assert (g.view(torch.uint8) == e.view(torch.uint8)).float().mean() > 0.9, kind
        else:
            assert torch.allclose(g.float(), e.float(), rtol=0.02, atol=0.02), kind
    if not sites:
        return
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    shape = x.shape[:-1]
    rows = [t.view(-1, H) for t in parts]
    res = None if kind == "no_residual" else residual.view(-1, H)
    ref = allreduce_add_rmsnorm_ref(rows, res, w, 1e-5 if kind == "llama" else 1e-6,
                                    scale=scale, norm_out=True, **opts)
    ref = ref._replace(**{k: getattr(ref, k).view(*shape, -1) for k in ("residual", "y", "q")
                          if getattr(ref, k) is not None})
    if kind == "no_residual":
        assert torch.equal(got[0], ref.y)
    else:
        assert torch.equal(got[0], ref.residual), kind
    if kind in ("plain", "residual_first", "llama", "fused_op"):
        assert torch.equal(got[1], ref.y), kind
    if kind in ("static", "per_token", "y_and_quant"):
        qi = 2 if kind == "y_and_quant" else 1
        assert torch.equal(got[qi].view(torch.uint8), ref.q.view(torch.uint8)), kind
        if kind != "static":
            assert torch.equal(got[qi + 1], ref.scales.view(*shape, 1)), kind
        if kind == "y_and_quant":
            assert torch.equal(got[1], ref.y), kind


def test_fusion_pass_on_toy_tp_graphs():
    skip_inductor_cpu_check_where_a_gpu_is()
    spawn(_body, 2, timeout_s=600, cpu_only=True)


def test_matcher_on_a_graph_that_keeps_fused_rms_norm_whole():
    """Where Inductor keeps F.rms_norm as one aten._fused_rms_norm node (here built by hand: the
    CPU build decomposes it), the matcher still finds the site."""
    import operator

    import torch.fx as fx

    from distnorm.fusion.match import find_sites

    g = fx.Graph()
    x, res, w = (g.placeholder(n) for n in ("x", "res", "w"))
    vals = {x: torch.empty(4, H, dtype=torch.bfloat16), res: torch.empty(4, H, dtype=torch.bfloat16),
            w: torch.empty(H, dtype=torch.bfloat16)}
    for node, v in vals.items():
        node.meta["val"] = v
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    t = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    h = g.call_function(torch.ops.aten.add.Tensor, (t, res))
    norm = g.call_function(torch.ops.aten._fused_rms_norm.default, (h, [H], w, 1e-6))
    y = g.call_function(operator.getitem, (norm, 0))
    g.output((h, y))
    sites = find_sites(g)
    assert len(sites) == 1 and sites[0].y is y and sites[0].weight is w and sites[0].eps == 1e-6
    assert sites[0].residual is res and sites[0].inner == [norm]


def test_matcher_when_the_bf16_round_trip_of_y_was_dropped():
    """torch 2.11's Inductor turns convert(convert(n * w, bf16), f32) into convert(n * w, f32) when
    only a quantizer reads y (seen on an H200 machine): fused only with that quantizer."""
    import torch.fx as fx

    from distnorm.fusion.match import find_sites

    aten, prims = torch.ops.aten, torch.ops.prims
    for with_quant in (True, False):
        g = fx.Graph()
        x, res, w, scale = (g.placeholder(n) for n in ("x", "res", "w", "scale"))
        for node, v in ((x, torch.empty(4, H, dtype=torch.bfloat16)),
                        (res, torch.empty(4, H, dtype=torch.bfloat16)),
                        (w, torch.empty(H, dtype=torch.bfloat16)), (scale, torch.empty(1))):
            node.meta["val"] = v
        ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
        t = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
        h = g.call_function(aten.add.Tensor, (t, res))
        hf = g.call_function(prims.convert_element_type.default, (h, torch.float32))
        sq = g.call_function(aten.pow.Tensor_Scalar, (hf, 2))
        ms = g.call_function(aten.mean.dim, (sq, [1], True))
        a = g.call_function(aten.add.Scalar, (ms, 1e-6))
        r = g.call_function(aten.rsqrt.default, (a,))
        n = g.call_function(aten.mul.Tensor, (hf, r))
        nw = g.call_function(aten.mul.Tensor, (n, w))
        yf = g.call_function(prims.convert_element_type.default, (nw, torch.float32))
        if with_quant:
            d = g.call_function(aten.div.Tensor, (yf, scale))
            lo = g.call_function(aten.clamp_min.default, (d, -448.0))
            hi = g.call_function(aten.clamp_max.default, (lo, 448.0))
            q = g.call_function(prims.convert_element_type.default, (hi, torch.float8_e4m3fn))
            g.output((h, q))
        else:
            g.output((h, yf))
        sites = find_sites(g)
        if with_quant:
            assert len(sites) == 1 and sites[0].quant == "fp8" and sites[0].q is q
        else:
            assert sites == []  # a float32 y read by anything else cannot come from distnorm
