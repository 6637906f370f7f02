"""Microseconds per call of a GPU function: a CUDA graph of `calls` calls (eager calls when the
function cannot be captured), replayed `repeats` times between CUDA events; the median."""
from __future__ import annotations

import statistics
from typing import Callable

import torch

CALLS_PER_GRAPH = 10
WARMUP_CALLS = 3


def _capture(fn: Callable[[], object], calls: int):
    """A CUDA graph of `calls` calls of fn, or None when fn cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    except Exception:  # noqa: BLE001 - any capture failure means: time it eagerly
        torch.cuda.synchronize()
        return None
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def time_us(fn: Callable[[], object], repeats: int,
            agree: Callable[[bool], bool] = lambda ok: ok) -> tuple:
    """(median us per call, True when timed as a CUDA graph) of fn on the current GPU.

    agree: takes this process's "captured" and returns whether every rank captured; multi-GPU
    callers pass an all-reduce so that all ranks replay graphs or all call eagerly (graphs on some
    ranks and eager calls on others would run different collectives and hang).
    """
    for _ in range(WARMUP_CALLS):  # compiles kernels and sets up communicators before capture
        fn()
    torch.cuda.synchronize()
    graph = _capture(fn, CALLS_PER_GRAPH)
    if not agree(graph is not None):
        graph = None

    def run_calls() -> None:
        if graph is not None:
            graph.replay()
        else:
            for _ in range(CALLS_PER_GRAPH):
                fn()

    run_calls()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        run_calls()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / CALLS_PER_GRAPH)
    return statistics.median(times), graph is not None
