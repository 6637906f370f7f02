"""The all-reduce ops' state of one workspace, kept on the workspace (``Workspace.op_state``) and
dropped with it by ``close()``: tuning, the Lamport area table, one-time checks and small caches.
Nothing here refers back to the workspace, so a closed or forgotten workspace is freed with it.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch import Tensor

from distnorm.collectives.layout import (LAMPORT_AREAS, LAMPORT_SENTINEL_I32, LAMPORT_STATE_WORDS,
                                         REGION_LAMPORT, REGION_WORDS, check_signal_pad,
                                         lamport_split, region_word)
from distnorm.collectives.plan import ALGORITHMS, Tuning
from distnorm.formats import QuantSpec

__all__ = ["AllReduceState", "state_of", "zero_region"]

_handles = itertools.count(1)  # never reused, unlike id(): a handle names one workspace for good


class AllReduceState:
    """Per-workspace state of the all-reduce ops (see the module docstring).

    tuning: launch settings (plan.Tuning; from the environment unless given).
    handle: the workspace's number in the custom ops' schema (ops.py; never reused).
    lamport_ptrs: int64 [3 * world] device table of every rank's lamport areas (entry k * world + s =
      rank s's area k), built when the areas are first filled with the sentinel.
    """

    def __init__(self, tuning: Optional[Tuning] = None) -> None:
        self.tuning = Tuning.from_env() if tuning is None else tuning
        self.handle = next(_handles)
        self.lamport_ptrs: Optional[Tensor] = None
        self.fallback_logged = False
        self._signal_checked = False
        self._grid_caps: dict = {}
        self._ones: dict = {}

    def check_signal_pad(self, ws) -> None:
        """Once: the workspace's signal pad holds every region and the group fits the kernels."""
        if not self._signal_checked:
            check_signal_pad(ws.signal_bytes, ws.world_size)
            self._signal_checked = True

    def lamport_table(self, ws) -> Tensor:
        """The area table; on the first lamport call, fill the areas first (collective)."""
        if self.lamport_ptrs is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "distnorm: the first lamport all-reduce on a workspace prepares its buffers "
                    "(collective, not capturable): make one call with algo='lamport' (or call "
                    "distnorm.collectives.reset(ws) on every rank) before CUDA-graph capture")
            self.prepare_lamport(ws)
        return self.lamport_ptrs

    def prepare_lamport(self, ws) -> None:
        """Fill this rank's three lamport areas with the sentinel, zero the lamport call state,
        then a host barrier; build the area table. Collective: every rank, while no kernel of `ws`
        runs."""
        self.check_signal_pad(ws)
        general, area = lamport_split(ws.buffer_bytes)
        words = ws.local_buffer(torch.int32, (ws.buffer_bytes // 4,))
        with torch.cuda.device(ws.device):
            torch.cuda.synchronize(ws.device)
            words[general // 4:(general + LAMPORT_AREAS * area) // 4].fill_(LAMPORT_SENTINEL_I32)
            w0 = region_word(REGION_LAMPORT)
            ws.peer_signal(ws.rank)[w0:w0 + LAMPORT_STATE_WORDS].zero_()
            torch.cuda.synchronize(ws.device)
        del words
        ws.barrier()
        ptrs = [p + general + k * area for k in range(LAMPORT_AREAS) for p in ws.buffer_ptrs_host]
        self.lamport_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=ws.device)

    def reset(self, ws) -> None:
        """After a timeout: clear the error words, zero the barrier regions and refill the lamport
        areas. Collective: every rank, while no kernel of `ws` runs anywhere."""
        ws.reset_error()
        for algorithm in ALGORITHMS.values():
            zero_region(ws, algorithm.region)
        self.prepare_lamport(ws)

    def grid_cap(self, device: torch.device, hidden: int, spec: QuantSpec, rows_per_cta: int) -> int:
        """Most CTAs of one all-reduce launch: all of them co-resident (kernels/allreduce.py)."""
        key = (hidden, spec, rows_per_cta)
        n = self._grid_caps.get(key)
        if n is None:
            from distnorm.kernels.compile_allreduce import allreduce_tiling, co_resident_ctas_per_sm
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            n = sms * co_resident_ctas_per_sm(allreduce_tiling(hidden, spec, rows_per_cta))
            self._grid_caps[key] = n
        return n

    def ones(self, x: Tensor) -> Tensor:
        """A ones weight [H] of x's dtype and device (the plain all-reduce's unused norm weight)."""
        key = (x.device, x.dtype, x.shape[1])
        w = self._ones.get(key)
        if w is None:
            w = self._ones[key] = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
        return w


def state_of(ws) -> AllReduceState:
    """The workspace's AllReduceState (made on first use)."""
    return ws.op_state("allreduce", AllReduceState)


def zero_region(ws, region: int) -> None:
    """Zero this rank's copy of a barrier region (epochs and flags). Collective in effect: every
    rank, while no kernel using the region runs anywhere, then a host barrier before the next
    launch."""
    w0 = region_word(region)
    with torch.cuda.device(ws.device):
        ws.peer_signal(ws.rank)[w0:w0 + REGION_WORDS].zero_()
        torch.cuda.synchronize(ws.device)
