"""Timing helpers shared by the benchmarks: CUDA-graph replays timed with events, median of repeats."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_graph_us(fn: Callable[[], object], calls_per_graph: int = 20, repeats: int = 20,
                  warmup: int = 3, stats: bool = False, prequeue: bool = False):
    """Median microseconds per call of `fn`, captured `calls_per_graph` times in one CUDA graph
    (with stats: (median, min, max) over the repeats).

    prequeue: hold the GPU in a sleep kernel while the host enqueues every replay, each between two
    events, and synchronize once. Multi-GPU calls wait for their peers, so a host hiccup on one rank
    between synchronized replays shows up as a slow replay on every rank (seen: whole cases 10x
    slow, 2026-11-21); queued replays run back to back and only the first absorbs the ranks' skew.
    """
    g = capture_graph(fn, calls_per_graph, warmup)
    times = []
    if prequeue:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        torch.cuda._sleep(_SLEEP_CYCLES)  # ~2 ms: longer than enqueueing the replays takes
        events[0].record()
        for i in range(repeats):
            g.replay()
            events[i + 1].record()
        events[-1].synchronize()
        times = [events[i].elapsed_time(events[i + 1]) * 1000.0 / calls_per_graph
                 for i in range(1, repeats)]  # the first replay absorbs the skew between ranks
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / calls_per_graph)
    del g
    if stats:
        return statistics.median(times), min(times), max(times)
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], calls: int, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """`fn` called `warmup` times (compiles, allocations), then captured `calls` times in one CUDA
    graph on a side stream, replayed once and synchronized: ready to time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    torch.cuda.synchronize()
    return g


_SLEEP_CYCLES = 4_000_000


def write_table(out: str, text: str, record: dict) -> None:
    """Print the markdown table `text` and write it to <out>.md, `record` to <out>.json (the
    single-GPU benchmarks' results: device, command, rows)."""
    import json

    print(text)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump(record, f, indent=1)


def copy_bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written) in TB/s, by an SM copy kernel.

    Not `b.copy_(a)`: captured in a CUDA graph it becomes a memcpy node that runs on the copy
    engines, 2.71 TB/s on an H200 against ~4.2 TB/s for a kernel (seen 2026-11-23)."""
    a = torch.randn(nbytes // 8, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    us = time_graph_us(lambda: torch.mul(a, 1.0, out=b), calls_per_graph=5, repeats=10)
    return 2 * a.numel() * a.element_size() / (us * 1e-6) / 1e12


def host_us_per_call(fn: Callable[[], object], n: int = 2000, warmup: int = 100) -> float:
    """Host microseconds per call of `fn` (no synchronization between calls): what a CPU-bound
    caller pays to launch it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def time_eager_us(fn: Callable[[], object], calls: int = 20, repeats: int = 10) -> float:
    """Median microseconds per call of `fn` launched eagerly (no graph): for chains that cannot be
    captured (they create tensors on the host)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def unfused_tail(h_in, res, w, inv, eps: float = 1e-6):
    """What a user writes after a plain all-reduce / reduce-scatter: residual add, RMSNorm in
    float32, static FP8 (inv = 1 / scale). Returns (h, q): bf16 [M, H], float8_e4m3fn [M, H]."""
    h = h_in + res
    var = h.float().pow(2).mean(-1, keepdim=True)
    y = h.float() * torch.rsqrt(var + eps) * w.float()
    return h, (y * inv).clamp(-448, 448).to(torch.float8_e4m3fn)


def plot_us_per_m(path: str, meta: dict, rows: list, series) -> None:
    """us per call against M, one log-log panel per H of `rows` (dicts with "M", "H"); series:
    (label, line style, row -> us or None) per line. Title: meta's world and device."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hiddens = sorted({r["H"] for r in rows})
    fig, axes = plt.subplots(1, len(hiddens), figsize=(6 * len(hiddens), 4.5), squeeze=False)
    for ax, H in zip(axes[0], hiddens):
        rs = [r for r in rows if r["H"] == H]
        for label, style, value in series:
            pts = [(r["M"], value(r)) for r in rs]
            pts = [(m, v) for m, v in pts if v]
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("us per call (max over ranks)")
        ax.set_title(f"H={H}, {meta['world']} x {meta['device']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
