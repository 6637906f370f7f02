"""The data buffer's reuse across consecutive calls (NOTE [push and gather halves] in
collectives/layout.py, NOTE [two-shot final barrier] in kernels/twoshot.py), model-checked on the
CPU: every interleaving of 2 ranks of 2 CTAs each, and of 3 ranks of one CTA, through a few calls
of one-shot and two-shot (push and pull forms, their rounds: NOTE [two-shot rounds], and their
wide grids: NOTE [wide two-shot]) of different sizes.

Each CTA runs its call's steps in order; a step writes or reads whole rows of the buffers (its
own rows: row i belongs to CTA i % ctas); a barrier step lets CTA b pass once CTA b of every rank
has reached it (cta_barrier pairs same-index CTAs; its flag protocol is checked in
test_barrier_protocol.py); a rank's next call starts once all its CTAs finished the last one
(stream order). Every written row carries its call's index, and a read must find the index of
its own call. With the halves and two barriers the model finds no bad read; with the layout
before them (gather rows right after the scatter slots) it finds one unless two-shot keeps its
third barrier -- which is why that barrier existed. The reduce-scatter that gathers q in its
epilogue (NOTE [gather in the epilogue] in kernels/reducescatter.py) is modelled the same way, in
both its forms (NOTE [copy-out by rounds]). So is "roles-tma" (NOTE [reduce-scatter roles by
TMA]): pusher and finisher CTAs that meet through per-group epoch flags and per-rank completion
counts in the signal pads instead of barriers ("set" / "wait" / "add" steps below); there the
checker also looks for states where a wait can never pass.
"""
from __future__ import annotations

import pytest

# (ranks, CTAs per rank) of the models
SHAPES = [(2, 2), (3, 1)]


