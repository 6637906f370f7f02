#!/usr/bin/env bash
# Every multi-GPU check and table of this project on N GPUs of one host, cut into steps that each
# fit a 10-minute device call (the lent machines' limit), so a session that gets 2 / 4 / 8 GPUs for
# half an hour spends it measuring. Logs and tables go under $OUT (default ./multi_gpu_out).
#
#   STEP=tests-torchrun N=2 bash benchmarks/multi_gpu_plan.sh     # one step
#   STEP=list bash benchmarks/multi_gpu_plan.sh                   # the steps
#   GPUS=2,3 PORT=29612 STEP=seqpar N=2 bash ...                  # on GPUs 2 and 3 only
#   STEP=pairs A=tests-torchrun B=tests-mpirun N=2 bash ...       # two 2-GPU steps side by side on a
#                                                                 # 4-GPU machine: A on GPUs 0,1, B on 2,3
# (pairs: each step gets its own GPUs, torchrun port and log names; the host's CPUs and kernel cache
# are shared, so times are a little above a machine to themselves. 2026-11-27 on nvidia-h200-x4 the
# launchers' suites side by side took 330 / 336 s, as one alone did on nvidia-h200-x2 before.)
#
# Steps (what each checks; the results file it writes, for benchmarks/README.md and docs/TESTING_LOG.md):
#   tests-torchrun  torchrun --nproc-per-node N -m pytest tests (the whole suite, every rank)
#   tests-mpirun    mpirun -np N python -m pytest tests
#   tests-plain     python -m pytest tests (self-spawns the multi-GPU tests), then python -m distnorm;
#                   PLAIN="tests/multigpu" or PLAIN="tests --ignore=tests/multigpu" runs a part (the
#                   whole suite takes ~530 s on 2 GPUs: two calls keep each under the 600 s limit)
#   faults          tests/multigpu/test_faults_gpu.py -s: when each fault's error arrives
#   allreduce       bench_allreduce_fusion.py: fused all-reduce vs NCCL / symm-mem / unfused / FlashInfer
#   seqpar          bench_seqpar.py: reduce-scatter + norm + quant + gather vs all-reduce and the chain
#   fallback        bench_fallback.py --buffer-mib 256 --parts: the path without peer memory vs NCCL + fused op,
#                   and its pieces alone (NCCL all_reduce / all_gather / all_to_all of x, the fused op, the fold);
#                   from 4 GPUs also the node chain (--ranks-per-node N/2: peer kernels inside each half, NCCL between)
#   tp-layer        bench_tp_layer.py, bf16 and --fp8: the TP decoder layer in its five forms
#   push            bench_push.py: GB/s of pushes into the next rank's buffer by CTA count, thread
#                   stores against TMA bulk copies (issue 13's TMA lever; measurement only)
#   shared-world    RANKS ranks (default 8) sharing the N GPUs (DISTNORM_SHARE_GPUS=1, time-sliced):
#                   the all-reduce, forms and row-split GPU tests (FILES="..." others) at a world
#                   size no machine lends (issue 14); correctness only
#   rs-forms        the reduce-scatter's forms (NOTE [reduce-scatter rounds]: serial, pipelined,
#                   pipelined-2 / -8 / -16 / -32 / -g2 / -g4): the forms and row-split GPU tests,
#                   then bench_seqpar's gathered forms and the reduce-scatter alone at 512-16384
#                   rows (a column per form, _r1 / _pipe_r1 / _pipe2_r1 with one row per CTA, _lin / _g2_lin
#                   with swizzled scales pushed linear and laid out after the kernel (gather_by "epilogue");
#                   the all-reduces alone beside them)
#   sanitize        compute-sanitizer memcheck: the canaries first (tests/sanitizer_canary.py: a
#                   thread-store and a bulk-copy write where nothing is mapped must each be
#                   reported, else a clean run says nothing), then the reduce-scatter forms test
#                   (RS_FORMS, default serial + the two TMA forms, unverified ones included) and
#                   the all-reduce forms test on N ranks, waits given 150 s; 0 errors expected
#   faults-ab       fault handling's cost: bench_allreduce_fusion's distnorm cases from 06bbda4 (which
#                   brought it), its parent and this tree, alternated (benchmarks/ab_trees.py)
#   tuning          bench_allreduce_fusion's fused FP8 and plain cases with the two-shot forms
#                   (pull-gather, pull), lamport's poll-unseen and CTA caps 16 / 32 / 64 beside the
#                   defaults (issue 14: what the forms and grid per world size should be; none of
#                   them measured at world 4 or 8 yet)
#   twoshot-forms   every two-shot form (NOTE [two-shot forms], [wide two-shot], [two-shot rounds]):
#                   test_forms_gpu.py, then bench_allreduce_fusion's two-shot fused FP8 / plain with
#                   each new form beside the defaults, symm-mem two-shot and NCCL, 8..16384 rows
#   ab              AB_TREES=DIR: bench_allreduce_fusion from every tree DIR/* (made beforehand by
#                   benchmarks/make_ab_trees.sh: the device copy has no .git) and this one
#                   ("here"), alternated; AB_ARGS: the benchmark's arguments (default: the distnorm
#                   cases at 1..2048 rows, H 4096 and 8192); AB_BENCH: allreduce_fusion (default),
#                   seqpar or fallback
#   tree-tests      AB_TREES=DIR: tests/multigpu (torchrun, N ranks) from every tree DIR/* in turn,
#                   each with its own code and kernel cache (a branch's GPU tests before it lands)
set -uo pipefail
N=${N:-2}
OUT=${OUT:-multi_gpu_out}
STEP=${STEP:-list}
PORT=${PORT:-29500}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: tree-tests runs from each tree's folder
tag=${TAG:-h200_x$N}  # the results' suffix (TAG=... keeps two runs of a step apart)
if [ -n "${GPUS:-}" ]; then export CUDA_VISIBLE_DEVICES=$GPUS; fi
if [ "$STEP" = pairs ]; then
  [ -n "${A:-}" ] && [ -n "${B:-}" ] || { echo "STEP=pairs needs A=<step> and B=<step>" >&2; exit 2; }
  GPUS=0,1 PORT=29611 STEP=$A bash "$0" & pa=$!
  GPUS=2,3 PORT=29612 STEP=$B bash "$0" & pb=$!
  wait $pa; ra=$?; wait $pb; rb=$?
  exit $((ra > rb ? ra : rb))
