"""Every op's argument contract, on the CPU and (when present) on a GPU: [..., H] inputs flattened
without a copy and outputs of x's leading shape; the library's own error for each bad argument;
value checks (DISTNORM_CHECK=1 / set_value_checks) that catch bad scales and non-finite inputs."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import distnorm
from bad_calls import BAD_CASES, bad_call, inputs as _inputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SCALARS = {"scale": 0.05, "global_scale": 200.0}


def _kwargs(quant, opts, device):
    from distnorm.formats import FORMATS
    scalar = FORMATS[quant or "none"].scalar
    extra = {scalar: torch.tensor([SCALARS[scalar]], device=device)} if scalar else {}
    return dict(quant=quant, **opts, **extra)


def _bytes(t):
    return None if t is None else t.contiguous().view(torch.uint8)


@pytest.fixture
def value_checks():
    previous = distnorm.set_value_checks(True)
    yield
    distnorm.set_value_checks(previous)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, quant, opts", [v for v in __import__("distnorm.formats", fromlist=["x"])
                                               .format_variants() if "ue8m0" not in v[0]])
@pytest.mark.parametrize("shape", [(2, 3, 512), (512,), (1, 1, 2, 512)])
def test_nd_inputs_match_their_rows(device, name, quant, opts, shape):
    """x [..., H] gives bitwise the outputs of x.view(-1, H), with x's leading shape (scales: the
    format's shape for the flattened M)."""
    x, res, w = _inputs(shape, device, seed=len(shape))
    kw = _kwargs(quant, opts, device)
    nd = distnorm.add_rmsnorm(x, res, w, 1e-6, norm_out=True, **kw)
    rows = distnorm.add_rmsnorm(x.view(-1, 512), res.view(-1, 512), w, 1e-6, norm_out=True, **kw)
    lead = tuple(shape[:-1])
    for a, b in ((nd.residual, rows.residual), (nd.y, rows.y), (nd.q, rows.q)):
        if b is None:
            assert a is None
            continue
        assert a.shape[:-1] == lead and a.shape[-1] == b.shape[-1]
        assert torch.equal(_bytes(a).reshape(_bytes(b).shape), _bytes(b))
    if rows.scales is not None:
        assert nd.scales.shape == rows.scales.shape and torch.equal(_bytes(nd.scales), _bytes(rows.scales))


@pytest.mark.parametrize("device", DEVICES)
def test_nd_outputs_passed_in_are_written_and_returned(device):
    x, res, w = _inputs((2, 4, 1024), device, seed=7)
    ref = distnorm.add_rmsnorm(x, res, w, quant="fp8_per_token", norm_out=True)
    res_out, y_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    q_out = torch.full((2, 4, 1024), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    out = distnorm.add_rmsnorm(x, res, w, quant="fp8_per_token", norm_out=True, residual_out=res_out,
                               y_out=y_out, q_out=q_out)
    assert out.residual is res_out and out.y is y_out and out.q is q_out
    assert torch.equal(res_out, ref.residual) and torch.equal(y_out, ref.y)
    assert torch.equal(_bytes(q_out), _bytes(ref.q))
    with pytest.raises(ValueError, match="residual_out must have leading shape"):
        distnorm.add_rmsnorm(x, res, w, residual_out=torch.empty(8, 1024, dtype=x.dtype, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_shape_and_stride_errors_are_ours(device):
    x, res, w = _inputs((6, 1024), device)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        distnorm.add_rmsnorm(x[:, ::2], None, w[:512])
    with pytest.raises(ValueError, match="residual must be contiguous in its last dim"):
        distnorm.add_rmsnorm(x[:, :512], res[:, ::2], w[:512])
    with pytest.raises(ValueError, match="weight must be contiguous"):
        distnorm.add_rmsnorm(x[:, :512], None, w.repeat_interleave(2)[::2][:512])
    xt = x.view(2, 3, 1024).transpose(0, 1)  # leading dims that cannot merge without a copy
    with pytest.raises(ValueError, match=r"x of shape \(3, 2, 1024\).*without a copy"):
        distnorm.add_rmsnorm(xt, None, w)
    misaligned = x.view(-1)[8:8 + 5 * 1024].view(5, 1024)  # rows start 16 bytes + 0: aligned
    distnorm.add_rmsnorm(misaligned, None, w)
    misaligned = x.view(-1)[4:4 + 5 * 1024].view(5, 1024)  # 8-byte offset
    with pytest.raises(ValueError, match="x rows must start at 16-byte aligned"):
        distnorm.add_rmsnorm(misaligned, None, w)
    y_out = torch.empty(6, 2048, dtype=x.dtype, device=device)[:, ::2]
    with pytest.raises(ValueError, match="y_out must be contiguous in its last dim"):
        distnorm.add_rmsnorm(x, None, w, y_out=y_out)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        distnorm.add_rmsnorm([1.0] * 1024, None, w)
    # an output on another device is caught, also where get_device() cannot tell (cpu vs meta: -1)
    with pytest.raises(ValueError, match=f"residual_out must be on {x.device}"):
        distnorm.add_rmsnorm(x, res, w, residual_out=torch.empty(6, 1024, dtype=x.dtype,
                                                                  device="meta"))


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), -1e-6, True, "1e-6", None])
def test_bad_eps(eps):
    x, res, w = _inputs((3, 512), "cpu")
    with pytest.raises(ValueError, match="eps must be a finite float >= 0"):
        distnorm.add_rmsnorm(x, res, w, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant, name, value", [
    ("fp8", "scale", 0.0), ("fp8", "scale", -0.5), ("fp8", "scale", float("inf")),
    ("fp8", "scale", float("nan")), ("nvfp4", "global_scale", 0.0),
    ("nvfp4", "global_scale", float("inf")), ("nvfp4", "global_scale", -3.0)])