def _twoshot_steps(world: int, rank: int, S: int, form: str, halves: bool,
                   final_barrier: bool, ctas: int = 1) -> list:
    """Two-shot's steps for `rank`: (kind, buffer owner or None for every peer, cells) with cells
    (region, index, row, slice) of the rows moved; the gather rows in the upper half ("U") or right
    after the scatter slots ("G", the old layout). Forms "push-rounds" / "pull-rounds" (NOTE
    [two-shot rounds]) take each CTA's rows one round at a time (round of row i: i // ctas), the
    next round's x pushed before this round is reduced; "...-rounds-late" pushes it after the
    round's barrier instead (a wrong order, to show the model can fail). The "-wide" forms (NOTE
    [wide two-shot]) differ only in which CTA moves a cell (_cta_of); "...-wide-skew" has phase 3
    read slice s's rows on the CTAs of slice s + 1 (no barrier pairs them with the writers)."""
    peers = [t for t in range(world) if t != rank]
    gather = (lambda k: ("U", k)) if halves else (lambda k: ("L", world * S + k))
    pushed = not form.startswith("pull")

    skew = (lambda s: (s + 1) % world) if form.endswith("-skew") else (lambda s: s)

    def x_out(rows):  # push: my rows of slice t -> slot `rank` of rank t; pull: my own copy
        if pushed:
            return [("write", t, [("L", rank * S + i, i, t) for i in rows]) for t in peers]
        return [("write", rank, [("L", s * S + i, i, s) for s in peers for i in rows])]

    def reduce(rows):  # my slice's rows: its slots (push) or every peer's copy (pull), then T(h)
        mine = [(*gather(rank * S + i), i, rank) for i in rows]
        if pushed:
            steps = [("read", rank, [("L", s * S + i, i, rank) for s in peers for i in rows])]
            return steps + [("write", t, mine) for t in peers]
        steps = [("read", t, [("L", rank * S + i, i, rank) for i in rows]) for t in peers]
        return steps + [("write", rank, mine)]

    def finish(rows):  # the other slices' gathered rows
        if pushed:
            return [("read", rank, [(*gather(s * S + i), i, skew(s)) for s in peers
                                    for i in rows])]
        return [("read", s, [(*gather(s * S + i), i, skew(s)) for i in rows]) for s in peers]

    rounds = [list(range(S))]
    if "-rounds" in form:
        rounds = [[i for i in range(S) if i // ctas == r] for r in range(-(-S // ctas))]
    late = form.endswith("-late")
    steps = x_out(rounds[0]) + [("barrier",)]
    for r, rows in enumerate(rounds):
        nxt = x_out(rounds[r + 1]) if r + 1 < len(rounds) else []
        steps += (nxt if not late else []) + reduce(rows) + [("barrier",)] \
            + (nxt if late else []) + finish(rows)
    if final_barrier:
        steps.append(("barrier",))
    return steps


def _oneshot_steps(world: int, rank: int, m: int) -> list:
    """One-shot: my rows into slot `rank` of every peer, barrier, my slots read, final barrier."""
    peers = [t for t in range(world) if t != rank]
    steps = [("write", t, [("L", rank * m + i, i) for i in range(m)]) for t in peers]
    steps.append(("barrier",))
    steps.append(("read", rank, [("L", s * m + i, i) for s in peers for i in range(m)]))
    steps.append(("barrier",))
    return steps


def _rsgather_steps(world: int, rank: int, S: int, early: bool = False) -> list:
    """The reduce-scatter that gathers q in its epilogue (NOTE [gather in the epilogue]): my rows
    of shard t into slot `rank` of rank t (lower half), barrier, my shard's slots read, my q rows
    into every peer's q area (upper half, row rank * S + i), final barrier, the other shards' q
    rows read from my own q area. early: the q pushes before the first barrier (a wrong order,
    to show the model can fail)."""
    peers = [t for t in range(world) if t != rank]
    q_pushes = [("write", t, [("U", rank * S + i, i) for i in range(S)]) for t in peers]
    steps = [("write", t, [("L", rank * S + i, i) for i in range(S)]) for t in peers]
    if early:
        steps += q_pushes
    steps.append(("barrier",))
    steps.append(("read", rank, [("L", s * S + i, i) for s in peers for i in range(S)]))
    if not early:
        steps += q_pushes
    steps.append(("barrier",))
    steps.append(("read", rank, [("U", s * S + i, i) for s in peers for i in range(S)]))
    return steps


def _rsrounds_steps(world: int, ctas: int, rank: int, S: int, early_copy: bool) -> list:
    """The pipelined reduce-scatter that gathers q (NOTE [reduce-scatter rounds], NOTE [copy-out
    by rounds]), per CTA: CTA b's rows i (i % ctas == b), one per round; round 0's x rows pushed,
    barrier; per round: the next round's x rows pushed, this round's slots read and its q rows
    into every peer's q area, a barrier after each round but the last and then that round's q rows
    of the other shards read from my own q area; final barrier, the last round's read. early_copy:
    each round's read before its barrier (a wrong order, to show the model can fail)."""
    peers = [t for t in range(world) if t != rank]
    per_cta = []
    for b in range(ctas):
        rows = [i for i in range(S) if i % ctas == b]

        def x_out(rs):
            return [("write", t, tuple(("L", rank * S + i) for i in rs)) for t in peers if rs]

        def copy_out(r, rows=rows):
            return [("read", rank, tuple(("U", s * S + rows[r]) for s in peers))]

        steps = x_out(rows[:1]) + [("barrier",)]
        for r, i in enumerate(rows):
            steps += x_out(rows[r + 1:r + 2])
            steps.append(("read", rank, tuple(("L", s * S + i) for s in peers)))
            steps += [("write", t, (("U", rank * S + i),)) for t in peers]
            if r + 1 < len(rows):
                steps += (copy_out(r) + [("barrier",)]) if early_copy else \
                    ([("barrier",)] + copy_out(r))
        steps += [("barrier",)] + copy_out(len(rows) - 1)
        per_cta.append(tuple(steps))
    return per_cta


def _roles_steps(world: int, ctas: int, rank: int, S: int, form: tuple, call: int,
                 nth: int, gather: bool) -> list:
    """NOTE [reduce-scatter roles by TMA]: the form "roles-tma", per CTA: CTAs 0 .. P - 1 push,
    the other F = ctas - P finish; row group g (one row here) is pushed by pusher g % P and
    finished by finisher g % F, the same CTAs on every rank. form = (P, variant); `call` is the
    call's index (what its rows carry), `nth` how many roles-tma calls came before it (the epoch
    of its flags; the finishers' completion count wanted in my pad is (nth + 1) * F).

    A pusher, per group in order and per peer t: my rows of shard t into slot `rank` of t's buffer,
    then flag ("x", g, rank) in t's pad := epoch; at its end pusher 0 waits until every peer's
    completion count in my own pad shows this call's F finishers done (so that the kernel ends only
    when no peer reads my pushes any more: the next call, of any algorithm, may push again). A
    finisher, per group: waits for every peer's flag of g, reads the slots, pushes its q rows into
    every peer's q area (gather); after its last group it adds 1 to the completion count
    ("done", rank) in every peer's pad; with the gather it then waits for every peer's count and
    copies its groups' q rows of the other shards out of its own q area.

    Variants (wrong orders, to show the model can fail): "no-flag-wait" (the finisher reads without
    the flags), "no-end-wait" (no completion wait at all), "start-wait" (the next call's pushers
    wait for the previous call's count before their first store into a peer, instead of this
    call's pushers at its end: safe between two roles-tma calls, not before another algorithm),
    "early-done" (a finisher counts itself done before its last group), "no-copy-wait";
    "wait-before-done" (the copy-out's wait before the finisher's own count: a hang)."""
    P, variant = form
    F = ctas - P
    peers = [t for t in range(world) if t != rank]
    want = (nth + 1) * F  # the completion count after this call
    per_cta = []
    for b in range(ctas):
        steps = []
        if b < P:
            started = set()
            for g in range(b, S, P):
                for t in peers:
                    if variant == "start-wait" and t not in started and nth > 0:
                        steps.append(("wait", rank, ("done", t), nth * F))
                        started.add(t)
                    steps.append(("write", t, (("L", rank * S + g),)))
                    steps.append(("set", t, ("x", g, rank), nth))
            if variant not in ("no-end-wait", "start-wait") and b == 0:  # pusher CTA 0's
                steps += [("wait", rank, ("done", t), want) for t in peers]
        else:
            mine = list(range(b - P, S, F))
            for n, g in enumerate(mine):
                if variant == "early-done" and n == len(mine) - 1:
                    steps += [("add", t, ("done", rank)) for t in peers]
                if variant != "no-flag-wait":
                    steps += [("wait", rank, ("x", g, t), nth) for t in peers]
                steps.append(("read", rank, tuple(("L", s * S + g) for s in peers)))
                if gather:
                    steps += [("write", t, (("U", rank * S + g),)) for t in peers]
            done = [("add", t, ("done", rank)) for t in peers]
            if variant not in ("early-done", "wait-before-done"):
                steps += done
            if gather:
                if variant != "no-copy-wait":
                    steps += [("wait", rank, ("done", t), want) for t in peers]
                if variant == "wait-before-done":
                    steps += done
                steps.append(("read", rank, tuple(("U", s * S + g) for s in peers for g in mine)))
        per_cta.append(tuple(steps))
    return per_cta


def _cta_of(cell: tuple, ctas: int, world: int, form) -> int:
    """The CTA that moves a cell: row % ctas; in the wide two-shot forms slice * G + row % G, G =
    ctas / world (NOTE [wide two-shot])."""
    row = cell[2]
    if form and "-wide" in form:
        G = ctas // world
        return cell[3] * G + row % G
    return row % ctas


def _program(world: int, ctas: int, calls: list, rank: int, halves: bool,
             final_barrier: bool) -> list:
    """Per call, per CTA: its steps (a cell goes to CTA _cta_of; barriers to every CTA)."""
    prog = []
    roles_calls = 0  # roles-tma calls so far: their epoch (NOTE [reduce-scatter roles by TMA])
    for call, (algo, size, form) in enumerate(calls):
        if algo in ("roles", "roles-gather"):
            prog.append(tuple(_roles_steps(world, ctas, rank, size, form, call, roles_calls,
                                           algo == "roles-gather")))
            roles_calls += 1
            continue
        if algo == "rsrounds":
            prog.append(tuple(_rsrounds_steps(world, ctas, rank, size, form == "early-copy")))
            continue
        if algo == "oneshot":
            steps = _oneshot_steps(world, rank, size)
        elif algo == "rsgather":
            steps = _rsgather_steps(world, rank, size, early=form == "early")
        else:
            steps = _twoshot_steps(world, rank, size, form, halves, final_barrier, ctas)
        per_cta = []
        for b in range(ctas):
            mine = []
            for kind, *rest in steps:
                if kind == "barrier":
                    mine.append(("barrier",))
                else:
                    owner, cells = rest
                    mine.append((kind, owner, tuple(cell[:2] for cell in cells
                                                    if _cta_of(cell, ctas, world, form) == b)))
            per_cta.append(tuple(mine))
        prog.append(tuple(per_cta))
    return prog


def _bad_reads(shape: tuple, calls: list, halves: bool, final_barrier: bool,
               stuck: list | None = None) -> set:
    """Every (call, rank, cell) read with another call's index in it, over all interleavings of
    `shape` = (ranks, CTAs per rank). stuck: when given, collects every reachable state where no
    CTA can move before all calls ended (a wait that can hang)."""
    world, ctas = shape
    progs = [_program(world, ctas, calls, r, halves, final_barrier) for r in range(world)]
    # state: per rank, per CTA: (call, step); buffers: per rank, sorted (cell, call) pairs
    start = (tuple(tuple((0, 0) for _ in range(ctas)) for _ in range(world)),
             tuple(() for _ in range(world)))
    bad: set = set()
    seen = {start}
    stack = [start]
    while stack:
        pos, bufs = stack.pop()
        moved = False
        for r in range(world):
            for b in range(ctas):
                nxt = _step(progs, pos, bufs, r, b, bad)
                moved = moved or nxt is not None
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        if stuck is not None and not moved \
                and any(pos[r][b][0] < len(progs[r]) for r in range(world) for b in range(ctas)):
            stuck.append(pos)
    return bad


def _barrier_index(steps, j: int) -> int:
    return sum(1 for s in steps[:j] if s[0] == "barrier")


def _step(progs, pos, bufs, r: int, b: int, bad: set):
    """The state after CTA b of rank r takes its next step, or None when it cannot."""
    world, ctas = len(pos), len(pos[0])
    c, j = pos[r][b]
    if c == len(progs[r]):
        return None
    if j == 0 and any(pos[r][o][0] < c for o in range(ctas)):
        return None  # stream order: the rank's previous kernel has a CTA still running
    steps = progs[r][c][b]
    if j == len(steps):  # this CTA is done with call c
        return _moved(pos, r, b, (c + 1, 0)), bufs
    kind, *rest = steps[j]
    if kind == "barrier":
        k = _barrier_index(steps, j)
        for t in range(world):  # CTA b of every rank arrived at barrier k of call c
            tc, tj = pos[t][b]
            if tc < c or (tc == c and _barrier_index(progs[t][c][b], tj) < k):
                return None
            if tc == c and tj < len(progs[t][c][b]) and _barrier_index(progs[t][c][b], tj) == k \
                    and progs[t][c][b][tj][0] != "barrier":
                return None
        return _moved(pos, r, b, (c, j + 1)), bufs
    if kind == "wait":  # a flag or count in a pad (NOTE [reduce-scatter roles by TMA])
        owner, key, value = rest
        if dict(bufs[owner]).get(("F",) + key, -1) < value:
            return None
        return _moved(pos, r, b, (c, j + 1)), bufs
    if kind in ("set", "add"):
        owner, key, *value = rest
        buf = dict(bufs[owner])
        buf[("F",) + key] = value[0] if kind == "set" else buf.get(("F",) + key, 0) + 1
        new_bufs = tuple(tuple(sorted(buf.items())) if t == owner else bufs[t]
                         for t in range(world))
        return _moved(pos, r, b, (c, j + 1)), new_bufs
    owner, cells = rest
    buf = dict(bufs[owner])
    if kind == "write":
        for cell in cells:
            buf[cell] = c
        new_bufs = tuple(tuple(sorted(buf.items())) if t == owner else bufs[t]
                         for t in range(world))
        return _moved(pos, r, b, (c, j + 1)), new_bufs
    for cell in cells:
        if buf.get(cell) != c:
            bad.add((c, r, owner, cell, buf.get(cell)))
    return _moved(pos, r, b, (c, j + 1)), bufs


def _moved(pos, r: int, b: int, to) -> tuple:
    return tuple(tuple(to if (t, o) == (r, b) else cta for o, cta in enumerate(ctas))
                 for t, ctas in enumerate(pos))


# a two-shot call, then calls that push more rows than its scatter slots held
SEQUENCES = {
    "push-oneshot": [("twoshot", 1, "push"), ("oneshot", 2, None)],
    "push-push": [("twoshot", 1, "push"), ("twoshot", 2, "push")],
    "pull-oneshot": [("twoshot", 1, "pull"), ("oneshot", 2, None)],
    "pull-pull": [("twoshot", 1, "pull"), ("twoshot", 2, "pull")],
    "oneshot-push-oneshot": [("oneshot", 1, None), ("twoshot", 1, "push"), ("oneshot", 2, None)],
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}ranks{s[1]}ctas")
@pytest.mark.parametrize("name", SEQUENCES)
def test_halves_need_no_third_barrier(name, shape):
    """The layout of NOTE [push and gather halves]: no bad read with two barriers per two-shot."""
    assert _bad_reads(shape, SEQUENCES[name], halves=True, final_barrier=False) == set()


@pytest.mark.parametrize("name", SEQUENCES)
def test_old_layout_needed_the_third_barrier(name):
    """The layout before the halves: with its third barrier no bad read; without it a later
    call's pushes land on gathered rows a rank still reads, in one of the shapes (the pull forms
    need a third rank: the reader is not the rank whose next call writes) -- the model can fail."""
    calls = SEQUENCES[name]
    assert all(_bad_reads(shape, calls, halves=False, final_barrier=True) == set()
               for shape in SHAPES)
    assert any(_bad_reads(shape, calls, halves=False, final_barrier=False) != set()
               for shape in SHAPES)


# the reduce-scatter with its epilogue gather (its q areas in the upper half, like two-shot's
# gather rows) before and after every other algorithm, of growing sizes
RSGATHER_SEQUENCES = {
    "rsgather-rsgather": [("rsgather", 1, None), ("rsgather", 2, None)],
    "rsgather-oneshot": [("rsgather", 1, None), ("oneshot", 2, None)],
    "rsgather-push": [("rsgather", 1, None), ("twoshot", 2, "push")],
    "rsgather-pull": [("rsgather", 1, None), ("twoshot", 2, "pull")],
    "push-rsgather": [("twoshot", 1, "push"), ("rsgather", 2, None)],
    "pull-rsgather": [("twoshot", 1, "pull"), ("rsgather", 2, None)],
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}ranks{s[1]}ctas")
@pytest.mark.parametrize("name", RSGATHER_SEQUENCES)
def test_epilogue_gather_reads_only_its_own_call(name, shape):
    """NOTE [gather in the epilogue]: its q pushes (after the first barrier, into the upper half)
    and its copy-out after the final barrier meet no other call's rows, before or after any
    algorithm."""
    assert _bad_reads(shape, RSGATHER_SEQUENCES[name], halves=True, final_barrier=False) == set()


# NOTE [two-shot rounds]: every CTA's rows in two rounds, before and after the one-round forms
ROUNDS_SEQUENCES = {
    "push-rounds": [("twoshot", 2, "push-rounds"), ("twoshot", 2, "push-rounds")],
    "pull-rounds": [("twoshot", 2, "pull-rounds"), ("twoshot", 2, "pull-rounds")],
    "rounds-push-oneshot": [("twoshot", 2, "push-rounds"), ("twoshot", 1, "push"),
                            ("oneshot", 2, None)],
    "pull-pull-rounds": [("twoshot", 1, "pull"), ("twoshot", 2, "pull-rounds")],
}


def _scaled(calls: list, ctas: int) -> list:
    """The calls with `ctas` times the rows: every CTA keeps the rows per CTA of the 1-CTA model."""
    return [(algo, size * ctas, form) for algo, size, form in calls]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}ranks{s[1]}ctas")
@pytest.mark.parametrize("name", ROUNDS_SEQUENCES)
def test_twoshot_rounds_read_only_their_own_call(name, shape):
    """NOTE [two-shot rounds]: one barrier per round (the next round's pushes before it) reads no
    other call's rows and no row before it landed."""
    calls = _scaled(ROUNDS_SEQUENCES[name], shape[1])
    assert _bad_reads(shape, calls, halves=True, final_barrier=False) == set()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}ranks{s[1]}ctas")
