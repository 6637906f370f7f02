"""The Inductor pass that swaps all_reduce -> [add] -> RMSNorm -> [FP8 quant] for one distnorm call.

    import distnorm.fusion
    pass_ = distnorm.fusion.allreduce_fusion_pass(ws)
    model = torch.compile(model, options={"post_grad_custom_pre_pass": pass_})  # runs at compile

What it recognises is listed in distnorm/fusion/match.py; everything else is left untouched. Each
fused site is logged (logger "distnorm.fusion") and listed in `pass_.fused`; sites it saw but left
alone, with the reason, in `pass_.skipped`.

Numerics: the fused op computes what distnorm.allreduce_add_rmsnorm documents (docs/SEMANTICS.md),
not what the replaced torch code computes: the sum over ranks is a float32 sum in rank order
(NCCL's bf16 all-reduce rounds differently), y is rounded once (the Llama form rounds the normed
value to bf16 before the weight multiply, and quantizes from bf16 y; distnorm quantizes the float32
y), and the quantizers multiply by the correctly rounded reciprocal of the scale instead of
dividing. Outputs differ from the unfused graph's by about one bf16 / FP8 rounding step.
"""
from __future__ import annotations

import logging
import operator
from typing import Iterable, Optional, Union

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from distnorm.collectives.ops import _handle
from distnorm.comm.workspace import Workspace
from distnorm.formats import MAX_HIDDEN, MIN_HIDDEN, VEC, make_quant_spec, spec_code
from distnorm.fusion.match import Site, find_sites
from distnorm.fusion.op import fused_allreduce_add_rmsnorm

__all__ = ["AllReduceFusionPass", "allreduce_fusion_pass"]

log = logging.getLogger("distnorm.fusion")


def _group_name(ws: Workspace) -> Optional[str]:
    group = getattr(ws, "group", None)
    if group is None:  # WORLD
        import torch.distributed as dist
        group = dist.group.WORLD if dist.is_initialized() else None
    return getattr(group, "group_name", None)


