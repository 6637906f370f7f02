"""The all-reduce ops' state of one workspace, kept on the workspace (``Workspace.op_state``) and
dropped with it by ``close()``: tuning, the Lamport area table, one-time checks and small caches.
Nothing here refers back to the workspace, so a closed or forgotten workspace is freed with it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from distnorm.collectives.faults import host_barrier
from distnorm.collectives.layout import (CALL_W_HOST_BARRIER, CALL_W_LAMPORT_HDR,
                                         HOST_BARRIER_FIRST_CALL, HOST_BARRIER_RESET_A,
                                         HOST_BARRIER_RESET_B, LAMPORT_AREAS, LAMPORT_SENTINEL_I32,
                                         LAMPORT_STATE_WORDS, MAX_WORLD, REGION_LAMPORT,
                                         REGION_ROLES, REGION_WORDS, check_signal_pad,
                                         lamport_split, push_half, region_word)
from distnorm.collectives.plan import ALGORITHMS, Tuning
from distnorm.formats import QuantSpec

__all__ = ["AllReduceState", "state_of", "zero_region"]

MAX_PLANNED_CALLS = 4096  # call shapes whose plan a workspace keeps


class AllReduceState:
    """Per-workspace state of the all-reduce ops (see the module docstring).

    tuning: launch settings (plan.Tuning; from the environment unless given).
    lamport_ptrs: int64 [3 * world] device table of every rank's lamport areas (entry k * world + s =
      rank s's area k), built when the areas are first filled with the sentinel.
    halves_ptrs: int64 [2 * world] device table of every rank's buffer, then of its upper half
      (two-shot's gather areas, rsgather's q areas: NOTE [push and gather halves]), built on the
      first call that takes it (every algorithm whose plan.Algorithm has two tables).
    """

    def __init__(self, tuning: Optional[Tuning] = None) -> None:
        self._calls: dict = {}
        self._grid_caps: dict = {}
        self.tuning = Tuning.from_env() if tuning is None else tuning
        self.lamport_ptrs: Optional[Tensor] = None
        self.halves_ptrs: Optional[Tensor] = None
        self.fallback_logged = False
        self.scatter_fallback_logged = False  # a reduce-scatter too large for one launch, uneven M
        # passes through the host barriers (faults.host_barrier): the first-call one may be
        # skipped by a rank that failed, so reset() re-zeroes it; reset() counts its own
        self.first_call_barriers = 0
        self.resets = 0
        self._signal_checked = False
        self._ones: dict = {}
        self.row_gathers = 0  # launches of the row gather (collectives/peergather.py)
        self.epilogue_gathers = 0  # reduce-scatters that gathered q themselves (rsgather)

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        """New launch settings: the planned calls (their compiled kernels and grid caps) were made
        for the old ones, so they go."""
        self._tuning = tuning
        self._calls.clear()
        self._grid_caps.clear()

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
        """Fill this rank's lamport areas (fill_lamport), then a host barrier with a deadline;
        build the area table. Collective: every rank, while no kernel of `ws` runs."""
        self.fill_lamport(ws)
        self.first_call_barriers += 1
        host_barrier(ws, HOST_BARRIER_FIRST_CALL, self.first_call_barriers,
                     self.tuning.host_timeout_s)
        self.lamport_ptrs = self._lamport_table(ws)

    def buffer_table(self, ws, algo: str) -> Optional[Tensor]:
        """The peer-pointer table a launch of `algo` takes (plan.Algorithm.ptr_tables entries per
        rank); None for lamport before its areas are prepared (lamport_table prepares them)."""
        if algo == "lamport":
            return self.lamport_ptrs
        if ALGORITHMS[algo].ptr_tables == 2:  # bases, then upper halves (two-shot)
            if self.halves_ptrs is None:
                half = push_half(lamport_split(ws.buffer_bytes)[0])
                host = ws.buffer_ptrs_host
                self.halves_ptrs = torch.tensor(list(host) + [p + half for p in host],
                                                dtype=torch.int64, device=ws.device)
            return self.halves_ptrs
        return ws.buffer_ptrs

    def _lamport_table(self, ws) -> Tensor:
        general, area = lamport_split(ws.buffer_bytes)
        ptrs = [p + general + k * area for k in range(LAMPORT_AREAS) for p in ws.buffer_ptrs_host]
        return torch.tensor(ptrs, dtype=torch.int64, device=ws.device)

    def fill_lamport(self, ws) -> None:
        """Fill this rank's three lamport areas and descriptor headers with the sentinel and zero
        the lamport call state (no kernel of `ws` may run anywhere)."""
        self.check_signal_pad(ws)
        general, area = lamport_split(ws.buffer_bytes)
        words = ws.local_buffer(torch.int32, (ws.buffer_bytes // 4,))
        with torch.cuda.device(ws.device):
            torch.cuda.synchronize(ws.device)
            words[general // 4:(general + LAMPORT_AREAS * area) // 4].fill_(LAMPORT_SENTINEL_I32)
            w0 = region_word(REGION_LAMPORT)
            pad = ws.peer_signal(ws.rank)
            pad[w0:w0 + LAMPORT_STATE_WORDS].zero_()
            pad[CALL_W_LAMPORT_HDR:CALL_W_HOST_BARRIER].fill_(LAMPORT_SENTINEL_I32)
            torch.cuda.synchronize(ws.device)

    def reset(self, ws) -> None:
        """After a CommError: clear the error words; barrier A (every rank has stopped and entered
        reset); zero the barrier regions and the first-call host barrier, refill the lamport
        areas; barrier B (nobody launches before everybody is clean). Collective: every rank, while
        no kernel of `ws` runs anywhere; each barrier waits at most Tuning.host_timeout_s."""
        ws.reset_error()
        self.resets += 1
        timeout = self.tuning.host_timeout_s
        host_barrier(ws, HOST_BARRIER_RESET_A, self.resets, timeout)
        for algorithm in ALGORITHMS.values():
            zero_region(ws, algorithm.region)
        zero_region(ws, REGION_ROLES)  # the reduce-scatter roles-tma's (a form, not an algorithm)
        w0 = CALL_W_HOST_BARRIER + HOST_BARRIER_FIRST_CALL * MAX_WORLD
        with torch.cuda.device(ws.device):
            ws.peer_signal(ws.rank)[w0:w0 + MAX_WORLD].zero_()
        self.first_call_barriers = 0
        self.fill_lamport(ws)
        host_barrier(ws, HOST_BARRIER_RESET_B, self.resets, timeout)
        self.lamport_ptrs = self._lamport_table(ws)

    def planned_call(self, ws, algo: str, M: int, H: int, dtype: torch.dtype,
                     spec: Optional[QuantSpec], has_residual: bool, gemma: bool, write_y: bool,
                     write_allreduce: bool, plain: bool):
        """The dispatch.PlannedCall of a call of this shape (planned and compiled on first use)."""
        key = (algo, M, H, dtype, spec, has_residual, gemma, write_y, write_allreduce, plain)
        call = self._calls.get(key)
        if call is None:
            from distnorm.collectives.dispatch import PlannedCall

            if len(self._calls) >= MAX_PLANNED_CALLS:  # prefill sees many M: keep it bounded
                self._calls.clear()
            call = self._calls[key] = PlannedCall(ws, *key)
        return call

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