@pytest.mark.parametrize("form", ["push-rounds-late", "pull-rounds-late"])
def test_twoshot_rounds_model_can_fail(form, shape):
    """With the next round's pushes after the round's barrier a rank reads rows not yet pushed."""
    calls = _scaled([("twoshot", 2, form)], shape[1])
    assert _bad_reads(shape, calls, halves=True, final_barrier=False) != set()


# NOTE [wide two-shot]: a grid of world * G CTAs, CTA b on slice b // G only (G = 1 here: larger
# grids and a third rank take minutes per sequence; one call with G = 2 below)
WIDE_SEQUENCES = {
    "push-wide": [("twoshot", 2, "push-wide"), ("twoshot", 2, "push-wide")],
    "pull-wide": [("twoshot", 2, "pull-wide"), ("twoshot", 2, "pull-wide")],
    "wide-push-oneshot": [("twoshot", 2, "push-wide"), ("twoshot", 1, "push"), ("oneshot", 2, None)],
    "pull-pull-wide": [("twoshot", 1, "pull"), ("twoshot", 2, "pull-wide")],
}


@pytest.mark.parametrize("name", WIDE_SEQUENCES)
def test_wide_twoshot_reads_only_its_own_call(name):
    """NOTE [wide two-shot]: every row group of slice j moved, reduced and read by CTA j * G + g % G
    on every rank, paired by the same two barriers: no bad read (2 ranks x 2 CTAs)."""
    assert _bad_reads((2, 2), WIDE_SEQUENCES[name], halves=True, final_barrier=False) == set()