fi
pack_runs() {  # pack_runs NAME: $OUT/NAME_runs (one file per tree and round) into one archive, as
  # the device tool brings back at most 8 files from $OUT (a run with 6 trees lost its other results)
  [ -d "$OUT/$1_runs" ] || return 0
  rm -rf "$OUT/$1_runs"/kernel_cache_*
  tar -C "$OUT" -cJf "$OUT/$1_runs.tar.xz" "$1_runs" && rm -rf "${OUT:?}/$1_runs"
}
run() {  # run NAME CMD...: the command's output in $OUT/NAME.log, its time and status printed
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $((SECONDS - t0)) s [GPUs ${CUDA_VISIBLE_DEVICES:-all}] ($*)"
  grep -E "passed|failed|skipped|error" "$OUT/$name.log" | tail -n "$((N + 1))"
  return $rc
}
case $STEP in
  list) sed -n '/^# Steps/,/^set /p' "$0" | sed '$d' ;;
  tests-torchrun) run tests_torchrun torchrun --master-port "$PORT" --nproc-per-node "$N" -m pytest tests -q -rfs -p no:cacheprovider --durations=25 ;;
  tests-mpirun) xs=(); for v in PYTHONPATH PATH LD_LIBRARY_PATH CUDA_VISIBLE_DEVICES; do [ -n "${!v:-}" ] && xs+=(-x "$v"); done
      run tests_mpirun mpirun --allow-run-as-root --bind-to none -np "$N" "${xs[@]}" \
      python -m pytest tests -q -rfs -p no:cacheprovider --durations=25 ;;
  tests-plain) read -ra plain <<< "${PLAIN:-tests}"
      run tests_plain python -m pytest "${plain[@]}" -q -rfs -p no:cacheprovider --durations=25
               run main_job python -m distnorm ;;
  faults) run faults torchrun --master-port "$PORT" --nproc-per-node "$N" -m pytest tests/multigpu/test_faults_gpu.py -q -s -rfs ;;
  allreduce) run allreduce torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_allreduce_fusion.py \
      --out "$OUT/allreduce_fusion_$tag" ;;
  seqpar) run seqpar torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_seqpar.py --out "$OUT/seqpar_$tag" ;;
  fallback) rpn=(); [ "$N" -ge 4 ] && rpn=(--ranks-per-node $((N / 2)))  # and the node chain of two N/2-GPU "nodes"
      run fallback torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_fallback.py --buffer-mib 256 \
      --parts "${rpn[@]}" --out "$OUT/fallback_$tag" ;;
  push) run push torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_push.py \
      --out "$OUT/push_$tag" ;;
  shared-world) read -ra files <<< "${FILES:-tests/multigpu/test_allreduce_gpu.py tests/multigpu/test_forms_gpu.py tests/multigpu/test_rowsplit_gpu.py}"
      DISTNORM_SHARE_GPUS=1 run shared_world torchrun --master-port "$PORT" \
      --nproc-per-node "${RANKS:-8}" -m pytest "${files[@]}" -q -rfs -p no:cacheprovider ;;
  tp-layer) run tp_layer torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_tp_layer.py --model 8b \
      --out "$OUT/tp_layer_$tag"
            run tp_layer_fp8 torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_tp_layer.py --model 8b --fp8 \
      --out "$OUT/tp_layer_fp8_$tag" ;;
  rs-forms) run rs_forms torchrun --master-port "$PORT" --nproc-per-node "$N" -m pytest \
      tests/multigpu/test_forms_gpu.py tests/multigpu/test_rowsplit_gpu.py -q -rfs -p no:cacheprovider &&
            run seqpar_rounds torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_seqpar.py \
      --no-compile --tokens 512 2048 8192 16384 --hidden 4096 8192 --formats fp8 nvfp4 \
      --cases '^(dn_rs_(fp8|nvfp4)(_gather)?(_serial|_pipe|_pipe2|_pipe8|_pipe16|_pipe32|_g2|_g4|_r1|_pipe_r1|_pipe2_r1|_lin|_g2_lin)?|dn_ar|nccl_ar|symm2)$' \
      --out "$OUT/seqpar_rounds_$tag" ;;
  sanitize) mc=(compute-sanitizer --tool memcheck --report-api-errors no --target-processes all
          --error-exitcode 9 --print-limit 200)
      for m in st tma; do  # each canary must be caught: rc 9 from the sanitizer
        run "canary_$m" "${mc[@]}" python tests/sanitizer_canary.py "$m"
        [ $? -eq 9 ] || echo "canary $m: memcheck did not report the bad write: a clean run below proves nothing"
      done
      DISTNORM_UNVERIFIED_FORMS=1 DISTNORM_RS_FORMS=${RS_FORMS:-serial,pipelined-tma,roles-tma} \
      DISTNORM_BARRIER_TIMEOUT_S=150 DISTNORM_HOST_TIMEOUT_S=150 run memcheck_forms "${mc[@]}" \
      torchrun --master-port "$PORT" --nproc-per-node "$N" -m pytest tests/multigpu/test_forms_gpu.py \
      -k "reducescatter or test_forms_agree" -q -rfs -p no:cacheprovider ;;
  faults-ab) wt=${AB_TREES:-}   # AB_TREES=DIR: DIR/before and DIR/after made beforehand (the device copy has no .git):
      # mkdir -p DIR/before DIR/after && git archive 06bbda4^ | tar -x -C DIR/before && git archive 06bbda4 | tar -x -C DIR/after
      if [ -z "$wt" ]; then wt=$(mktemp -d)
        git worktree add -f --detach "$wt/before" 06bbda4^ >/dev/null 2>&1 &&
        git worktree add -f --detach "$wt/after" 06bbda4 >/dev/null 2>&1 || { echo "faults-ab: no git history here (set AB_TREES)" >&2; exit 2; }
      fi
      PET_MASTER_PORT=$PORT run faults_ab python benchmarks/ab_trees.py --bench allreduce_fusion --nproc "$N" \
      --tree "before=$wt/before" --tree "after=$wt/after" --tree "main=." --rounds 2 \
      --out "$OUT/faults_ab_$tag" -- --no-compile --tokens 1 128 2048 8192 --hidden 4096 --cases '^dn_' ;;
  tuning) run tuning torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_allreduce_fusion.py \
      --no-compile --tokens 1 8 32 128 512 2048 8192 --hidden 4096 8192 --cases '^dn_(fp8|ar)_' \
      --tuning pg:form=pull-gather pl:form=pull pu:lform=poll-unseen c16:ctas=16 c32:ctas=32 c64:ctas=64 \
      --out "$OUT/tuning_forms_$tag" ;;
  twoshot-forms) run forms torchrun --master-port "$PORT" --nproc-per-node "$N" -m pytest \
      tests/multigpu/test_forms_gpu.py -q -rfs -p no:cacheprovider &&
      run twoshot_forms torchrun --master-port "$PORT" --nproc-per-node "$N" benchmarks/bench_allreduce_fusion.py \
      --no-compile --tokens 8 32 128 512 2048 8192 16384 --hidden 4096 8192 \
      --cases '^(dn_(fp8|ar)_twoshot|symm2|nccl_ar)' --tuning pw:form=push-wide lw:form=pull-wide \
      pw1:form=push-wide,rpcts=1 pr:form=push-rounds lr:form=pull-rounds --out "$OUT/twoshot_forms2_$tag" ;;
  ab) [ -d "${AB_TREES:-}" ] || { echo "STEP=ab needs AB_TREES=DIR with one tree per subfolder" >&2; exit 2; }
      trees=(); for d in "$AB_TREES"/*/; do d=${d%/}; trees+=(--tree "$(basename "$d")=$d"); done
      # shellcheck disable=SC2086
      PET_MASTER_PORT=$PORT run ab python benchmarks/ab_trees.py --bench "${AB_BENCH:-allreduce_fusion}" --nproc "$N" \
      "${trees[@]}" --tree here=. --rounds 2 --out "$OUT/ab_$tag" -- \
      ${AB_ARGS:---no-compile --tokens 1 8 32 128 512 2048 --hidden 4096 8192 --cases ^dn_}
      rc=$?; pack_runs "ab_$tag"; exit $rc ;;
  tree-tests) [ -d "${AB_TREES:-}" ] || { echo "STEP=tree-tests needs AB_TREES=DIR with one tree per subfolder" >&2; exit 2; }
      rc=0
      for d in "$AB_TREES"/*/; do d=${d%/}; name=$(basename "$d")
        (cd "$d" && PYTHONPATH="$d:${PYTHONPATH:-}" DISTNORM_KERNEL_CACHE="$d/.kernel_cache" \
         run "tree_tests_$name" torchrun --master-port "$PORT" --nproc-per-node "$N" -m pytest tests/multigpu \
         -q -rfs -p no:cacheprovider) || rc=1
      done
      exit $rc ;;
  *) echo "STEP=$STEP: expected one of list, pairs, tests-torchrun, tests-mpirun, tests-plain," \
          "faults, allreduce, seqpar, fallback, tp-layer, push, shared-world, rs-forms, sanitize, faults-ab, tuning," \
          "twoshot-forms, ab," \
          "tree-tests" >&2; exit 2 ;;
esac
