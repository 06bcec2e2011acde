#!/usr/bin/env bash
# The GPU measurements behind the README's tables, one lent-machine call per stage (docs/gpu_machines.md).
# Each stage runs its sweep, writes the report beside it, and packs the run directories (config.json,
# metrics.json, overrides, report; no per-request or per-step logs unless PACK_STEPS=1) into one tarball
# under $OUT, with the ledger rows the reports appended ($OUT/ledger_rows.csv).
#   bash experiments/gpu_round.sh gputests     # pytest -m gpu, one line per test ($OUT/gpu_tests.txt); needs no
#                                              # staged model (SmolLM2 tests skip until it is converted)
#   bash experiments/gpu_round.sh batch1       # README table 1: all 164 HumanEval prompts at batch 1, plain and
#                                              # the EAGLE-3 trees (BATCH1_METHODS)
#   bash experiments/gpu_round.sh envelope     # README table 2: policy_envelope for one drafter (ENVELOPE_DRAFT,
#                                              # eagle3_smollm2_trees) and workload (ENVELOPE_WORKLOADS, humaneval;
#                                              # one workload fits a 10-minute call), staggered (ENVELOPE_EXTRA)
#   bash experiments/gpu_round.sh crossover8b  # README table 3: the 8B-shape crossover, replayed trace
#                                              # (CROSSOVER_MEAN=6: parametric; CROSSOVER_C / _POLICIES / _TAG)
#   bash experiments/gpu_round.sh step8b       # the 8B-shape step split into phases, and the step floor
#   bash experiments/gpu_round.sh profile      # profile_step.py PROFILE_ARGS (e.g. "--ab fused_rows=null,64")
#   bash experiments/gpu_round.sh moe          # MoE at Qwen3 shapes: experiments/bench_moe.py and +experiment=step_qwen3
#                                              # (each skipped while it is not in the tree)
#   bash experiments/gpu_round.sh stepmoe      # +experiment=step_moe, one run per target (STEPMOE_TARGETS; a
#                                              # 30B-A3B target on a card under 100 GB stops at B = 64)
#   XMOE_TARGET=T bash experiments/gpu_round.sh crossovermoe   # crossover_moe for one target, one trace
#                                              # (XMOE_MEAN: 2.5 parametric, null the SmolLM2 trace) and one group
#                                              # of C (XMOE_C, 1,4,16,64): 16 runs, 3-4 minutes at 30B-A3B shapes
#   SWEEP_NAME=N SWEEP_ARGS="..." bash experiments/gpu_round.sh sweep   # any one multirun, packed as N.tgz
# Back here: tar xzf FILE -C DIR; append $OUT/ledger_rows.csv to experiments/results/ledger.csv.
set -uo pipefail
STAGES="gputests batch1 envelope crossover8b step8b profile moe stepmoe crossovermoe sweep"
stage=${1:?stage: one of $STAGES}
case " $STAGES " in *" $stage "*) ;; *) echo "unknown stage $stage; valid: $STAGES" >&2; exit 64 ;; esac
: "${OUT:?OUT must name the folder whose files come back}"
source experiments/lent_gpu_setup.sh >/dev/null 2>&1
export WANDB_MODE=disabled SPECDEC_COMMIT=${SPECDEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
R=/root/runs-$SPECDEC_COMMIT
LEDGER=experiments/results/ledger.csv
mkdir -p "$R" "$OUT"
ledger0=$(wc -l < "$LEDGER" 2>/dev/null || echo 0)
run() { local t=$1; shift; echo "+ $*"; timeout "$t" "$@" > "$R/last.log" 2>&1; local rc=$?; echo "rc=$rc"; tail -n 4 "$R/last.log"; }
report() { python -m specdec.report "$R/$1" --out "$R/$1/report" > /dev/null 2>&1; sed -n "/^## $2/,/^## /p" "$R/$1/report/report.md" 2>/dev/null | head -n 40; }
pack() {  # pack NAME DIR...: the small files of finished runs (PACK_STEPS=1: with each run's steps.jsonl;
  # PACK_REQUESTS=1: with requests.jsonl, so a report here can compare outputs across folders, e.g. exact mode)
  local steps=(--exclude=steps.jsonl) reqs=(--exclude=requests.jsonl)
  [ "${PACK_STEPS:-0}" = 1 ] && steps=()
  [ "${PACK_REQUESTS:-0}" = 1 ] && reqs=()
  tar czf "$OUT/$1.tgz" "${reqs[@]}" --exclude=.hydra "${steps[@]}" --exclude='*.log' -C "$R" "${@:2}" 2>/dev/null
  ls -l "$OUT/$1.tgz"
}
case "$stage" in
gputests)  # GPU_TESTS_FILES: test files to run (default: all of tests/)
  # shellcheck disable=SC2086  # GPU_TESTS_FILES: paths, split on spaces
  SPECDEC_TESTS_OFFLINE=1 timeout ${GPU_TESTS_S:-560} python -m pytest -m gpu -v -rfEs -p no:cacheprovider ${GPU_TESTS_FILES:-} \
    > "$OUT/gpu_tests.txt" 2>&1; echo "rc=$?"
  grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.txt" | tail -n 20 ;;