def test_wide_twoshot_two_ctas_per_slice():
    """The same with G = 2 CTAs per slice (2 ranks x 4 CTAs, one pull-wide call: about 40 s)."""
    calls = [("twoshot", 2, "pull-wide")]
    assert _bad_reads((2, 4), calls, halves=True, final_barrier=False) == set()


@pytest.mark.parametrize("form", ["push-wide-skew", "pull-wide-skew"])
def test_wide_twoshot_model_can_fail(form):
    """Phase 3 on the CTAs of another slice reads gathered rows no barrier ordered."""
    assert _bad_reads((2, 2), [("twoshot", 2, form)], halves=True, final_barrier=False) != set()


def test_epilogue_gather_model_can_fail():
    """With the q pushes before the first barrier the model finds the overwrite: a peer's next
    call lands on q rows a slower rank still copies out."""
    calls = [("rsgather", 1, "early"), ("rsgather", 2, "early")]
    assert any(_bad_reads(shape, calls, halves=True, final_barrier=False) for shape in SHAPES)

# NOTE [copy-out by rounds]: the pipelined form's rounds (two or three per CTA: 2 ranks x 2 CTAs,
# 3 ranks x 1 CTA), back to back and beside the other algorithms
RSROUNDS_SEQUENCES = {
    "rounds-rounds": [("rsrounds", 2, None), ("rsrounds", 2, None)],
    "rounds3-rounds": [("rsrounds", 3, None), ("rsrounds", 2, None)],
    "rsgather-rounds-rsgather": [("rsgather", 2, None), ("rsrounds", 2, None),
                                 ("rsgather", 2, None)],
    "rounds-oneshot": [("rsrounds", 2, None), ("oneshot", 2, None)],
    "push-rounds": [("twoshot", 1, "push"), ("rsrounds", 2, None)],
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}ranks{s[1]}ctas")
@pytest.mark.parametrize("name", RSROUNDS_SEQUENCES)
def test_copy_out_by_rounds_reads_only_its_own_call(name, shape):
    """Every q row copied out after a round's barrier was pushed by its peer in this call, and no
    peer's next call lands on a row still to be copied."""
    calls = _scaled(RSROUNDS_SEQUENCES[name], shape[1])
    assert _bad_reads(shape, calls, halves=True, final_barrier=False) == set()