class AllReduceFusionPass(CustomGraphPass):
    """A post-grad graph pass (torch._inductor.config.post_grad_custom_pre_pass or _post_pass).

    workspaces: the distnorm workspaces of the process groups whose all-reduces may be fused (each
    built over a torch.distributed ProcessGroup); all-reduces over other groups stay.
    algo: the fused op's algorithm ("auto" by default).
    """

    def __init__(self, workspaces: Union[Workspace, Iterable[Workspace]], algo: str = "auto"):
        wss = [workspaces] if isinstance(workspaces, Workspace) else list(workspaces)
        if not wss or not all(isinstance(w, Workspace) for w in wss):
            raise TypeError("workspaces must be a distnorm.Workspace or an iterable of them")
        self.by_group = {}
        for ws in wss:
            name = _group_name(ws)
            if name is None:
                raise ValueError("workspaces must be built over a torch.distributed ProcessGroup "
                                 "(an MPI communicator has no name in a compiled graph)")
            self.by_group[name] = ws
        self.algo = algo
        self.fused: list[str] = []
        self.skipped: list[str] = []

    def uuid(self) -> Optional[bytes]:
        # The graph it writes names a workspace of this process: never reuse it from a cache.
        return None

    def __call__(self, graph: fx.Graph) -> None:
        seen: set = set()
        while True:  # one site at a time: a rewrite replaces nodes the next site may read
            site = next((s for s in find_sites(graph) if s.all_reduce not in seen), None)
            if site is None:
                break
            seen.add(site.all_reduce)
            reason = self._why_not(site) or _order_problem(graph, site)
            if reason:
                self.skipped.append(f"{site.describe()}: {reason}")
                log.info("distnorm.fusion: left alone %s: %s", site.describe(), reason)
                continue
            self._rewrite(graph, site)
            self.fused.append(site.describe())
            log.info("distnorm.fusion: fused %s", site.describe())
        graph.lint()

    def _why_not(self, site: Site) -> str:
        if site.group not in self.by_group:
            return f"no distnorm workspace for process group {site.group!r}"
        H = site.x.meta["val"].shape[-1]
        if not isinstance(H, int) or H % VEC or not MIN_HIDDEN <= H <= MAX_HIDDEN:
            return f"H={H} is not a multiple of {VEC} in [{MIN_HIDDEN}, {MAX_HIDDEN}]"
        return ""

    def _rewrite(self, graph: fx.Graph, site: Site) -> None:
        inner = set(site.inner)
        terminals = {site.wait, site.h, site.y}
        chain = inner | terminals | {site.all_reduce} | {n for n in (site.q, site.scales) if n}
        # outputs the rest of the graph still reads
        want_h = site.residual is not None
        wait_users = [u for u in site.wait.users if u not in chain]
        y_users = [u for u in site.y.users if u not in chain]
        norm_out = site.quant is None or bool(y_users)  # (a float32-only y has none: match.py)
        allreduce_out = bool(wait_users)
        spec = make_quant_spec(site.quant)
        args = (site.x, site.residual, site.weight, site.eps, spec_code(spec), site.scale,
                norm_out, allreduce_out, _handle(self.by_group[site.group]), self.algo)
        with graph.inserting_after(_last_input({n: i for i, n in enumerate(graph.nodes)}, site)):
            fused = graph.call_function(torch.ops.distnorm.fused_allreduce_add_rmsnorm.default, args)
        fused.meta["val"] = _fake_call(args)
        outs = []
        with graph.inserting_after(fused):
            for i in reversed(range(5)):
                node = graph.call_function(operator.getitem, (fused, i))
                node.meta["val"] = fused.meta["val"][i]
                outs.insert(0, node)
        h_out, y_out, q_out, s_out, ar_out = outs
        if want_h:
            site.h.replace_all_uses_with(h_out, delete_user_cb=lambda u: u not in chain)
        site.wait.replace_all_uses_with(ar_out, delete_user_cb=lambda u: u not in chain)
        site.y.replace_all_uses_with(y_out, delete_user_cb=lambda u: u not in chain)
        if site.q is not None:
            site.q.replace_all_uses_with(q_out)
        if site.scales is not None:
            site.scales.replace_all_uses_with(s_out)
        _erase(graph, chain)
        for node in outs:
            if not node.users:
                graph.erase_node(node)


def _fake_call(args):
    from torch._guards import detect_fake_mode

    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode:
        return fused_allreduce_add_rmsnorm(*vals)


def _order_problem(graph: fx.Graph, site: Site) -> str:
    """Why the fused op cannot go after its last input (a replaced output is read before it)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    at = order[_last_input(order, site)]
    chain = set(site.inner) | {site.wait, site.h, site.y, site.q, site.scales}
    for out in chain - {None}:
        early = [u for u in out.users if u not in chain and order[u] <= at]
        if early:
            return f"{early[0]} reads {out} before the fused op's last input is ready"
    return ""


def _last_input(order: dict, site: Site) -> fx.Node:
    """The latest of the fused op's inputs (and the all_reduce) in graph order (node -> index)."""
    inputs = [n for n in (site.all_reduce, site.x, site.residual, site.weight, site.scale) if n]
    return max(inputs, key=order.__getitem__)


def _erase(graph: fx.Graph, chain: set) -> None:
    """Erase the replaced nodes, users first."""
    for node in reversed(list(graph.nodes)):
        if node in chain:
            if node.users:
                raise RuntimeError(f"distnorm.fusion: {node} is still used by {list(node.users)}")
            graph.erase_node(node)


def allreduce_fusion_pass(workspaces: Union[Workspace, Iterable[Workspace]],
                          algo: str = "auto") -> AllReduceFusionPass:
    """The pass for `workspaces`: give it to torch.compile as
    options={"post_grad_custom_pre_pass": pass_} (distnorm/fusion/__init__.py says why not through
    torch._inductor.config)."""
    return AllReduceFusionPass(workspaces, algo)
