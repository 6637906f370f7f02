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