def test_copy_out_by_rounds_model_can_fail():
    """With each round's copy before its barrier a rank copies out q rows not yet pushed."""
    calls = [("rsrounds", 4, "early-copy"), ("rsrounds", 4, "early-copy")]
    assert _bad_reads((2, 2), calls, halves=True, final_barrier=False) != set()


# NOTE [reduce-scatter roles by TMA] (kernels/rolespush.py): pusher and finisher CTAs, per-group
# epoch flags and per-rank completion counts instead of same-index barriers; (ranks, CTAs, pushers)
ROLES_SHAPES = [(2, 2, 1), (2, 3, 1), (2, 3, 2), (3, 2, 1)]


def _roles(calls: list, pushers: int, variant: str = "") -> list:
    """The calls with every roles-tma call's form set to (pushers, variant)."""
    return [(algo, size, (pushers, variant) if algo.startswith("roles") else form)
            for algo, size, form in calls]


ROLES_SEQUENCES = {
    "roles-roles": [("roles", 2, None), ("roles", 3, None)],
    "gather-gather": [("roles-gather", 1, None), ("roles-gather", 2, None)],
    "roles-gather-roles": [("roles", 2, None), ("roles-gather", 2, None), ("roles", 1, None)],
    "gather-oneshot": [("roles-gather", 2, None), ("oneshot", 2, None)],
    "gather-rsgather": [("roles-gather", 2, None), ("rsgather", 2, None)],
    "rsgather-gather": [("rsgather", 2, None), ("roles-gather", 2, None)],
    "roles-push": [("roles", 2, None), ("twoshot", 2, "push")],
    "pull-roles-rounds": [("twoshot", 1, "pull"), ("roles", 2, None), ("rsrounds", 3, None)],
    "rounds-gather": [("rsrounds", 3, None), ("roles-gather", 2, None)],
}


