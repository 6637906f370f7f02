"""Which rank runs which test when a launcher starts the suite on several ranks.

Under ``torchrun --nproc-per-node N`` / ``mpirun -np N`` every rank collects the same tests. Tests
marked ``multigpu`` are collective and run on every rank; the others (per-process tests: CPU tests,
the single-GPU grid) are split so that each runs on one rank only. Items are split in groups: a
test marked ``@pytest.mark.shard_by("a", "b")`` puts the items that share the values of parameters
``a`` and ``b`` into one group (one rank compiles a kernel once and runs all of its cases); any
other item is its own group. Groups go to ranks round robin, in collection order.
``DISTNORM_SHARD=0`` turns the split off (every rank runs every test).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

SHARD_VAR = "DISTNORM_SHARD"


def sharding_enabled(environ: Mapping[str, str]) -> bool:
    """DISTNORM_SHARD: "1" or unset splits the per-process tests over the ranks, "0" does not."""
    value = environ.get(SHARD_VAR, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SHARD_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


def group_owners(keys: Sequence[Hashable], world_size: int) -> list[int]:
    """The rank that runs each item: equal keys form a group, groups are numbered in order of
    first appearance and group g goes to rank g % world_size."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    numbers: dict[Hashable, int] = {}
    return [numbers.setdefault(key, len(numbers)) % world_size for key in keys]


@dataclass(frozen=True)
class ShardPlan:
    """What one rank runs: the indices of its items, and the counts for the summary line."""

    rank: int
    world_size: int
    collective: tuple[int, ...]   # indices of tests every rank runs (multi-GPU)
    mine: tuple[int, ...]         # indices of per-process tests this rank runs
    per_process_total: int        # per-process tests over all ranks
    groups_total: int

    @property
    def order(self) -> list[int]:
        """Run order here: collective tests first, so no rank waits in a collective for a peer
        that is still busy with its own share."""
        return list(self.collective) + list(self.mine)

    def summary(self) -> str:
        r, n = self.rank, self.world_size
        return (f"rank {r} of {n} ran {len(self.mine)} of {self.per_process_total} per-process "
                f"tests (groups {r}, {r + n}, {r + 2 * n}, ... of {self.groups_total}) and "
                f"{len(self.collective)} multi-GPU tests (on every rank); {SHARD_VAR}=0 runs "
                "everything on every rank")


def plan_shard(keys: Sequence[Hashable | None], rank: int, world_size: int) -> ShardPlan:
    """Split items for ``rank``: ``keys[i]`` is item i's group key, or None for a collective item."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    per_process = [i for i, key in enumerate(keys) if key is not None]
    owners = group_owners([keys[i] for i in per_process], world_size)
    return ShardPlan(
        rank=rank, world_size=world_size,
        collective=tuple(i for i, key in enumerate(keys) if key is None),
        mine=tuple(i for i, owner in zip(per_process, owners) if owner == rank),
        per_process_total=len(per_process),
        groups_total=len({keys[i] for i in per_process}),
    )