batch1)
  run ${BATCH1_S:-300} python -m specdec.run --multirun +experiment=eagle3_humaneval_full \
    "+method=${BATCH1_METHODS:-plain,eagle3_tree16,eagle3_tree16_deep,eagle3_tree20_deep}" ${BATCH1_EXTRA:-} \
    hydra.sweep.dir="$R/humaneval_full"
  report humaneval_full Speculation
  pack batch1 humaneval_full ;;
envelope)
  n=${ENVELOPE_NAME:-envelope}
  # shellcheck disable=SC2086  # ENVELOPE_EXTRA: overrides, split on spaces
  run ${ENVELOPE_S:-560} python -m specdec.run --multirun +experiment=policy_envelope draft=${ENVELOPE_DRAFT:-eagle3_smollm2_trees} \
    workload=${ENVELOPE_WORKLOADS:-humaneval} ${ENVELOPE_EXTRA:-workload.stagger=true} hydra.sweep.dir="$R/$n"
  report "$n" "Policy envelope"
  pack "$n" "$n" ;;
crossover8b)  # every policy x C of one trace is 54 runs (8-21 s each): two calls, e.g. CROSSOVER_C=1,2,4,8,16,32
  # CROSSOVER_TAG=lo, then CROSSOVER_C=64,128,256 CROSSOVER_TAG=hi; `python -m specdec.report DIR_lo DIR_hi` reads both
  m=${CROSSOVER_MEAN:-null}; d=crossover_8b; [ "$m" = null ] || d=crossover_8b_parametric; d=$d${CROSSOVER_TAG:+_$CROSSOVER_TAG}
  # shellcheck disable=SC2086  # CROSSOVER_EXTRA: overrides, split on spaces
  run ${CROSSOVER_S:-560} python -m specdec.run --multirun +experiment=crossover_8b acceptance.parametric.mean=$m \
    policy=${CROSSOVER_POLICIES:-never,always3,always16,always48,batch_threshold,goodput} \
    workload.concurrency=${CROSSOVER_C:-1,2,4,8,16,32,64,128,256} ${CROSSOVER_EXTRA:-} hydra.sweep.dir="$R/$d"
  report "$d" "Crossover,"
  pack "$d" "$d" ;;
step8b)  # the graphed EAGLE-3 step at 8B shapes split into draft / verify / commit beside plain, then the
  # batch-1 plain step beside the weight-bandwidth floor (8B shapes and SmolLM2)
  run ${STEP8B_S:-240} python -m specdec.run --multirun +experiment=step_8b ${STEP8B_EXTRA:-} hydra.sweep.dir="$R/step_8b"
  report step_8b "Step breakdown"
  run ${FLOOR_S:-150} python -m specdec.run --multirun +experiment=step_floor hydra.sweep.dir="$R/step_floor"
  report step_floor "Step time"
  pack step8b step_8b step_floor ;;
