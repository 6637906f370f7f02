"""Finding all_reduce -> [residual add] -> RMSNorm -> [FP8 quant] in a post-grad FX graph.

Pure graph inspection (no rewriting): `find_sites(graph)` returns one `Site` per all_reduce whose
chain it recognises, each naming the nodes it would replace and those it would erase. What is
recognised (the post-grad forms of the code in distnorm/fusion/forms.py and of
torch.nn.functional.rms_norm, bf16/fp16 activations):

    ar = _c10d_functional.all_reduce(x, "sum", group); t = wait_tensor(ar)
    h  = t + residual   (either order; optional: without it the norm reads t)
    hf = convert(h, f32); ms = mean(hf ** 2 | hf * hf, [-1], keepdim); r = rsqrt(ms + eps)
    n  = hf * r;  y = convert(n * w, T)  (weight before the cast, F.rms_norm)
              or  y = convert(n, T) * w  (weight after the cast, Llama)
         or y = aten._fused_rms_norm(h, [H], w, eps)[0]  (F.rms_norm where Inductor keeps it whole)
         or yf = convert(n * w, f32) feeding the quantizer directly (torch 2.11 drops the T round trip)
    static FP8:    q = convert(clamp(yf / scale, -448, 448), e4m3)
    per-token FP8: s = clamp_min(amax(|yf|, [-1], keepdim), 1e-10) / 448;
                   q = convert(clamp(yf / s, -448, 448), e4m3)
with yf = convert(y, f32) or y itself. A chain whose inner values are used elsewhere is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from distnorm.formats import E4M3_MAX

__all__ = ["Site", "find_sites"]

aten, prims = torch.ops.aten, torch.ops.prims
_ACT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Site:
    """One fusable chain. Terminal nodes (whose users move to the fused op): wait (other users get
    the plain all-reduce output), h, y, q, scales. `inner`: every node the fused op replaces."""

    all_reduce: fx.Node
    wait: fx.Node
    x: fx.Node
    group: str
    residual: Optional[fx.Node]
    h: fx.Node
    weight: fx.Node
    eps: float
    y: fx.Node
    quant: Optional[str] = None          # None | "fp8" | "fp8_per_token"
    scale: Optional[fx.Node] = None      # static fp8's scale tensor
    q: Optional[fx.Node] = None
    scales: Optional[fx.Node] = None
    weight_after_cast: bool = False
    inner: list = field(default_factory=list)

    def describe(self) -> str:
        v = self.x.meta.get("val")
        shape = tuple(v.shape) if v is not None else "?"
        form = "Llama (weight after the cast)" if self.weight_after_cast else "F.rms_norm"
        return (f"all_reduce({shape}, group {self.group}) -> {'add -> ' if self.residual else ''}"
                f"RMSNorm[{form}, eps={self.eps:g}]" + (f" -> {self.quant}" if self.quant else ""))


def _is(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node: fx.Node):
    return node.meta.get("val")


def _only_user(node: fx.Node, *targets) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 and _is(users[0], *targets) else None


def _users(node: fx.Node, *targets) -> list:
    return [u for u in node.users if _is(u, *targets)]


def _other(node: fx.Node, known: fx.Node) -> Any:
    """The argument of a binary node that is not `known` (None if `known` is not an argument)."""
    a, b = node.args[0], node.args[1]
    return b if a is known else a if b is known else None


def _convert(node: Any, dtype) -> bool:
    return _is(node, prims.convert_element_type.default) and node.args[1] == dtype


def _last_dim(dims, ndim: int) -> bool:
    return list(dims) in ([-1], [ndim - 1])


def _number(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _clamp_to_fp8(node: fx.Node) -> Optional[tuple]:
    """node -> clamp(-448, 448) -> convert(e4m3): (q, [clamp nodes])."""
    chain = []
    cur = node
    c = _only_user(cur, aten.clamp.default)
    if c is not None and _number(c.args[1]) == -E4M3_MAX and _number(c.args[2]) == E4M3_MAX:
        chain, cur = [c], c
    else:
        lo = _only_user(cur, aten.clamp_min.default)
        hi = lo and _only_user(lo, aten.clamp_max.default)
        if not (hi and _number(lo.args[1]) == -E4M3_MAX and _number(hi.args[1]) == E4M3_MAX):
            return None
        chain, cur = [lo, hi], hi
    q = _only_user(cur, prims.convert_element_type.default)
    if q is None or q.args[1] != torch.float8_e4m3fn:
        return None
    return q, chain


def _match_quant(site: Site, y: fx.Node) -> None:
    """Attach the first static or per-token FP8 chain reading y (as y or convert(y, f32))."""
    starts = [y] + [u for u in y.users if _convert(u, torch.float32)]
    for yf in starts:
        for d in _users(yf, aten.div.Tensor):
            if d.args[0] is not yf or not isinstance(d.args[1], fx.Node):
                continue
            den = d.args[1]
            got = _clamp_to_fp8(d)
            if got is None:
                continue
            q, clamps = got
            # per-token: den = clamp_min(amax(abs(yf), [-1], True), 1e-10) / 448
            if (_is(den, aten.div.Tensor) and _number(den.args[1]) == E4M3_MAX
                    and _is(den.args[0], aten.clamp_min.default)):
                cm = den.args[0]
                am = cm.args[0]
                ab = am.args[0] if _is(am, aten.amax.default) else None
                if (ab is not None and _is(ab, aten.abs.default) and ab.args[0] is yf
                        and _last_dim(am.args[1], len(_val(yf).shape)) and am.args[2]
                        and _number(cm.args[1]) is not None
                        and abs(_number(cm.args[1]) - 1e-10) < 1e-16):
                    site.quant, site.q, site.scales = "fp8_per_token", q, den
                    site.inner += [ab, am, cm, d, *clamps] + ([yf] if yf is not y else [])
                    return
                continue
            sv = _val(den)
            if (den.op == "placeholder" or den.op == "get_attr") and sv is not None \
                    and sv.dtype == torch.float32 and sv.numel() == 1:
                site.quant, site.q, site.scale = "fp8", q, den
                site.inner += [d, *clamps] + ([yf] if yf is not y else [])
                return


_FUSED_RMS_NORM = getattr(aten, "_fused_rms_norm", None)


def _match_fused_op(h: fx.Node, x_val) -> Optional[dict]:
    """F.rms_norm kept as one aten._fused_rms_norm node (y = getitem 0; rstd unused)."""
    if _FUSED_RMS_NORM is None:
        return None
    for node in h.users:
        if not _is(node, _FUSED_RMS_NORM.default) or node.args[0] is not h:
            continue
        shape, w = list(node.args[1]), node.args[2] if len(node.args) > 2 else None
        eps = _number(node.args[3]) if len(node.args) > 3 else None
        users = list(node.users)
        y = users[0] if len(users) == 1 and _is(users[0], operator.getitem) \
            and users[0].args[1] == 0 else None
        wv = _val(w) if isinstance(w, fx.Node) else None
        if (y is None or eps is None or shape != [x_val.shape[-1]] or wv is None
                or tuple(wv.shape) != (x_val.shape[-1],) or wv.dtype != x_val.dtype):
            continue
        return dict(weight=w, eps=eps, y=y, inner=[node], after=False, y_float=False)
    return None


def _match_norm(t: fx.Node, h: fx.Node, x_val) -> Optional[dict]:
    """RMSNorm reading h: dict(weight, eps, y, inner, after) or None."""
    fused = _match_fused_op(h, x_val)
    if fused is not None:
        return fused
    dtype = x_val.dtype
    for hf in [u for u in h.users if _convert(u, torch.float32)]:
        sq = next((u for u in hf.users if (_is(u, aten.pow.Tensor_Scalar) and u.args[1] == 2)
                   or (_is(u, aten.mul.Tensor) and u.args[0] is hf and u.args[1] is hf)), None)
        mean = sq and _only_user(sq, aten.mean.dim)
        if not (mean and _last_dim(mean.args[1], len(x_val.shape))
                and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim"))):
            continue
        add = _only_user(mean, aten.add.Scalar, aten.add.Tensor)
        eps = add and _number(add.args[1])
        rs = add and _only_user(add, aten.rsqrt.default)
        n = rs and _only_user(rs, aten.mul.Tensor)
        if eps is None or rs is None or n is None or _other(n, rs) is not hf:
            continue
        inner = [hf, sq, mean, add, rs, n]
        if set(hf.users) != {sq, n}:
            continue
        nxt = _only_user(n, aten.mul.Tensor, prims.convert_element_type.default)
        if nxt is None:
            continue
        y_float = False
        if _is(nxt, aten.mul.Tensor):  # weight before the cast
            w = _other(nxt, n)
            y = _only_user(nxt, prims.convert_element_type.default)
            # convert(n * w, float32): Inductor dropped the T round trip of a y whose only reader
            # quantizes it (torch 2.11); fusable only together with that quantization
            y_float = y is not None and y.args[1] == torch.float32
            if y is None or (y.args[1] != dtype and not y_float):
                continue
            inner.append(nxt)
            after = False
        else:
            if nxt.args[1] != dtype:
                continue
            y = _only_user(nxt, aten.mul.Tensor)
            w = y and _other(y, nxt)
            inner.append(nxt)
            after = True
        wv = _val(w) if isinstance(w, fx.Node) else None
        if y is None or wv is None or tuple(wv.shape) != (x_val.shape[-1],) or wv.dtype != dtype:
            continue
        return dict(weight=w, eps=eps, y=y, inner=inner, after=after, y_float=y_float)
    return None


def _match_site(ar: fx.Node) -> Optional[Site]:
    if len(ar.args) < 3 or ar.args[1] != "sum" or not isinstance(ar.args[0], fx.Node):
        return None
    x = ar.args[0]
    x_val = _val(x)
    if x_val is None or x_val.dtype not in _ACT_DTYPES or x_val.dim() < 2:
        return None
    t = _only_user(ar, torch.ops._c10d_functional.wait_tensor.default)
    if t is None:
        return None
    candidates = []
    for add in _users(t, aten.add.Tensor):
        res = _other(add, t)
        rv = _val(res) if isinstance(res, fx.Node) else None
        if rv is not None and rv.shape == x_val.shape and rv.dtype == x_val.dtype:
            candidates.append((res, add))
    candidates.append((None, t))
    for res, h in candidates:
        norm = _match_norm(t, h, x_val)
        if norm is None:
            continue
        site = Site(all_reduce=ar, wait=t, x=x, group=str(ar.args[2]), residual=res, h=h,
                    weight=norm["weight"], eps=norm["eps"], y=norm["y"],
                    weight_after_cast=norm["after"], inner=list(norm["inner"]))
        _match_quant(site, site.y)
        if norm.get("y_float"):  # y exists only in float32: all of it must go into the quantizer
            inner = set(site.inner)
            if site.quant is None or any(u not in inner for u in site.y.users):
                continue
        return site
    return None


def find_sites(graph: fx.Graph) -> list[Site]:
    """Every recognised chain of `graph`, in graph order."""
    return [s for s in (_match_site(n) for n in graph.nodes
                        if _is(n, torch.ops._c10d_functional.all_reduce.default)) if s is not None]

