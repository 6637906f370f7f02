"""How the all-reduce ops fail: every wait has a deadline, and an error names what went wrong.

- Kernels: every cross-rank wait gives up after ``Tuning.timeout_s`` (DISTNORM_BARRIER_TIMEOUT_S)
  and records a timeout; a peer whose launch has another call descriptor (collectives/signature.py)
  is recorded as a mismatch. Either way the kernel sets the device error word so every other wait
  of the workspace stops at once, and writes the pinned error words the host reads here.
- Host: the only host-side wait of the ops, the group barrier of the first lamport call and of
  ``reset``, is ``host_barrier``: it runs through the workspace's own signal pads (no process-group
  collective, so no launcher-specific timeout) and gives up after ``Tuning.host_timeout_s``
  (DISTNORM_HOST_TIMEOUT_S), recording a timeout like a kernel does.
- ``failure(ws)`` turns the recorded words into a CommTimeoutError or CommMismatchError whose
  message says what every rank last launched and which fields differ.

The contract the user sees (README "When a rank fails"): a call raises the error once the failing
kernel has finished -- the failing call itself in checked mode (DISTNORM_CHECK=1), otherwise the
first later call that starts after it finished, or ``check(ws)`` after a synchronize. From then on
every call raises until ``reset(ws)`` has run on every rank.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from distnorm.collectives.layout import (CALL_W_HOST_BARRIER, CALL_W_LAST, DESCRIPTOR_WORDS,
                                         ERR_CODE, ERR_EPOCH, ERR_PEER, ERR_VALUE, ERROR_MISMATCH,
                                         ERROR_NONE, ERROR_TIMEOUT, MAX_WORLD)
from distnorm.collectives.signature import CallDescriptor
from distnorm.comm.errors import CommError, CommMismatchError, CommTimeoutError

__all__ = ["failure", "raise_if_failed", "after_launch", "host_barrier", "read_descriptors", "HOST_BARRIER"]

HOST_BARRIER = -2  # ERR_EPOCH of a timeout in host_barrier (kernels record an epoch >= 0 there)
_WORD_FIELDS = ("M (rows of the launch)", "H", "dtype, outputs, algorithm or world size",
                "quantization format")
_RECOVER = ("Call distnorm.collectives.reset(workspace) on every rank (no kernel of the workspace "
            "running) before using the workspace again.")


def read_descriptors(ws) -> list[Optional[CallDescriptor]]:
    """What every rank last launched on `ws` (None where unknown or unreadable)."""
    out: list[Optional[CallDescriptor]] = []
    for r in range(ws.world_size):
        try:
            words = ws.peer_signal(r)[CALL_W_LAST:CALL_W_LAST + DESCRIPTOR_WORDS].tolist()
            out.append(CallDescriptor.from_words(words) if any(words) else None)
        except Exception:  # noqa: BLE001 - a diagnosis must never hide the error it explains
            out.append(None)
    return out


def failure(ws) -> Optional[CommError]:
    """The error recorded on `ws` (pinned words: cheap to read), or None."""
    code, peer, detail, value = ws.error_flag.tolist()
    if code == ERROR_NONE:
        return None
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    readable = ws.p2p_ok and not ws.closed and not capturing
    descs = read_descriptors(ws) if readable else []
    mine = descs[ws.rank] if descs else None
    theirs = descs[peer] if 0 <= peer < len(descs) else None
    diffs = mine.differences(theirs) if mine is not None and theirs is not None else []
    launches = "; ".join(f"rank {r}: {d if d is not None else 'unknown'}" for r, d in enumerate(descs))
    where = f"rank {ws.rank} of {ws.world_size}"
    if code == ERROR_MISMATCH:
        if not diffs and 0 <= detail < DESCRIPTOR_WORDS:
            diffs = [f"{_WORD_FIELDS[detail]} (rank {peer}'s word: {value})"]
        what = ", ".join(diffs) if diffs else (
            "the same descriptor but another grid: every rank needs the same GPU model and the "
            "same Tuning (rows_per_cta, max_ctas)")
        return CommMismatchError(
            f"distnorm: {where}: rank {peer} launched the same all-reduce with other arguments "
            f"({what}); every rank must pass the same M, H, dtype, format, outputs and algo. "
            f"Last launches: {launches or 'unknown'}. {_RECOVER}",
            rank=ws.rank, peer=peer, differences=diffs)
    if detail == HOST_BARRIER:
        return CommTimeoutError(
            f"distnorm: {where}: rank {peer} did not reach the workspace's host barrier within "
            f"DISTNORM_HOST_TIMEOUT_S (first lamport call or reset); it died, hangs, or never makes "
            f"this call. {_RECOVER}", code=code, rank=ws.rank, peer=peer, epoch=detail)
    # a peer that stopped calling still shows its last (earlier) launch, so differing descriptors
    # mean other arguments or a rank that has not reached this call: the words hold no call count
    hint = (f" The last launches differ ({'; '.join(diffs)}): the ranks called with other "
            f"arguments, or rank {peer} has not made this call (its last launch was an earlier "
            "one)." if diffs else " A peer died, hangs, or did not make the same call.")
    return CommTimeoutError(
        f"distnorm: {where} gave up waiting for rank {peer} (epoch/area {detail}) after "
        f"DISTNORM_BARRIER_TIMEOUT_S.{hint} Last launches: {launches or 'unknown'}. {_RECOVER}",
        code=code, rank=ws.rank, peer=peer, epoch=detail)


def raise_if_failed(ws) -> None:
    """Raise the error recorded on `ws`, if any."""
    error = failure(ws)
    if error is not None:
        raise error


def after_launch(ws, device) -> None:
    """In checked mode (and not while capturing a CUDA graph): wait for this call's kernels and
    raise their failure, so the failing call itself raises."""
    from distnorm.args import checked_mode

    if checked_mode() and not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream(device).synchronize()
        raise_if_failed(ws)


def _arrived(flag: int, epoch: int) -> bool:
    return ((flag - epoch) & 0xFFFFFFFF) < (1 << 31)  # int32 difference >= 0 (wraps)


def host_barrier(ws, barrier: int, epoch: int, timeout_s: float) -> None:
    """Barrier of the workspace's group through its signal pads, with a deadline.

    Every rank writes `epoch` (its count of passes through this barrier on `ws`: 1, 2, ...) into
    its word of every pad's array of host barrier `barrier` (layout.HOST_BARRIER_*), then waits
    until every word of that array in its own pad reached `epoch`. Work on this rank's device
    issued before the call is complete before any peer sees it arrive. After `timeout_s` it records
    a timeout (ERR_EPOCH = HOST_BARRIER) and raises. Collective: every rank, same epoch.
    """
    world, rank = ws.world_size, ws.rank
    base = CALL_W_HOST_BARRIER + barrier * MAX_WORLD
    pads = [ws.peer_signal(r) for r in range(world)]
    own = pads[rank]
    if own.is_cuda:
        torch.cuda.synchronize(own.device)  # our earlier work is done before anyone sees us
    for pad in pads:
        pad[base + rank].fill_(epoch)
    if own.is_cuda:
        torch.cuda.synchronize(own.device)
    words = own[base:base + world]
    deadline = time.monotonic() + timeout_s
    delay = 1e-4
    while True:
        missing = [r for r, v in enumerate(words.tolist()) if not _arrived(v, epoch)]
        if not missing:
            return
        if time.monotonic() > deadline:
            flag = ws.error_flag
            if int(flag[ERR_CODE]) == ERROR_NONE:
                flag[ERR_PEER], flag[ERR_EPOCH], flag[ERR_VALUE] = missing[0], HOST_BARRIER, 0
                flag[ERR_CODE] = ERROR_TIMEOUT
            raise_if_failed(ws)
        time.sleep(delay)
        delay = min(2 * delay, 0.01)