profile)  # graphed steps per kernel, replay vs kernel time; PROFILE_ARGS: e.g. "--shape llama8b --phases --trees tree16,tree48"
  # shellcheck disable=SC2086  # PROFILE_ARGS: arguments, split on spaces
  run ${PROFILE_S:-300} python experiments/profile_step.py ${PROFILE_ARGS:---steps-only} --out "$R/profile"
  tail -n 40 "$R/last.log"
  pack profile profile ;;
moe)  # MoE at Qwen3 shapes: the kernel bench, then the graphed step experiment; each part runs when it is in the tree
  mkdir -p "$R/moe"
  if [ -f experiments/bench_moe.py ]; then
    # shellcheck disable=SC2086  # MOE_BENCH_ARGS: arguments, split on spaces
    run ${MOE_BENCH_S:-240} python experiments/bench_moe.py --out "$R/moe" ${MOE_BENCH_ARGS:-}
    cp "$R/last.log" "$R/moe/bench_moe.txt"; tail -n 30 "$R/moe/bench_moe.txt"
  else
    echo "experiments/bench_moe.py is not in this tree: skipped"
  fi
  if [ -f conf/experiment/step_qwen3.yaml ]; then
    run ${MOE_STEP_S:-300} python -m specdec.run --multirun +experiment=step_qwen3 ${MOE_STEP_EXTRA:-} hydra.sweep.dir="$R/moe/step_qwen3"
    report moe/step_qwen3 "Step breakdown"
  else
    echo "conf/experiment/step_qwen3.yaml is not in this tree: skipped"
  fi
  pack moe moe ;;
stepmoe)
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  for t in ${STEPMOE_TARGETS:-qwen3_8b_random qwen3_30b_a3b_random qwen3_30b_a3b_random_uniform qwen3_30b_a3b_random_zipf}; do
    lim=()  # 61 GB of 30B-A3B weights leave an 80 GB card the KV of B <= 64 (conf/experiment/step_moe.yaml)
    case "$t" in *30b*) [ "${mem:-0}" -lt 100000 ] && lim=(engine.max_batch_size=64 'engine.profile_spec_steps=[1,2,4,8,16,32,64]') ;; esac
    run ${STEPMOE_S:-200} python -m specdec.run --multirun +experiment=step_moe target="$t" "${lim[@]}" \
      hydra.sweep.dir="$R/step_moe/$t"
  done
  report step_moe "MoE step cost"
  pack step_moe step_moe ;;
crossovermoe)  # the sweep of one target x trace x C group (conf/experiment/crossover_moe.yaml lists the groups)
  t=${XMOE_TARGET:?XMOE_TARGET: e.g. qwen3_30b_a3b_random}; m=${XMOE_MEAN:-2.5}
  n=crossover_moe_${t}_${m}${XMOE_TAG:+_$XMOE_TAG}
  # shellcheck disable=SC2086  # XMOE_EXTRA: overrides, split on spaces
  run ${XMOE_S:-560} python -m specdec.run --multirun +experiment=crossover_moe target="$t" acceptance.parametric.mean="$m" \
    workload.concurrency=${XMOE_C:-1,4,16,64} ${XMOE_EXTRA:-} hydra.sweep.dir="$R/$n"
  report "$n" "Crossover,"
  pack "$n" "$n" ;;
sweep)
  n=${SWEEP_NAME:?SWEEP_NAME}
  # shellcheck disable=SC2086  # SWEEP_ARGS: overrides, split on spaces
  run ${SWEEP_S:-300} python -m specdec.run --multirun ${SWEEP_ARGS:?SWEEP_ARGS} hydra.sweep.dir="$R/$n"
  python -m specdec.report "$R/$n" --out "$R/$n/report" > /dev/null 2>&1
  pack "$n" "$n" ;;
esac
# The ledger rows this call's reports appended (they land in this machine's copy of the tree).
tail -n +$((ledger0 + 1)) "$LEDGER" 2>/dev/null > "$OUT/ledger_rows.csv"
[ -s "$OUT/ledger_rows.csv" ] && wc -l "$OUT/ledger_rows.csv" || rm -f "$OUT/ledger_rows.csv"