@pytest.mark.parametrize("shape", ROLES_SHAPES, ids=lambda s: f"{s[0]}ranks{s[1]}ctas{s[2]}p")
@pytest.mark.parametrize("name", ROLES_SEQUENCES)
def test_roles_tma_reads_only_its_own_call(name, shape):
    """Finishers read only slot rows and q rows of their own call, no rank's next call (roles-tma
    or another algorithm) lands on rows a peer still reads, and no wait can hang."""
    world, ctas, pushers = shape
    if world > 2:  # ~90 s of the suite's time in all: CI runs them, GPU machines' suites skip them
        from cute_compile import skip_compile_check_where_a_gpu_is
        skip_compile_check_where_a_gpu_is("the 3-rank roles-tma models are minutes of pure Python")
    stuck: list = []
    bad = _bad_reads((world, ctas), _roles(ROLES_SEQUENCES[name], pushers), halves=True,
                     final_barrier=False, stuck=stuck)
    assert bad == set()
    assert stuck == []


@pytest.mark.parametrize("variant,calls", [
    ("no-flag-wait", [("roles", 2, None)]),
    ("no-end-wait", [("roles", 2, None), ("roles", 2, None)]),
    ("no-end-wait", [("roles", 2, None), ("oneshot", 2, None)]),
    ("start-wait", [("roles", 2, None), ("oneshot", 2, None)]),
    ("start-wait", [("roles", 2, None), ("rsgather", 2, None)]),
    ("early-done", [("roles", 2, None), ("roles", 2, None)]),
    ("no-copy-wait", [("roles-gather", 2, None)]),
])
def test_roles_tma_model_can_fail(variant, calls):
    """Each wait removed (or moved) gives a bad read in some shape: the flags order the slot reads
    after the pushes, the completion count at the end of a call keeps the next call's pushes (of
    any algorithm: a wait at the start of the next roles-tma call is not enough) off rows still
    read, the count after the last read, and the copy-out's wait orders it after the q pushes.
    (With the gather, the copy-out's wait on every peer's count is that completion wait too.)"""
    assert any(_bad_reads(shape[:2], _roles(calls, shape[2], variant), halves=True,
                          final_barrier=False) for shape in ROLES_SHAPES[:3])


