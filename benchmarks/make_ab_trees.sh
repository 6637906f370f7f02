#!/usr/bin/env bash
# Source trees for benchmarks/ab_trees.py and multi_gpu_plan.sh's `ab` / `tree-tests` steps, made
# on a machine with the git history (the device copy has none): one folder per revision under DIR
# (default .abtrees, which .git/info/exclude should list so it is not carried by accident), each the
# revision's tracked files without benchmarks/results.
#
#   bash benchmarks/make_ab_trees.sh .abtrees main=main twob=wip/twoshot-two-barriers
#   # then carry it: run(..., carry=[".whl", ".abtrees"]) with AB_TREES=$PWD/.abtrees
set -euo pipefail
dir=${1:?usage: make_ab_trees.sh DIR NAME=REV...}; shift
[ $# -gt 0 ] || { echo "make_ab_trees.sh: name at least one NAME=REV" >&2; exit 2; }
mkdir -p "$dir"
for spec in "$@"; do
  name=${spec%%=*}; rev=${spec#*=}
  [ -n "$name" ] && [ "$name" != "$spec" ] || { echo "make_ab_trees.sh: expected NAME=REV, got $spec" >&2; exit 2; }
  rm -rf "${dir:?}/$name" && mkdir -p "$dir/$name"
  git archive "$rev" | tar -x -C "$dir/$name"
  rm -rf "$dir/$name/benchmarks/results"
  echo "$dir/$name: $(git rev-parse --short "$rev") ($rev)"
done