def test_value_checks_catch_bad_scales(value_checks, device, quant, name, value):
    x, res, w = _inputs((3, 512), device)
    with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
        distnorm.add_rmsnorm(x, res, w, quant=quant, **{name: torch.tensor([value], device=device)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["x", "residual", "weight"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_value_checks_catch_non_finite_inputs(value_checks, device, which, bad):
    t = dict(zip(("x", "residual", "weight"), _inputs((3, 512), device)))
    t[which] = t[which].clone()
    t[which].view(-1)[5] = bad
    with pytest.raises(ValueError, match=f"{which} holds 1 non-finite"):
        distnorm.add_rmsnorm(t["x"], t["residual"], t["weight"])


def test_value_checks_are_off_by_default_and_switchable():
    x, res, w = _inputs((3, 512), "cpu")
    zero = torch.tensor([0.0])
    previous = distnorm.set_value_checks(False)
    try:
        distnorm.add_rmsnorm(x, res, w, quant="fp8", scale=zero)  # not read: no host sync by default
        assert distnorm.set_value_checks(True) is False
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            distnorm.add_rmsnorm(x, res, w, quant="fp8", scale=zero)
        with pytest.raises(TypeError, match="enabled must be a bool"):
            distnorm.set_value_checks(1)
    finally:
        distnorm.set_value_checks(previous)


def test_distnorm_check_env_turns_value_checks_on():
    code = ("import torch, distnorm\n"
            "x = torch.randn(2, 256).bfloat16(); w = torch.ones(256).bfloat16()\n"
            "try:\n"
            "    distnorm.add_rmsnorm(x, None, w, quant='fp8', scale=torch.tensor([-1.0]))\n"
            "except ValueError as e:\n"
            "    print('raised:', e)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DISTNORM_CHECK="1", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "raised: scale must be finite and > 0" in out.stdout, out.stderr[-2000:]


def test_readme_use_snippet_runs_as_written():
    """The README's single-GPU Use snippet runs as written (here on the CPU, on a GPU in GPU runs)."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        code = re.search(r"## Use\n\n```python\n(.*?)```", f.read(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    out = scope["out"]
    assert out.residual.shape == (4, 16, 4096) and out.q.shape == (4, 16, 2048)
    assert out.scales.shape == (128, 256)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_argument_errors_name_the_argument(device, case):
    """Every bad argument ends in the library's error naming it, on the CUDA fast path too."""
    call, message = bad_call(case, device, distnorm.add_rmsnorm)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        call()


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_rows_and_ignored_scalars(device):
    """x as a tensor subclass (an nn.Parameter) is rows like any tensor (it once recursed forever),
    and a scalar the format does not take is ignored rather than handed to the kernel."""
    x, res, w = _inputs((4, 512), device)
    want = distnorm.add_rmsnorm(x, res, w, quant="nvfp4", global_scale=torch.tensor([200.0], device=device))
    got = distnorm.add_rmsnorm(torch.nn.Parameter(x, requires_grad=False), res, w, quant="nvfp4",
                               global_scale=torch.tensor([200.0], device=device),
                               scale=torch.tensor([0.05], device=device))
    assert torch.equal(_bytes(got.q), _bytes(want.q)) and torch.equal(got.residual, want.residual)
    fp8 = distnorm.add_rmsnorm(x, res, w, quant="fp8", scale=torch.tensor([0.05], device=device),
                               global_scale=torch.tensor([1.0], device=device))
    ref = distnorm.add_rmsnorm(x, res, w, quant="fp8", scale=torch.tensor([0.05], device=device))
    assert torch.equal(_bytes(fp8.q), _bytes(ref.q))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs visible to this process")
def test_tensors_on_two_gpus_are_refused():
    """The eager CUDA path leaves the device index to the kernel's entry (one device-id variable
    per signature): a tensor on another GPU still ends in the library's error naming it."""
    x, res, w = _inputs((4, 512), "cuda:0")
    with pytest.raises(ValueError, match="weight must be a"):
        distnorm.add_rmsnorm(x, res, w.to("cuda:1"))
    with pytest.raises(ValueError, match="residual must be on cuda:0"):
        distnorm.add_rmsnorm(x, res.to("cuda:1"), w)
    with pytest.raises(ValueError, match="residual_out must be on cuda:0"):
        distnorm.add_rmsnorm(x, res, w, residual_out=torch.empty_like(res, device="cuda:1"))
    with pytest.raises(ValueError, match="scale must be on cuda:0"):
        distnorm.add_rmsnorm(x, res, w, quant="fp8", scale=torch.tensor([0.05], device="cuda:1"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel-checked path is the CUDA one")
@pytest.mark.parametrize("name, quant, opts", [v for v in __import__("distnorm.formats", fromlist=["x"])
                                               .format_variants() if "ue8m0" not in v[0]])
def test_eager_cuda_calls_skip_the_python_checks(monkeypatch, name, quant, opts):
    """A good eager CUDA call takes the kernel-checked path (the Python checks would cost it 5-10 us
    of host time) and gives the checked path's bytes (value checks on force that path)."""
    from distnorm import ops
    x, res, w = _inputs((5, 512), "cuda")
    kw = _kwargs(quant, opts, "cuda")
    previous = distnorm.set_value_checks(True)
    try:
        want = distnorm.add_rmsnorm(x, res, w, 1e-6, norm_out=True, **kw)
    finally:
        distnorm.set_value_checks(previous)

    def refuse(*args):
        raise AssertionError("the Python checks ran")
    monkeypatch.setattr(ops, "check_op_inputs", refuse)
    got = distnorm.add_rmsnorm(x, res, w, 1e-6, norm_out=True, **kw)
    passed = distnorm.add_rmsnorm(x, res, w, 1e-6, norm_out=True, **kw,
                                  residual_out=torch.empty_like(res), y_out=torch.empty_like(x),
                                  q_out=None if want.q is None else torch.empty_like(want.q),
                                  scales_out=None if want.scales is None or quant == "fp8"
                                  else torch.empty_like(want.scales))
    for out in (got, passed):
        for field in ("residual", "y", "q", "scales"):
            a, b = getattr(out, field), getattr(want, field)
            assert (a is None) == (b is None), field
            assert b is None or torch.equal(_bytes(a), _bytes(b)), field


def _buffer_views(device):
    """x [4, 512] and residual [4, 512] as the left halves of rows 0-3 and 4-7 of one [9, 1024]
    buffer (fresh random bf16): outputs carved from the same buffer test the overlap rule."""
    g = torch.Generator().manual_seed(11)
    buf = torch.randn(9, 1024, generator=g).to(torch.bfloat16).to(device)
    return buf, buf[:4, :512], buf[4:8, :512]


OVERLAPS = {  # output keywords carved from the buffer -> the output and input the error names
    "residual_out a row down": (lambda b: dict(residual_out=b[5:9, :512]), "residual_out overlaps residual"),
    "y_out 8 columns right": (lambda b: dict(y_out=b[:4, 8:520], norm_out=True), "y_out overlaps x"),
    "y_out over residual_out": (lambda b: dict(residual_out=b[4:8, 512:], y_out=b[4:8, 512:],
                                               norm_out=True), "y_out overlaps residual_out"),
    "q_out over x at another pitch": (lambda b: dict(
        quant="fp8_per_token", q_out=b.view(-1).view(torch.uint8)[:2048].view(4, 512).view(
            torch.float8_e4m3fn)), "q_out overlaps x"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(OVERLAPS))
def test_partially_overlapping_outputs_are_refused(device, case, value_checks):
    """An output sharing bytes with an input or another output, other than an input's own rows
    written in place, is a race between rows on the GPU: the checked path refuses it, naming both
    (the CPU, and CUDA with value checks on; the eager CUDA path leaves it out for host time)."""
    buf, x, res = _buffer_views(device)
    kwargs, message = OVERLAPS[case]
    before = buf.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        distnorm.add_rmsnorm(x, res, torch.ones_like(x[0]), **kwargs(buf))
    assert torch.equal(buf, before)  # refused before anything was written


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_beside_or_over_their_own_rows(device):
    """Outputs in the same buffer as the inputs but apart from them (the right column halves), or
    over an input's own rows (vLLM's in-place form, an FP8 q over x's rows) are taken, with the
    outputs of the same call out of place (on a GPU: the eager kernel path, in-place kernel)."""
    w = (torch.rand(512, generator=torch.Generator().manual_seed(3)) + 0.5).to(torch.bfloat16).to(device)
    _, x0, r0 = _buffer_views(device)
    want = distnorm.add_rmsnorm(x0.clone(), r0.clone(), w, quant="fp8_per_token", norm_out=True)
    for carve in (lambda b: dict(residual_out=b[4:8, 512:], y_out=b[:4, 512:]),
                  lambda b: dict(residual_out=b[4:8, :512], y_out=b[:4, :512]),
                  lambda b: dict(q_out=b.view(torch.uint8)[:4, :512].view(torch.float8_e4m3fn))):
        buf, x, res = _buffer_views(device)
        got = distnorm.add_rmsnorm(x, res, w, quant="fp8_per_token", norm_out=True, **carve(buf))
        for field in ("residual", "y", "q", "scales"):
            assert torch.equal(getattr(got, field).view(torch.uint8),
                               getattr(want, field).contiguous().view(torch.uint8)), field