def test_roles_tma_model_finds_a_hang():
    """The hang check is not vacuous: finishers that wait for the peers' counts before adding
    their own wait for each other forever."""
    stuck: list = []
    _bad_reads((2, 2), _roles([("roles-gather", 1, None)], 1, "wait-before-done"), halves=True,
               final_barrier=False, stuck=stuck)
    assert stuck


def test_roles_tma_gather_needs_no_end_wait():
    """With the gather the copy-out waits for every peer's completion count before the kernel
    ends, which is all the pushers' end wait gives: without it no bad read, before any algorithm."""
    for calls in ([("roles-gather", 2, None), ("oneshot", 2, None)],
                  [("roles-gather", 2, None), ("roles-gather", 2, None)]):
        assert _bad_reads((2, 3), _roles(calls, 1, "no-end-wait"), halves=True,
                          final_barrier=False) == set()


def test_roles_tma_start_wait_between_roles_calls():
    """The brief's first design, the next call's pushers waiting for the previous call's count
    before their first store into a peer, is safe between two roles-tma calls: what fails is only
    another algorithm after it (test_roles_tma_model_can_fail)."""
    calls = _roles([("roles-gather", 2, None), ("roles-gather", 3, None)], 1, "start-wait")
    assert _bad_reads((2, 3), calls, halves=True, final_barrier=False) == set()
