"""The cross-rank CTA barrier's flag protocol (distnorm/kernels/sync.py: cta_barrier), model-checked
on the CPU: every interleaving of 2 and 3 ranks through a run of barriers whose call signatures
change from one barrier to the next, as consecutive calls' do.

Each rank's barrier is the kernel's sequence of steps: read its epoch e = epochs + 1; store the
flag (e, signature) into every peer's slot e % FLAG_SLOTS for this rank; poll its own slot of each
peer until that flag's epoch reaches e, comparing the signature found there with its own; write e
back. A scheduler may run any rank's next step at any time (a GPU time-slicing two processes does
stop a kernel anywhere). With layout.FLAG_SLOTS flag slots the model must never report a mismatch
when the ranks agree, must report it on every rank when one rank's signature differs, and must
never deadlock; with one slot (the layout before 2026-11-23) it reports a mismatch the ranks did not
make, which is how the multi-GPU tests failed with two ranks on one GPU.
"""
from __future__ import annotations

import pytest

from distnorm.collectives.layout import FLAG_SLOTS


def _explore(sigs: list[list[int]], slots: int) -> set[tuple]:
    """Every terminal outcome (per rank: the barriers at which it saw a differing signature) over
    all interleavings. sigs[r][b]: rank r's signature at barrier b. Raises on a deadlock."""
    world, rounds = len(sigs), len(sigs[0])
    # state: per rank (barrier, phase, peer, epoch, stored epoch, mismatches); flags[dst][src][slot]
    start = (tuple((0, 0, 0, 0, 0, ()) for _ in range(world)),
             tuple(tuple(tuple((0, 0) for _ in range(slots)) for _ in range(world))
                   for _ in range(world)))
    outcomes: set[tuple] = set()
    seen = {start}
    stack = [start]
    while stack:
        ranks, flags = stack.pop()
        if all(b == rounds for b, *_ in ranks):
            outcomes.add(tuple(m for *_, m in ranks))
            continue
        moved = False
        for r in range(world):
            step = _step(r, ranks, flags, sigs, slots)
            if step is not None:
                moved = True
                if step not in seen:
                    seen.add(step)
                    stack.append(step)
        assert moved, f"deadlock: {ranks}"
    return outcomes


def _step(r, ranks, flags, sigs, slots):
    """The state after rank r's next step, or None when r is done or waits on a flag."""
    world = len(ranks)
    b, phase, peer, epoch, stored, seen = ranks[r]
    if b == len(sigs[r]):
        return None
    peers = [t for t in range(world) if t != r]
    sig, slot = sigs[r][b], (stored + 1) % slots
    new_flags = flags
    if phase == 0:  # store my flag into every peer's slot for me (one step per peer)
        t = peers[peer]
        row = list(flags[t])
        cells = list(row[r])
        cells[slot] = (stored + 1, sig)
        row[r] = tuple(cells)
        new_flags = flags[:t] + (tuple(row),) + flags[t + 1:]
        state = (b, 0, peer + 1, stored + 1, stored, seen) if peer + 1 < len(peers) else \
            (b, 1, 0, stored + 1, stored, seen)
    elif phase == 1:  # poll my slot of peer `peer`
        v, peer_sig = flags[r][peers[peer]][slot]
        if v < epoch:
            return None
        if peer_sig != sig and b not in seen:
            seen = seen + (b,)
        state = (b, 1, peer + 1, epoch, stored, seen) if peer + 1 < len(peers) else \
            (b + 1, 0, 0, 0, epoch, seen)  # epoch written back: the next barrier starts from it
    return ranks[:r] + (state,) + ranks[r + 1:], new_flags


@pytest.mark.parametrize("world", [2, 3])
def test_agreeing_ranks_never_see_a_mismatch(world):
    sigs = [[11, 22, 33] for _ in range(world)]  # each barrier another call
    assert _explore(sigs, FLAG_SLOTS) == {tuple(() for _ in range(world))}


@pytest.mark.parametrize("world", [2, 3])
def test_a_differing_call_is_seen_by_every_rank(world):
    sigs = [[11, 22, 33] for _ in range(world)]
    sigs[world - 1][1] = 99  # the last rank launched another call at barrier 1
    for outcome in _explore(sigs, FLAG_SLOTS):
        assert all(1 in seen for seen in outcome), outcome


def test_one_slot_reports_a_mismatch_nobody_made():
    """The model can fail: with one slot a peer one barrier ahead overwrites the flag not yet read."""
    outcomes = _explore([[11, 22, 33], [11, 22, 33]], 1)
    assert any(any(seen) for seen in outcomes)
