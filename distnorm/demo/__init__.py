"""The pieces of the main job, `python -m distnorm` (distnorm/__main__.py), one job each:

cases.py (what is run: the options, the format variants that fit H, the inputs), check.py (an
output against the reference), timing.py (us per call), table.py (the printed table), single.py
(one GPU, or the reference path on the CPU), multigpu.py (the fused all-reduce on every rank).
"""
