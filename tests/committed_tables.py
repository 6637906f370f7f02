"""The benchmark tables committed under benchmarks/results/, for CPU tests that hold the `auto`
choices (collectives/plan.py, nopeer.form_for) to what was measured."""
from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                       "results")


def committed_table(name: str) -> dict:
    """benchmarks/results/<name>.json: {"meta": {...}, "rows": [{column: value}, ...]}."""
    with open(os.path.join(RESULTS, name + ".json")) as f:
        return json.load(f)


def slower_than_fastest(us: dict, pick: str, tolerance: float = 1.03) -> bool:
    """Whether `pick`'s time in `us` ({choice: us per call}) is over `tolerance` x the fastest."""
    return us[pick] > tolerance * min(us.values())
